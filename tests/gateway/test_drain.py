"""The drain tool with the real async SDK against the local broker (sblocal)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("sblocal.server", reason="needs the local broker (sblocal)")

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from gateway.audit.drain import (
    DrainError,
    delivered_record,
    drain,
    main,
    plan_targets,
)
from sblocal.config import (
    BrokerConfig,
    NamespaceConfig,
    QueueConfig,
    SubscriptionConfig,
    TopicConfig,
)
from sblocal.entities import QueueProperties
from sblocal.server import LocalBroker
from sblocal.testing import eventually

# Real SDK receivers against an in-process broker, several seconds a test.
pytestmark = pytest.mark.slow

BACKLOG = "primary/x-servicebus-transfer/0"
CONTRACT_KEYS = [
    "message_id",
    "entity",
    "source",
    "queue",
    "enqueued_time",
    "dead_letter_reason",
    "delivery_count",
    "sequence_number",
    "session_id",
]
FAST = {"retry_total": 0, "retry_backoff_factor": 0.01}


def config() -> BrokerConfig:
    primary = NamespaceConfig(
        name="primary",
        management_port=None,
        queues=(
            QueueConfig("orders", QueueProperties(dead_lettering_on_message_expiration=True)),
            QueueConfig("payments", QueueProperties(requires_session=True)),
        ),
        topics=(
            TopicConfig(
                "events",
                subscriptions=(SubscriptionConfig("audit"), SubscriptionConfig("billing")),
            ),
        ),
    )
    secondary = NamespaceConfig(
        name="secondary", management_port=None, queues=(QueueConfig(BACKLOG),)
    )
    return BrokerConfig(namespaces=(primary, secondary), housekeeping_interval=0.02)


@pytest.fixture
async def broker() -> AsyncIterator[LocalBroker]:
    async with LocalBroker(config()) as b:
        yield b


def read(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["message_id"], r["entity"], r["source"], r["queue"], r["dead_letter_reason"])


async def load(broker: LocalBroker) -> None:
    """Messages in every kind of place the drain must look."""
    async with ServiceBusClient.from_connection_string(
        broker.connection_string("primary"), **FAST
    ) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(
                [ServiceBusMessage(b"x", message_id=f"o-{i}") for i in range(3)]
            )
        async with client.get_topic_sender("events") as sender:
            await sender.send_messages(ServiceBusMessage(b"x", message_id="e-1"))
        async with client.get_queue_receiver("orders", prefetch_count=0) as receiver:
            # Dead-letter o-2 like a consumer that gave up on it.
            async with asyncio.timeout(10):
                while True:
                    batch = await receiver.receive_messages(max_message_count=10, max_wait_time=1)
                    target = [m for m in batch if m.message_id == "o-2"]
                    for m in batch:
                        if m.message_id != "o-2":
                            await receiver.abandon_message(m)
                    if target:
                        await receiver.dead_letter_message(
                            target[0], reason="MaxDeliveryCountExceeded"
                        )
                        break
        async with client.get_queue_sender("orders") as sender:
            # Sent last so that no receive above holds it locked (a lock defers expiry).
            # TTL 1 s: the SDK sends whole seconds' worth reliably.
            ttl = dt.timedelta(seconds=1)
            await sender.send_messages(
                ServiceBusMessage(b"x", message_id="o-expires", time_to_live=ttl)
            )
    async with ServiceBusClient.from_connection_string(
        broker.connection_string("secondary"), **FAST
    ) as client:
        async with client.get_queue_sender(BACKLOG) as sender:
            await sender.send_messages(
                ServiceBusMessage(
                    b"x", message_id="b-1", application_properties={"x-ms-path": "orders"}
                )
            )
            await sender.send_messages(ServiceBusMessage(b"x", message_id="b-nopath"))
    control = broker.control_client()
    await eventually(
        lambda: _expired(control), timeout=10, message="o-expires was not dead-lettered"
    )


async def _expired(control: Any) -> bool:
    return (await control.counters("primary")).get("expired", 0) >= 1


def test_plan_targets() -> None:
    targets = plan_targets(
        ["orders", "events/subscriptions/audit", "x/$DeadLetterQueue", "ns/x-servicebus-transfer/3"]
    )
    assert [(t.queue, t.source, t.topic, t.subscription) for t in targets] == [
        ("orders", "primary", None, None),
        ("orders/$DeadLetterQueue", "dlq", None, None),
        ("events/subscriptions/audit", "primary", "events", "audit"),
        ("events/subscriptions/audit/$DeadLetterQueue", "dlq", "events", "audit"),
        ("x/$DeadLetterQueue", "dlq", None, None),
        ("ns/x-servicebus-transfer/3", "backlog", None, None),
        ("ns/x-servicebus-transfer/3/$DeadLetterQueue", "dlq", None, None),
    ]
    assert targets[-1].backlog and targets[-1].original_entity == "ns/x-servicebus-transfer/3"
    assert [t.queue for t in plan_targets(["orders", "Orders/"], include_dlq=False)] == ["orders"]
    assert plan_targets(["contoso-b/q7"], backlog_prefix="contoso-b/")[0].source == "backlog"
    with pytest.raises(DrainError):
        plan_targets(["/"])


async def test_drain_writes_every_delivery(broker: LocalBroker, tmp_path: Path) -> None:
    await load(broker)
    out = tmp_path / "delivered.jsonl"
    primary = await drain(
        broker.connection_string("primary"),
        ["orders", "events/subscriptions/audit", "events/subscriptions/billing"],
        out,
        idle_timeout=0.5,
        client_kwargs=FAST,
    )
    secondary = await drain(
        broker.connection_string("secondary"),
        [BACKLOG],
        out,
        idle_timeout=0.5,
        append=True,
        client_kwargs=FAST,
    )
    assert not primary.errors and not secondary.errors
    lines = read(out)
    assert all(list(r) == CONTRACT_KEYS for r in lines)
    assert sorted(map(key, lines)) == sorted(
        [
            ("o-0", "orders", "primary", "orders", None),
            ("o-1", "orders", "primary", "orders", None),
            ("o-2", "orders", "dlq", "orders/$DeadLetterQueue", "MaxDeliveryCountExceeded"),
            ("o-expires", "orders", "dlq", "orders/$DeadLetterQueue", "TTLExpiredException"),
            ("e-1", "events", "primary", "events/subscriptions/audit", None),
            ("e-1", "events", "primary", "events/subscriptions/billing", None),
            ("b-1", "orders", "backlog", BACKLOG, None),  # x-ms-path is the original entity
            ("b-nopath", BACKLOG, "backlog", BACKLOG, None),
        ]
    )
    orders = sorted(
        (r["message_id"], r["sequence_number"]) for r in lines if r["queue"] == "orders"
    )
    assert orders[0][1] < orders[1][1]  # o-0 was stored before o-1
    for r in lines:
        enqueued = dt.datetime.fromisoformat(r["enqueued_time"])
        assert enqueued.tzinfo is not None and r["enqueued_time"].endswith("Z")
    assert primary.total == 6 and primary.received["orders"] == 2
    assert secondary.total == 2 and secondary.backlog_without_path == 1

    # Everything was removed: a second drain finds nothing.
    again = await drain(
        broker.connection_string("primary"),
        ["orders", "events/subscriptions/audit"],
        tmp_path / "again.jsonl",
        idle_timeout=0.3,
        client_kwargs=FAST,
    )
    assert again.total == 0 and read(tmp_path / "again.jsonl") == []


async def test_missing_entity_is_reported_and_others_drained(
    broker: LocalBroker, tmp_path: Path
) -> None:
    async with (
        ServiceBusClient.from_connection_string(
            broker.connection_string("primary"), **FAST
        ) as client,
        client.get_queue_sender("orders") as sender,
    ):
        await sender.send_messages(ServiceBusMessage(b"x", message_id="only"))
    summary = await drain(
        broker.connection_string("primary"),
        ["nope", "orders"],
        tmp_path / "d.jsonl",
        include_dlq=False,
        idle_timeout=0.3,
        receive_mode="receive_and_delete",
        client_kwargs=FAST,
    )
    assert set(summary.errors) == {"nope"}
    assert [r["message_id"] for r in read(tmp_path / "d.jsonl")] == ["only"]


async def test_cli_main(
    broker: LocalBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with (
        ServiceBusClient.from_connection_string(
            broker.connection_string("primary"), **FAST
        ) as client,
        client.get_queue_sender("orders") as sender,
    ):
        await sender.send_messages(ServiceBusMessage(b"x", message_id="cli-1"))
    out = tmp_path / "cli.jsonl"
    args = [
        "--connection-string",
        broker.connection_string("primary"),
        "--entity",
        "orders",
        "--out",
        str(out),
        "--idle-timeout",
        "0.3",
    ]
    # main() runs its own event loop: give it a thread.
    assert await asyncio.to_thread(main, args) == 0
    assert [r["message_id"] for r in read(out)] == ["cli-1"]
    summary = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total"] == 1 and summary["errors"] == {}
    assert await asyncio.to_thread(main, ["--entity", "orders"]) == 2  # usage error


def test_delivered_record_decodes_bytes_properties() -> None:
    class Msg:
        message_id = "m"
        application_properties = {b"x-ms-path": b"events"}
        enqueued_time_utc = dt.datetime(2025, 1, 2, 3, 4, 5, 600_000, tzinfo=dt.UTC)
        dead_letter_reason = None
        delivery_count = 1
        sequence_number = 42
        session_id = b"customer-7"

    [target] = plan_targets(["c/x-servicebus-transfer/1"], include_dlq=False)
    record = delivered_record(Msg(), target)  # type: ignore[arg-type]
    assert record["entity"] == "events" and record["source"] == "backlog"
    assert record["enqueued_time"] == "2025-01-02T03:04:05.600000Z"
    assert (record["sequence_number"], record["session_id"]) == (42, "customer-7")


async def test_gateway_drain_writes_no_sdk_info_lines(broker: LocalBroker, tmp_path: Path) -> None:
    """`gateway drain` as a user runs it: stderr has our few lines, not the Azure SDK's INFO
    lines (dozens per entity), so the summary stands out."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "drain",
        "--connection-string",
        broker.connection_string("primary"),
        "--entity",
        "orders",
        "--out",
        str(tmp_path / "d.jsonl"),
        "--idle-timeout",
        "0.3",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    sdk_lines = [line for line in err.decode().splitlines() if " azure." in line]
    assert sdk_lines == []
    assert orjson.loads(out.decode().splitlines()[-1])["total"] == 0


async def test_drain_receives_a_session_entity_one_session_at_a_time(
    broker: LocalBroker, tmp_path: Path
) -> None:
    """A queue that requires sessions refuses a plain receiver; with ``sessions`` every
    session is drained in turn, each in its stored order (what the session audit reads)."""
    async with ServiceBusClient.from_connection_string(
        broker.connection_string("primary"), **FAST
    ) as client:
        async with client.get_queue_sender("payments") as sender:
            async with asyncio.timeout(10):
                for k in range(3):
                    await sender.send_messages(
                        [
                            ServiceBusMessage(b"x", message_id=f"s{s}-m{k}", session_id=f"s{s}")
                            for s in range(3)
                        ]
                    )
    plain = await drain(
        broker.connection_string("primary"),
        ["payments"],
        tmp_path / "plain.jsonl",
        idle_timeout=0.5,
        include_dlq=False,
        client_kwargs=FAST,
    )
    assert plain.total == 0 and "payments" in plain.errors  # needs a session receiver
    out = tmp_path / "sessions.jsonl"
    summary = await drain(
        broker.connection_string("primary"),
        ["payments"],
        out,
        idle_timeout=0.5,
        sessions=True,
        client_kwargs=FAST,
    )
    assert not summary.errors and summary.received == {
        "payments": 9,
        "payments/$DeadLetterQueue": 0,
    }
    lines = read(out)
    for s in range(3):
        session = [r for r in lines if r["session_id"] == f"s{s}"]
        assert [r["message_id"] for r in session] == [f"s{s}-m{k}" for k in range(3)]
        numbers = [r["sequence_number"] for r in session]
        assert numbers == sorted(numbers)
