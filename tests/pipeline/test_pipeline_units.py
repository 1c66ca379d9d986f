"""Reconciliation pieces on small hand-written inputs: windows, billing, parsing, keys."""

from __future__ import annotations

import datetime as dt
import gzip
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from pipeline.inputs import VALID, parse_delivered, parse_ledger, read_jsonl, resolve
from pipeline.reconcile import (
    DEFAULT_BACKLOG_PATTERN,
    AuditOptions,
    billed_operations,
    classify,
    failover_windows,
    message_anomalies,
)
from pipeline.schemas import ACK_SCHEMA, DELIVERED_SCHEMA, LEDGER_SCHEMA

pytestmark = pytest.mark.timeout(300)


def test_the_backlog_pattern_is_the_gateways():
    """The pipeline's copy of the backlog path rule (it imports nothing from the gateway)."""
    from gateway.core.backlog import BACKLOG_PATH_PATTERN, backlog_path

    assert DEFAULT_BACKLOG_PATTERN == BACKLOG_PATH_PATTERN
    assert re.search(DEFAULT_BACKLOG_PATTERN, backlog_path("contoso", 7))


T0 = dt.datetime(2025, 3, 4, 10, 0, 0, tzinfo=dt.UTC)


def ts(seconds: float) -> str:
    return (T0 + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def naive(seconds: float) -> dt.datetime:
    return (T0 + dt.timedelta(seconds=seconds)).replace(tzinfo=None)


def ledger_line(n: int, seconds: float, event: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": 1,
        "event_id": f"{n:032x}",
        "ts": ts(seconds),
        "replica": fields.pop("replica", "gw-0"),
        "message_id": None,
        "entity": None,
        "event": event,
        "route": None,
        "backlog": None,
        "size": None,
        "latency_ms": None,
    }
    base.update(fields)
    return base


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, bytes) else orjson.dumps(r) for r in rows]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def load_ledger(spark: Any, tmp_path: Path, rows: list[Any]) -> Any:
    write_jsonl(tmp_path / "ledger.jsonl", rows)
    r = resolve("ledger", [str(tmp_path / "ledger.jsonl")], required=True)
    return parse_ledger(read_jsonl(spark, r, LEDGER_SCHEMA)).where(VALID).drop(VALID)


def test_failover_windows_pair_per_entity(spark: Any, tmp_path: Path) -> None:
    rows = [
        # orders: an end first (the data starts mid-window), then a start logged by two
        # replicas, a duplicate end, a start still open at the end of the data.
        ledger_line(1, 5, "failover_end", entity="orders", replica="gw-1"),
        ledger_line(2, 10, "failover_start", entity="orders", replica="gw-0"),
        ledger_line(3, 10.5, "failover_start", entity="Orders", replica="gw-1"),
        ledger_line(4, 40, "failover_end", entity="orders", replica="gw-1"),
        ledger_line(5, 41, "failover_end", entity="orders", replica="gw-0"),
        ledger_line(6, 70, "failover_start", entity="orders", replica="gw-0"),
        ledger_line(7, 20, "failover_start", entity="events", replica="gw-0"),
        ledger_line(8, 30, "failover_end", entity="events", replica="gw-0"),
    ]
    ledger = load_ledger(spark, tmp_path, rows)
    start, end = T0, T0 + dt.timedelta(seconds=100)
    got = [
        (
            r["entity"].lower(),
            r["start_ts"],
            r["end_ts"],
            r["opened_by"],
            r["closed_by"],
            r["duration_s"],
        )
        for r in failover_windows(ledger, start, end).collect()
    ]
    assert sorted(got, key=lambda g: (g[1], g[0])) == [
        ("orders", naive(0), naive(5), "start_of_data", "failover_end", 5.0),
        ("orders", naive(10), naive(40), "failover_start", "failover_end", 30.0),
        ("events", naive(20), naive(30), "failover_start", "failover_end", 10.0),
        ("orders", naive(70), naive(100), "failover_start", "end_of_data", 30.0),
    ]


def test_billed_operations_arithmetic(spark: Any, tmp_path: Path) -> None:
    kib = 1024
    rows = [
        ledger_line(1, 1, "accepted", message_id="a", entity="q", route="primary", size=100),
        ledger_line(
            2, 2, "accepted", message_id="b", entity="q", route="primary", size=64 * kib + 1
        ),
        ledger_line(
            3,
            3,
            "accepted",
            message_id="c",
            entity="q",
            route="backlog",
            backlog="n/x-servicebus-transfer/0",
            size=200 * kib,
        ),
        ledger_line(
            4,
            4,
            "syphoned",
            message_id="c",
            entity="q",
            backlog="n/x-servicebus-transfer/0",
            size=200 * kib,
        ),
        ledger_line(
            5, 5, "expired", message_id="d", entity="q", backlog="n/x-servicebus-transfer/0"
        ),
        ledger_line(6, 6, "ping", entity="q", size=0),
        ledger_line(7, 86400 + 7, "ping", entity="q"),  # the next day
        ledger_line(8, 8, "rejected", message_id="e", entity="q", size=100),  # not billed
        ledger_line(9, 9, "failover_start", entity="q"),  # not billed
    ]
    ledger = load_ledger(spark, tmp_path, rows)

    def ops(options: AuditOptions) -> dict[tuple[str, str], tuple[int, float]]:
        return {
            (str(r["day"]), r["stage"]): (r["operations"], r["cost"])
            for r in billed_operations(ledger, options).collect()
        }

    chunked = ops(AuditOptions(price_per_million_ops=2.0, stage_prices={"ping": 10.0}))
    day = "2025-03-04"
    assert {k: v[0] for k, v in chunked.items()} == {
        (day, "send_primary"): 1 + 2 + 4,  # a, b (2 chunks), c syphoned (200 KiB: 4 chunks)
        (day, "receive_primary"): 1 + 2 + 4,
        (day, "send_backlog"): 4,
        (day, "receive_backlog"): 4 + 1,  # c syphoned, d expired in the backlog
        (day, "ping"): 1,
        ("2025-03-05", "ping"): 1,
    }
    assert chunked[(day, "send_primary")][1] == pytest.approx(7 * 2.0 / 1e6)
    assert chunked[(day, "ping")][1] == pytest.approx(10.0 / 1e6)
    flat = ops(AuditOptions(billing_chunk_kib=0))
    # One per event: a and b cost 2 each (send + receive), c costs the syphon's 4 (send to
    # backlog, receive from backlog, send to primary, receive from primary), d's expiry in
    # the backlog its receive, each ping 1.
    assert {k: v[0] for k, v in flat.items() if k[0] == day} == {
        (day, "send_primary"): 3,
        (day, "receive_primary"): 3,
        (day, "send_backlog"): 1,
        (day, "receive_backlog"): 2,
        (day, "ping"): 1,
    }


def test_ledger_parsing_keeps_only_ledger_v1_and_v2(spark: Any, tmp_path: Path) -> None:
    good = ledger_line(1, 1, "accepted", message_id="m", entity="q", route="primary")
    v2 = {**good, "event_id": "6" * 32, "v": 2, "session_id": "s-1", "seq": 1741082400000001}
    rows: list[Any] = [
        good,
        v2,
        {**good, "event_id": "2" * 32, "v": 3},  # a future version
        {**good, "event_id": "3" * 32, "event": "teleported"},
        {**good, "event_id": "4" * 32, "ts": "yesterday"},
        {**good, "event_id": None},
        {"level": "info", "msg": "a JSON log line on the same stdout"},
        b"not json",
        {**good, "event_id": "5" * 32, "extra": {"nested": [1, 2]}, "ts": "2025-03-04T10:00:02Z"},
    ]
    path = write_jsonl(tmp_path / "gz" / "a.jsonl.gz", [])
    path.write_bytes(
        gzip.compress(
            b"\n".join(orjson.dumps(r) if not isinstance(r, bytes) else r for r in rows) + b"\n"
        )
    )
    r = resolve("ledger", [str(tmp_path / "gz")], required=True)
    parsed = parse_ledger(read_jsonl(spark, r, LEDGER_SCHEMA)).collect()
    assert len(parsed) == len(rows)
    valid = sorted(p["event_id"] for p in parsed if p[VALID])
    assert valid == ["0" * 31 + "1", "5" * 32, "6" * 32]
    [second] = [p for p in parsed if p["event_id"] == "5" * 32]
    assert second["ts"] == naive(2) and second["ekey"] == "q"
    assert (second["session_id"], second["seq"]) == (None, None)  # v1: neither
    [newer] = [p for p in parsed if p["event_id"] == "6" * 32]
    assert (newer["session_id"], newer["seq"]) == ("s-1", 1741082400000001)


def test_delivered_endpoints_and_entity_fallback(spark: Any, tmp_path: Path) -> None:
    rows = [
        {
            "message_id": "a",
            "entity": None,
            "source": "primary",
            "queue": "Events/subscriptions/Audit",
        },
        {
            "message_id": "b",
            "entity": "orders",
            "source": "dlq",
            "queue": "orders/$deadletterqueue",
            "dead_letter_reason": "TTLExpiredException",
        },
        {
            "message_id": "c",
            "entity": "orders",
            "source": "backlog",
            "queue": "ns/x-servicebus-transfer/1",
        },
        {
            "message_id": "d",
            "entity": "orders",
            "source": "dlq",
            "queue": "ns/x-servicebus-transfer/1/$DeadLetterQueue",
        },
        {
            "message_id": "e",
            "entity": None,
            "source": "backlog",
            "queue": "ns/x-servicebus-transfer/1",
        },
        {"message_id": "f", "entity": "orders", "source": "teleport", "queue": "orders"},
    ]
    write_jsonl(tmp_path / "d.jsonl", rows)
    r = resolve("delivered", [str(tmp_path / "d.jsonl")], required=True)
    parsed = {
        p["message_id"]: p
        for p in parse_delivered(
            read_jsonl(spark, r, DELIVERED_SCHEMA), DEFAULT_BACKLOG_PATTERN
        ).collect()
    }
    assert (parsed["a"]["entity"], parsed["a"]["ekey"], parsed["a"]["endpoint"]) == (
        "Events",
        "events",
        "events/subscriptions/audit",
    )
    assert parsed["b"]["endpoint"] == "orders" and not parsed["b"]["backlog_copy"]
    assert parsed["c"]["endpoint"] is None and parsed["c"]["backlog_copy"]
    assert parsed["d"]["endpoint"] is None and parsed["d"]["backlog_copy"]
    assert not parsed["e"][VALID]  # a backlog copy without x-ms-path names no entity
    assert not parsed["f"][VALID]
    assert all(parsed[k][VALID] for k in "abcd")


def test_classification_keys_and_grace_boundary(spark: Any) -> None:
    acks = spark.createDataFrame(
        [
            (naive(10), "m1", "Orders", "orders", 201, "acked", "primary", 3.0),
            (naive(50), "m2", "orders", "orders", 201, "acked", "primary", 3.0),  # at cutoff
            (naive(51), "m3", "orders", "orders", 201, "acked", "primary", 3.0),  # after
            (naive(10), "m1", "billing", "billing", 201, "acked", "primary", 3.0),
        ],
        "ts timestamp, message_id string, entity string, ekey string, status int, "
        "outcome string, route string, latency_ms double",
    )
    ledger = spark.createDataFrame([], LEDGER_SCHEMA).selectExpr(
        "event_id",
        "cast(ts as timestamp) ts",
        "replica",
        "message_id",
        "entity",
        "entity as ekey",
        "event",
        "route",
        "backlog",
        "size",
        "latency_ms",
    )
    delivered = spark.createDataFrame(
        [("m1", "orders/", "orders", "primary", "orders", naive(11), None, 1, "orders", False)],
        "message_id string, entity string, ekey string, source string, queue string, "
        "enqueued_time timestamp, dead_letter_reason string, delivery_count long, "
        "endpoint string, backlog_copy boolean",
    )
    cutoff = T0 + dt.timedelta(seconds=50)
    got = {
        (r["ekey"], r["message_id"]): r["classification"]
        for r in classify(acks, ledger, delivered, cutoff).collect()
    }
    assert got == {
        ("orders", "m1"): "delivered",  # keyed by ekey, whatever the spelling
        ("orders", "m2"): "lost",  # promised at the cutoff itself: not pending
        ("orders", "m3"): "pending",
        ("billing", "m1"): "lost",  # the same id on another entity is another message
    }
    assert ACK_SCHEMA["status"].dataType.simpleString() == "int"


def test_failed_may_be_stored_makes_a_delivered_5xx_unexpected(spark: Any) -> None:
    acks = spark.createDataFrame(
        [(naive(10), "m1", "orders", "orders", 504, "failed", None, 3.0)],
        "ts timestamp, message_id string, entity string, ekey string, status int, "
        "outcome string, route string, latency_ms double",
    )
    ledger = spark.createDataFrame([], LEDGER_SCHEMA).selectExpr(
        "event_id",
        "cast(ts as timestamp) ts",
        "replica",
        "message_id",
        "entity",
        "entity as ekey",
        "event",
        "route",
        "backlog",
        "size",
        "latency_ms",
    )
    delivered = spark.createDataFrame(
        [("m1", "orders", "orders", "primary", "orders", naive(11), None, 1, "orders", False)],
        "message_id string, entity string, ekey string, source string, queue string, "
        "enqueued_time timestamp, dead_letter_reason string, delivery_count long, "
        "endpoint string, backlog_copy boolean",
    )
    strict = classify(acks, ledger, delivered, None)
    lenient = classify(acks, ledger, delivered, None, failed_may_be_stored=True)
    assert [r["classification"] for r in strict.collect()] == ["failed-but-delivered"]
    assert [r["classification"] for r in lenient.collect()] == ["unexpected"]
    assert message_anomalies(lenient).count() == 0  # allowed, like after a timeout
    assert [r["kind"] for r in message_anomalies(strict).collect()] == ["failed-but-delivered"]


@pytest.mark.parametrize(
    ("lost", "pending", "promised", "expected"),
    [
        (0, 0, 10, "no acknowledged message was lost (10 checked)"),
        (
            5,
            2,
            10,
            "5 acknowledged message(s) LOST; 2 more pending (acknowledged in the last 60 s of "
            "the data, not delivered yet: not judged)",
        ),
        (
            0,
            10,
            10,
            "NOTHING JUDGED: all 10 acknowledged message(s) are pending (acknowledged in the "
            "last 60 s of the data, not delivered yet); for a finished run use "
            "--grace-seconds 0",
        ),
        (
            0,
            3,
            10,
            "no acknowledged message was lost (7 checked); 3 pending (acknowledged in the last "
            "60 s of the data, not delivered yet: not judged)",
        ),
    ],
)
def test_the_verdict_names_the_pending_count_and_the_window(lost, pending, promised, expected):
    from pipeline.report import verdict

    assert verdict(lost=lost, pending=pending, promised=promised, grace_seconds=60) == expected
