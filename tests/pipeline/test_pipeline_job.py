"""The whole audit job on generated data with planted anomalies: exact classification, tables,
report numbers, charts, exit codes."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.job import EXIT_LOST, JobOptions, run
from pipeline.reconcile import AuditOptions
from pipeline.schemas import CLASSIFICATIONS
from pipeline.synthetic import QUEUE, TOPIC, Expected, generate

pytestmark = pytest.mark.timeout(600)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Audit:
    def __init__(self, expected: Expected, out: Path, report_dir: Path, rc: int) -> None:
        self.expected = expected
        self.out = out
        self.report_dir = report_dir
        self.rc = rc
        self.report: dict[str, Any] = json.loads((report_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def audit(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Audit:
    root = tmp_path_factory.mktemp("audit")
    expected = generate(root / "in", messages=600, seed=11)
    opts = JobOptions(
        ledger=(str(root / "in" / "ledger"),),
        acks=(str(root / "in" / "acks"),),
        delivered=(str(root / "in" / "delivered" / "*.jsonl"),),
        out=str(root / "out"),
        report_dir=str(root / "report"),
        audit=AuditOptions(grace_seconds=60, stage_prices={"ping": 1.0}),
    )
    rc = run(spark, opts)
    return Audit(expected, root / "out", root / "report", rc)


def table(spark: Any, audit: Audit, name: str) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in spark.read.parquet(str(audit.out / name)).collect()]


def test_every_planted_id_is_classified_exactly(spark: Any, audit: Audit) -> None:
    rows = table(spark, audit, "messages")
    got = {(r["entity"], r["message_id"]): r["classification"] for r in rows}
    assert len(rows) == len(got)  # one row per message
    assert got == audit.expected.classification
    planted = {
        "lost": {
            (QUEUE, "lost-0"),
            (QUEUE, "lost-1"),
            (QUEUE, "lost-2"),
            (QUEUE, "lost-client-only"),
        },
        "duplicated": {(QUEUE, "dup-0"), (QUEUE, "dup-1"), (QUEUE, "dup-backlog")},
        "pending": {(QUEUE, "late-0"), (QUEUE, "late-1")},
        "expired": {(QUEUE, "expired-dlq"), (QUEUE, "expired-ledger")},
        "unexpected": {(QUEUE, "unexpected-0"), (QUEUE, "timeout-stored")},
        "failed-but-delivered": {(QUEUE, "broken-5xx")},
        "rejected-but-delivered": {(QUEUE, "broken-4xx")},
        "failed": {(QUEUE, "honest-5xx")},
        "rejected": {(QUEUE, "bad-request")},
        "indeterminate": {(QUEUE, "timeout-lost")},
    }
    for classification, keys in planted.items():
        assert {k for k, c in got.items() if c == classification} == keys, classification
    assert got[(TOPIC, "fanout-ok")] == "delivered"  # two subscriptions are not a duplicate
    assert got[(QUEUE, "shadow-0")] == "delivered"  # primary + backlog copy: a shadow
    shadows = {(r["entity"], r["message_id"]) for r in rows if r["backlog_shadow"]}
    assert shadows == audit.expected.shadows == {(QUEUE, "shadow-0")}
    assert got[(QUEUE, "retried")] == "delivered"  # timeout then 201: one delivery is right


def test_exit_code_is_3_when_an_acknowledged_message_is_lost(audit: Audit) -> None:
    assert audit.rc == EXIT_LOST
    assert audit.report["exit_code"] == EXIT_LOST
    pending = audit.report["messages"]["by_classification"]["pending"]
    assert pending > 0  # the synthetic data plants some: the verdict names them and the window
    assert audit.report["verdict"] == (
        f"4 acknowledged message(s) LOST; {pending} more pending (acknowledged in the last "
        "60 s of the data, not delivered yet: not judged)"
    )
    assert [r["message_id"] for r in audit.report["lost_sample"]] == [
        "lost-0",
        "lost-1",
        "lost-2",
        "lost-client-only",
    ]


def test_report_numbers_match_the_data(audit: Audit) -> None:
    r, exp = audit.report, audit.expected
    expected_counts = {c: 0 for c in CLASSIFICATIONS} | exp.counts()
    assert r["messages"]["by_classification"] == expected_counts
    assert r["messages"]["total"] == len(exp.classification)
    assert r["inputs"]["ledger"] == {
        "paths": None,
        "files": 2,
        "lines": exp.ledger_lines,
        "valid": exp.ledger_valid,
        "ignored": 2,
        "duplicates_dropped": exp.ledger_duplicates,
    }
    assert r["inputs"]["acks"]["lines"] == r["inputs"]["acks"]["valid"] == exp.ack_lines
    assert r["inputs"]["delivered"]["valid"] == exp.delivered_lines
    assert dt.datetime.fromisoformat(r["time_range"]["end"]) == exp.end
    cutoff = dt.datetime.fromisoformat(r["cutoff"])
    assert cutoff == exp.latest_evidence - dt.timedelta(seconds=60)
    assert r["backlog"]["syphoned"] == exp.syphoned
    assert r["failover"]["count"] == 2 and r["failover"]["open_at_end"] == 1
    md = (audit.report_dir / "report.md").read_text()
    assert f"**Verdict: {r['verdict']}** (exit code 3)" in md
    assert r["verdict"].startswith("4 acknowledged message(s) LOST; 2 more pending")
    assert "| lost | 4 |" in md


def test_anomalies_table(spark: Any, audit: Audit) -> None:
    rows = table(spark, audit, "anomalies")
    by_kind: dict[str, int] = {}
    for row in rows:
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + 1
    assert by_kind == {
        "lost": 4,
        "duplicated": 3,
        "unexpected": 1,  # the indeterminate one is explained, not an anomaly
        "failed-but-delivered": 1,
        "rejected-but-delivered": 1,
        "backlog_shadow": 1,
        "open_failover_window": 1,
        "ledger_duplicate_lines": 1,
        "ledger_lines_ignored": 1,
    }
    [unexpected] = [row for row in rows if row["kind"] == "unexpected"]
    assert (unexpected["message_id"], unexpected["severity"]) == ("unexpected-0", "error")
    report_kinds = {k: v["count"] for k, v in audit.report["anomalies"]["by_kind"].items()}
    assert report_kinds == by_kind
    assert audit.report["anomalies"]["errors"] == 4 + 1 + 1 + 1


def test_billed_operations_by_stage(spark: Any, audit: Audit) -> None:
    rows = table(spark, audit, "billed_ops")
    ops: dict[str, int] = {}
    for row in rows:
        ops[row["stage"]] = ops.get(row["stage"], 0) + row["operations"]
        assert row["cost"] == pytest.approx(row["operations"] / 1e6 * row["price_per_million"])
        assert row["price_per_million"] == (1.0 if row["stage"] == "ping" else 0.05)
    assert ops == dict(audit.expected.stage_ops)
    bill = audit.report["billing"]
    assert bill["total_operations"] == sum(ops.values())
    assert bill["failover_overhead_operations"] == (
        ops["send_backlog"] + ops["receive_backlog"] + ops["ping"]
    )
    assert bill["by_stage"]["ping"]["operations"] == audit.expected.pings
    expected_cost = sum(n / 1e6 * (1.0 if s == "ping" else 0.05) for s, n in ops.items())
    assert bill["total_cost"] == pytest.approx(expected_cost)


def test_failover_windows_and_backlog(spark: Any, audit: Audit) -> None:
    windows = sorted(table(spark, audit, "failover_windows"), key=lambda w: w["start_ts"])
    (orders_ent, orders_start, orders_end), (events_ent, events_start, _) = audit.expected.windows
    assert orders_end is not None
    naive = lambda t: t.replace(tzinfo=None)  # noqa: E731 - Spark returns naive UTC
    assert [(w["entity"], w["start_ts"], w["end_ts"], w["closed_by"]) for w in windows] == [
        (orders_ent, naive(orders_start), naive(orders_end), "failover_end"),
        (events_ent, naive(events_start), naive(audit.expected.end), "end_of_data"),
    ]
    assert windows[0]["duration_s"] == pytest.approx((orders_end - orders_start).total_seconds())
    assert sum(w["pings"] for w in windows) == audit.expected.pings
    assert all(w["sent_to_backlog"] > 0 for w in windows)

    dwell = table(spark, audit, "backlog_dwell")
    syphoned = [d for d in dwell if d["state"] == "syphoned"]
    assert len(syphoned) == audit.expected.syphoned
    assert all(d["dwell_s"] > 0 for d in syphoned)
    waiting = sum(1 for d in dwell if d["state"] == "waiting")
    depth = sorted(table(spark, audit, "backlog_depth"), key=lambda d: d["minute"])
    assert depth[-1]["depth"] == waiting
    assert audit.report["backlog"]["max_depth"] == max(d["depth"] for d in depth)


def test_tables_charts_and_latency(spark: Any, audit: Audit) -> None:
    for name in audit.report["tables"]:
        assert (audit.out / name / "_SUCCESS").exists(), name
    for chart in ("throughput.png", "backlog_depth.png", "latency_by_route.png"):
        data = (audit.report_dir / chart).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, chart
    lat = {(r["source"], r["route"]): r for r in audit.report["latency_ms"]}
    assert set(lat) == {
        ("client", "backlog"),
        ("client", "primary"),
        ("gateway", "backlog"),
        ("gateway", "primary"),
    }
    assert lat[("gateway", "backlog")]["p50_ms"] > lat[("gateway", "primary")]["p99_ms"]
    tp = table(spark, audit, "throughput")
    assert all(r["accepted"] == r["accepted_primary"] + r["accepted_backlog"] for r in tp)
    assert sum(r["accepted_backlog"] for r in tp) == audit.report["backlog"]["messages"]
    # every promise in this data set is a client 2xx (no ledger-only promises)
    assert sum(r["client_acked"] for r in tp) == audit.report["messages"]["promised"]
