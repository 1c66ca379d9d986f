"""A message refused for its own sake fails only its request: the dispatcher bisects the
micro-batch it was in (fakes at the NamespaceClient port; the real broker's refusals are in
tests/gateway/test_poison.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest

from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.dispatcher import Destination, Dispatcher, DispatchObserver, split_budget
from gateway.core.message import OutboundMessage
from gateway.errors import CONNECTION, MESSAGE_REFUSED, Saturated, SendFailure
from tests.support.fakes import FakeClient, ReopensHang, msg
from tests.support.waiting import eventually, no_hang

LIMITS = LimitSettings(senders_per_entity=1, admission_timeout=5.0, max_batch_messages=200)
TIMEOUTS = TimeoutSettings(send_timeout=5.0, connect_timeout=1.0)


class Splits(DispatchObserver):
    def __init__(self) -> None:
        self.splits = 0

    def batch_split(self, dest: str) -> None:
        self.splits += 1


def refusing(bad: set[str], gate: asyncio.Event):
    """The broker refuses any batch holding a message whose id is in `bad`; the first
    batch waits for `gate`, so the requests behind it coalesce into one batch."""

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await gate.wait()
        if any(m.message_id in bad for m in messages):
            raise SendFailure(MESSAGE_REFUSED, "amqp:decode-error")

    return behaviour


async def run(n: int, bad: set[str]):
    gate = asyncio.Event()
    client = FakeClient(behaviour=refusing(bad, gate))
    observer = Splits()
    d = Dispatcher(LIMITS, TIMEOUTS, observer=observer)
    dest = Destination(client, "orders")
    try:
        first = asyncio.create_task(d.send(dest, [msg("first")]))
        await asyncio.sleep(0)  # the worker takes "first" and waits at the gate
        while not client.batches:
            await asyncio.sleep(0)
        # One request per id; request "r3" holds two messages, the second one bad if asked.
        tasks = {
            f"r{i}": asyncio.create_task(
                d.send(dest, [msg(f"r{i}"), msg(f"r{i}b")] if i == 3 else [msg(f"r{i}")])
            )
            for i in range(n)
        }
        await asyncio.sleep(0)
        gate.set()
        await first
        results = dict(
            zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True), strict=True)
        )
    finally:
        await d.close(grace=1.0)
    return results, client, observer


@pytest.mark.parametrize(
    ("n", "bad", "offender"),
    [(2, "r1", "r1"), (7, "r3b", "r3"), (32, "r0", "r0"), (100, "r3b", "r3"), (100, "r99", "r99")],
)
async def test_one_refused_message_fails_only_its_request(n, bad, offender):
    results, client, observer = await run(n, {bad})
    for rid, outcome in results.items():
        if rid == offender:
            assert isinstance(outcome, SendFailure) and outcome.status == 400, outcome
        else:
            assert outcome is None, (rid, outcome)
    stored = {i for _, ids in client.batches[1:] if bad not in ids for i in ids}
    expected = {r for r in results if r != offender}
    if "r3" in expected:
        expected.add("r3b")
    assert stored == expected
    # The refused batch, then at most two sends per halving down to the offender.
    assert 0 < observer.splits <= 2 * math.ceil(math.log2(n)), observer.splits
    assert len(client.batches) == 2 + observer.splits


async def test_a_request_is_still_never_split():
    """Bisection splits between requests, never inside one: r3's good message is not
    stored when its bad one is refused."""
    results, client, _ = await run(8, {"r3b"})
    assert isinstance(results["r3"], SendFailure)
    refused_alone = [ids for _, ids in client.batches if "r3b" in ids]
    assert ["r3", "r3b"] in refused_alone


async def test_the_extra_sends_are_bounded_when_every_request_is_refused():
    n = 64
    results, client, observer = await run(n, {f"r{i}" for i in range(n)} | {"r3b"})
    assert observer.splits <= split_budget(n)
    assert len(client.batches) == 2 + observer.splits
    for outcome in results.values():
        # Proven refused alone (400), or not decided within the budget (503, retry).
        assert isinstance(outcome, (SendFailure, Saturated)), outcome
        if isinstance(outcome, SendFailure):
            assert outcome.status == 400
    assert any(isinstance(o, Saturated) for o in results.values())


async def test_a_batch_failing_for_the_namespace_is_not_bisected():
    gate = asyncio.Event()

    async def down(path: str, messages: Sequence[OutboundMessage]) -> None:
        await gate.wait()
        raise SendFailure(CONNECTION, "gone")

    client = FakeClient(behaviour=down)
    observer = Splits()
    d = Dispatcher(LIMITS, TIMEOUTS, observer=observer)
    dest = Destination(client, "orders")
    try:
        first = asyncio.create_task(d.send(dest, [msg("first")]))
        while not client.batches:
            await asyncio.sleep(0)
        tasks = [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(8)]
        await asyncio.sleep(0)
        gate.set()
        outcomes = await asyncio.gather(first, *tasks, return_exceptions=True)
    finally:
        await d.close(grace=1.0)
    assert all(isinstance(o, SendFailure) and o.classification is CONNECTION for o in outcomes)
    assert observer.splits == 0 and len(client.batches) == 2


# -- shutdown and bugs in the middle of a bisection (the review of the merged dispatcher) ----


async def _sending(client: FakeClient, n: int) -> tuple[Dispatcher, list[asyncio.Task[None]]]:
    """`n` one-message requests to `orders`, once the first batch is at the broker."""
    d = Dispatcher(LIMITS, TIMEOUTS)
    dest = Destination(client, "orders")
    tasks = [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(n)]
    await eventually(lambda: bool(client.batches), every=0, what="the first batch sent")
    return d, tasks


async def _all_settled(tasks: Sequence[asyncio.Task[None]]) -> list[BaseException | None]:
    """Every request's outcome; fails the test if one is still waiting (a liveness bound)."""
    async with asyncio.timeout(10):
        await asyncio.wait(tasks)
    return [t.exception() for t in tasks]


async def test_shutdown_during_a_bisection_settles_every_request() -> None:
    gate = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        if len(client.batches) == 1:
            await gate.wait()
            raise SendFailure(MESSAGE_REFUSED, "amqp:decode-error")
        await asyncio.Event().wait()  # the halves hang until shutdown

    client = FakeClient(behaviour=behaviour)
    d, tasks = await _sending(client, 4)
    gate.set()
    await eventually(lambda: len(client.batches) >= 2, every=0, what="the first half out")
    await d.close(grace=0.0)
    outcomes = await _all_settled(tasks)
    assert all(isinstance(e, SendFailure) and e.kind.value == "shutdown" for e in outcomes)


async def test_shutdown_while_a_suspect_sender_is_discarded_settles_the_request() -> None:
    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        raise SendFailure(CONNECTION, "the link broke")  # the sender is discarded

    client = FakeClient(behaviour=behaviour)
    closing = asyncio.Event()
    open_sender = client.open_sender

    async def slow_close_sender(path: str):  # type: ignore[no-untyped-def]
        sender = await open_sender(path)

        async def close() -> None:
            closing.set()
            await asyncio.Event().wait()  # a close that hangs (bounded by our deadline)

        sender.close = close  # type: ignore[method-assign]
        return sender

    client.open_sender = slow_close_sender  # type: ignore[method-assign]
    d = Dispatcher(LIMITS, TIMEOUTS)
    task = asyncio.create_task(d.send(Destination(client, "orders"), [msg(1)]))
    async with asyncio.timeout(10):
        await closing.wait()
    await d.close(grace=0.0)
    (outcome,) = await _all_settled([task])
    assert isinstance(outcome, SendFailure)


async def test_a_worker_whose_cancel_was_lost_stops_bisecting_at_shutdown() -> None:
    sent_after_stop = 0
    stopping = False

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        nonlocal sent_after_stop
        if stopping:
            sent_after_stop += 1
        if len(client.batches) == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pass  # the SDK lost the cancel (CPython gh-86296)
        raise SendFailure(MESSAGE_REFUSED, "amqp:decode-error")

    client = FakeClient(behaviour=behaviour)
    d, tasks = await _sending(client, 16)
    stopping = True
    await d.close(grace=0.0)
    outcomes = await _all_settled(tasks)
    assert sent_after_stop <= 1  # the send whose cancel was lost, and nothing more
    assert all(e is not None for e in outcomes)


async def test_a_bug_in_a_worker_fails_its_requests_is_counted_and_the_lane_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Restarts(DispatchObserver):
        def __init__(self) -> None:
            self.tasks: list[str] = []

        def task_restarted(self, task: str) -> None:
            self.tasks.append(task)

    calls = 0

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise AssertionError("a bug nobody foresaw")  # not an Exception the send maps

    client = FakeClient(behaviour=behaviour)
    observer = Restarts()
    d = Dispatcher(LIMITS, TIMEOUTS, observer=observer)
    dest = Destination(client, "orders")
    original = d._settle

    def settle_once_broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        if calls == 1:
            raise RuntimeError("a bug in settling")
        return original(*args, **kwargs)

    d._settle = settle_once_broken  # type: ignore[method-assign]
    try:
        with caplog.at_level("ERROR", logger="gateway.core.dispatcher"):
            with pytest.raises(SendFailure):
                async with asyncio.timeout(10):
                    await d.send(dest, [msg(1)])
        assert observer.tasks == ["sender_worker"]
        assert any(r.exc_info for r in caplog.records), "logged with its traceback"
        async with asyncio.timeout(10):
            await d.send(dest, [msg(2)])  # a new worker serves the lane
    finally:
        await d.close(grace=0.0)


async def test_a_failed_open_is_reported_as_of_when_the_open_began() -> None:
    """Failover weighs a failure by when its broker operation began (stale reports, our own
    loop lag): for a sender that could not be opened, that is the open's start, not the
    moment the failure was settled."""
    now = [1000.0]

    class SlowFailingOpen(FakeClient):
        async def open_sender(self, path: str):  # type: ignore[no-untyped-def]
            now[0] += 7.0  # the open took 7 s (of this clock) and failed
            raise SendFailure(CONNECTION, "connection refused")

    d = Dispatcher(LIMITS, TIMEOUTS, clock=lambda: now[0])
    try:
        with pytest.raises(SendFailure) as info:
            async with asyncio.timeout(10):
                await d.send(Destination(SlowFailingOpen(), "orders"), [msg(1)])
        assert info.value.started == 1000.0
    finally:
        await d.close(grace=0.0)


async def test_a_sender_a_bisection_made_suspect_is_reopened_outside_the_send_slot() -> None:
    """A half that fails for the link's sake closes the sender; the next half's sender is
    reopened with the send slot given back, so a reopen that hangs stalls no other entity."""
    gate = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        if path != "orders":
            return
        await gate.wait()
        ids = {m.message_id for m in messages}
        if "r1" in ids and len(ids) > 1:
            raise SendFailure(MESSAGE_REFUSED, "amqp:decode-error")
        if ids == {"r0"}:
            raise SendFailure(CONNECTION, "the link is gone")

    client = ReopensHang()
    client.behaviour = behaviour
    d = Dispatcher(LimitSettings(max_in_flight=1, senders_per_entity=1), TIMEOUTS)
    dest = Destination(client, "orders")
    try:
        first = asyncio.create_task(d.send(dest, [msg("first")]))
        await eventually(lambda: bool(client.batches), every=0, what="the first batch sent")
        tasks = [asyncio.create_task(d.send(dest, [msg(f"r{i}")])) for i in range(4)]
        gate.set()
        await first
        await client.reopening.wait()  # [r0] closed the sender; [r1]'s reopen hangs
        async with no_hang("another entity's send while a bisection reopens its sender"):
            await d.send(Destination(client, "other"), [msg("o")])
        client.reopen.set()
        outcomes = await _all_settled(tasks)
    finally:
        await d.close(grace=1.0)
    assert [type(o).__name__ for o in outcomes] == [
        "SendFailure",
        "NoneType",
        "NoneType",
        "NoneType",
    ]
    assert client.sent_ids("orders")[-3:] == ["r1", "r2", "r3"]
