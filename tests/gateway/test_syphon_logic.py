"""Syphon logic with fakes at its ports: idle cost over a simulated hour, fault coordination,
and the backlog rewrite/restore round trip."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Sequence

import pytest

from gateway.config import LimitSettings, SyphonSettings, TimeoutSettings
from gateway.core.backlog import RestoreError, restore, rewrite
from gateway.core.dispatcher import Dispatcher
from gateway.core.message import OutboundMessage
from gateway.core.ports import Received
from gateway.errors import CONNECTION, SendFailure
from gateway.state.memory import MemoryStateStore
from gateway.syphon.syphon import Syphon
from tests.support.fakes import FakeClient
from tests.support.syphon import FakeBacklog, FakeClock
from tests.support.waiting import eventually

QUEUES = [f"primary/x-servicebus-transfer/{i}" for i in range(10)]


def make_syphon(port: FakeBacklog, clock: FakeClock | None, store: MemoryStateStore) -> Syphon:
    return Syphon(
        backlog=port,
        queues=QUEUES,
        dispatcher=Dispatcher(LimitSettings(), TimeoutSettings()),
        primary=FakeClient(),
        entities=["orders"],
        store=store,
        settings=SyphonSettings(idle_check_interval=900.0),
        timeouts=TimeoutSettings(),
        clock=clock,
    )


async def test_idle_for_a_simulated_hour_costs_at_most_4_operations():
    clock = FakeClock()
    port = FakeBacklog()
    store = MemoryStateStore("r1")
    await store.start()
    syphon = make_syphon(port, clock, store)
    syphon.start()
    try:
        await eventually(lambda: port.ops == ["depths"], within=5)  # start-up check
        start_ops = len(port.ops)
        while clock.t < 3600:
            await clock.advance()
        await eventually(clock.parked, within=5)  # settled at the hour mark
        hour_ops = port.ops[start_ops:]
        assert len(hour_ops) <= 4, hour_ops
        assert "receive" not in hour_ops, "no polling while every backlog is known empty"
        assert syphon.stats.operations["depth_check"] == len(port.ops)
    finally:
        await syphon.close(grace=1)
        await store.close()


async def test_a_failback_wakes_the_syphon_without_polling_in_between():
    clock = FakeClock()
    port = FakeBacklog()
    store = MemoryStateStore("r1")
    await store.start()
    syphon = make_syphon(port, clock, store)
    syphon.start()
    try:
        await eventually(lambda: port.ops == ["depths"], within=5)
        st = store.propose(store.get("orders"), "failed_over", "test")
        assert st is not None
        await eventually(clock.parked, within=5)
        assert port.ops == ["depths"], "failing over costs the syphon nothing"
        store.propose(store.get("orders"), "healthy", "ping")
        clock.t += 2  # past the minimum spacing between checks
        await clock.advance()
        await eventually(lambda: port.ops.count("depths") == 2, within=5)
    finally:
        await syphon.close(grace=1)
        await store.close()


async def test_a_namespace_fault_closes_the_partner_within_5_seconds():
    port = FakeBacklog(fail_receive=True)
    store = MemoryStateStore("r1")
    await store.start()
    syphon = make_syphon(port, None, store)  # real clock
    syphon.start()
    try:
        async with asyncio.timeout(5):
            await port.reset_called.wait()
        assert syphon.last_fault is not None
    finally:
        await syphon.close(grace=1)
        await store.close()


async def test_thousands_of_faults_keep_no_task_once_their_reset_ends():
    """Issue 33: every fault's reset task was kept for ever (~630 bytes each, ~9 MB a day
    while a namespace stayed away). One reset runs at a time; a fault during it asks for one
    more pass; nothing is held once it ends."""
    port = FakeBacklog()
    store = MemoryStateStore("r1")
    await store.start()
    syphon = make_syphon(port, None, store)
    syphon.start()
    try:
        held_before = len(syphon._tasks)
        for _ in range(5000):
            syphon._fault(QUEUES[0], SendFailure(CONNECTION, "namespace unreachable"))
        async with asyncio.timeout(5):
            await port.reset_called.wait()
        reset = syphon._reset_task
        assert reset is not None
        async with asyncio.timeout(5):
            await reset
        assert port.resets <= 2, "faults during a reset ask for one more pass, not one each"
        assert len(syphon._tasks) == held_before
        tasks = {t for t in asyncio.all_tasks() if "close receivers" in t.get_name()}
        assert tasks == set()
    finally:
        await syphon.close(grace=1)
        await store.close()


def test_rewrite_and_restore_round_trip_with_the_remaining_ttl():
    when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    original = OutboundMessage(
        body=b"b",
        message_id="m",
        session_id="s",
        partition_key="s",
        time_to_live=dt.timedelta(seconds=100),
        scheduled_enqueue_time_utc=when,
        correlation_id="c",
        application_properties={"k": "v"},
    )
    stored = rewrite(original, "orders", accepted_at=1000.0)
    assert stored.session_id is None and stored.time_to_live is None
    assert stored.scheduled_enqueue_time_utc is None and stored.message_id == "m"
    assert stored.application_properties["x-ms-path"] == "orders"
    back = restore(stored, now=when.timestamp() + 40)
    assert back is not None and back.entity_path == "orders" and not back.expired
    m = back.message
    assert (m.session_id, m.partition_key, m.correlation_id) == ("s", "s", "c")
    assert m.scheduled_enqueue_time_utc is None, "a schedule already past goes home unscheduled"
    assert m.time_to_live == dt.timedelta(seconds=60), "TTL runs from the scheduled time"
    assert m.application_properties == {"k": "v"}
    expired = restore(stored, now=when.timestamp() + 101)
    assert expired is not None and expired.expired


class SettlingBacklog(FakeBacklog):
    """Records how each message was settled, by MessageId."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[tuple[str, str]] = []

    async def complete(self, path: str, message: Received) -> None:
        self.settled.append(("complete", message.message.message_id))

    async def abandon(self, path: str, message: Received) -> None:
        self.settled.append(("abandon", message.message.message_id))


async def test_a_failed_move_abandons_every_later_message_of_its_session_never_sent_first():
    async def refuse_b2(path: str, messages: Sequence[OutboundMessage]) -> None:
        if any(m.message_id == "b2" for m in messages):
            raise SendFailure(CONNECTION, "lost on the way")

    primary = FakeClient(behaviour=refuse_b2)
    port = SettlingBacklog()
    store = MemoryStateStore("r1")
    syphon = Syphon(
        backlog=port,
        queues=QUEUES,
        dispatcher=Dispatcher(LimitSettings(), TimeoutSettings()),
        primary=primary,
        entities=["orders"],
        store=store,
        settings=SyphonSettings(),
        timeouts=TimeoutSettings(),
        fences=store.fences,
    )
    stored = [
        OutboundMessage(body=b"", message_id=mid, session_id=sid)
        for mid, sid in [("b1", "b"), ("a1", "a"), ("b2", "b"), ("a2", "a"), ("b3", "b")]
    ]
    received = [
        Received(
            rewrite(m, "orders", time.time()), handle=None, locked_until=None, delivery_count=1
        )
        for m in stored
    ]
    assert await syphon._move_received(QUEUES[0], received) == "failed"
    await syphon._dispatcher.close(grace=1)
    sent = primary.sent_ids("orders")
    assert [i for i in sent if i.startswith("a")] == ["a1", "a2"], "another session moves on"
    assert [i for i in sent if i.startswith("b")] == ["b1", "b2"], "b3 never goes before b2"
    assert ("complete", "b1") in port.settled and ("abandon", "b2") in port.settled
    assert ("abandon", "b3") in port.settled and ("complete", "b3") not in port.settled


@pytest.mark.parametrize(
    "types",
    [
        "[" * 100_000,  # json.loads raised RecursionError, not ValueError: past `except`
        '{"' + "n" * 5000 + '": "uint"}',  # a name that is no property: a bounded message
        '{"k": "decimal128"}',
        "[]",
        "null",
    ],
)
def test_a_hostile_types_property_in_a_backlog_message_is_a_restore_error(types: str) -> None:
    """x-ms-types is read from a backlog queue, which anyone with Send on the secondary
    writes: whatever it holds, the message fails alone (dead-lettered `RestoreFailed`)."""
    stored = rewrite(
        OutboundMessage(body=b"b", message_id="m", application_properties={"k": "v"}),
        "orders",
        accepted_at=1000.0,
    )
    props = {**stored.application_properties, "x-ms-types": types}
    hostile = OutboundMessage(body=b"b", message_id="m", application_properties=props)
    with pytest.raises(RestoreError) as info:
        restore(hostile, now=1001.0)
    assert len(str(info.value)) < 300
