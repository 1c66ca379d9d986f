"""The dispatcher: settled, bounded, micro-batched sends (fakes at the NamespaceClient port)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence

import pytest

from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.admission import AdmissionGate
from gateway.core.dispatcher import (
    Destination,
    Dispatcher,
    _Group,
    _Lane,
    _State,
    _Wakeup,
    _Worker,
)
from gateway.core.message import OutboundMessage
from gateway.errors import (
    CONNECTION,
    SHUTDOWN,
    TIMEOUT,
    UNKNOWN,
    Classification,
    Draining,
    FailureKind,
    Saturated,
    SendFailure,
)
from tests.support.fakes import FakeClient, FakeSender, ReopensHang, msg
from tests.support.waiting import eventually, next_tick, no_hang

LIMITS = LimitSettings(
    max_in_flight=4, senders_per_entity=2, admission_timeout=0.2, max_batch_messages=50
)
TIMEOUTS = TimeoutSettings(send_timeout=0.3, connect_timeout=1.0)


@pytest.fixture
async def make():
    made: list[Dispatcher] = []

    def factory(limits: LimitSettings = LIMITS, timeouts: TimeoutSettings = TIMEOUTS) -> Dispatcher:
        d = Dispatcher(limits, timeouts)
        made.append(d)
        return d

    yield factory
    for d in made:
        await d.close(grace=0.5)


async def test_concurrent_requests_are_coalesced_into_batches(make):
    client = FakeClient()
    d = make()
    dest = Destination(client, "orders")
    await asyncio.gather(*(d.send(dest, [msg(i)]) for i in range(200)))
    assert sorted(client.sent_ids(), key=int) == [str(i) for i in range(200)]
    assert len(client.batches) < 200 / 5, "200 concurrent requests should need few batches"
    assert max(len(ids) for _, ids in client.batches) <= LIMITS.max_batch_messages


async def test_a_lone_request_is_sent_at_once_without_a_linger_timer(make):
    client = FakeClient()
    d = make()
    await d.send(Destination(client, "orders"), [msg(1)])
    assert client.batches == [("orders", ["1"])]


async def test_a_request_is_never_split_across_batches(make):
    client = FakeClient()
    d = make()
    dest = Destination(client, "orders")
    groups = [[msg(f"{g}-{i}") for i in range(7)] for g in range(30)]
    await asyncio.gather(*(d.send(dest, g) for g in groups))
    for g in groups:
        ids = {m.message_id for m in g}
        holding = [b for _, b in client.batches if ids & set(b)]
        assert len(holding) == 1 and ids <= set(holding[0])


async def test_different_sessions_never_share_a_batch(make):
    client = FakeClient()
    d = make()
    dest = Destination(client, "orders")
    await asyncio.gather(*(d.send(dest, [msg(i, session=f"s{i % 3}")]) for i in range(60)))
    for _, ids in client.batches:
        assert len({int(i) % 3 for i in ids}) == 1


async def test_a_failed_batch_fails_exactly_its_requests(make):
    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        if any(m.message_id.startswith("bad") for m in messages):
            raise SendFailure(CONNECTION, "boom")

    client = FakeClient(behaviour=behaviour)
    d = make(LimitSettings(max_in_flight=4, senders_per_entity=1, max_batch_messages=1))
    dest = Destination(client, "orders")
    results = await asyncio.gather(
        d.send(dest, [msg("good-1")]),
        d.send(dest, [msg("bad-1")]),
        d.send(dest, [msg("good-2")]),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], SendFailure) and results[1].kind is FailureKind.CONNECTION


async def test_a_hanging_broker_is_answered_within_send_timeout_and_the_sender_recreated(make):
    hang = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        if not hang.is_set():
            await asyncio.Event().wait()  # never settles

    client = FakeClient(behaviour=behaviour)
    d = make(LimitSettings(senders_per_entity=1))
    dest = Destination(client, "orders")
    with pytest.raises(SendFailure) as info:
        await d.send(dest, [msg(1)])
    assert info.value.kind is FailureKind.TIMEOUT and info.value.status == 503
    assert client.closed_senders == 1
    hang.set()
    await d.send(dest, [msg(2)])
    assert client.opened == 2, "the suspect sender was replaced by a new one"


async def test_saturation_answers_503_and_memory_stays_bounded(make):
    gate = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await gate.wait()

    client = FakeClient(behaviour=behaviour)
    limits = LimitSettings(
        max_in_flight=1,
        senders_per_entity=1,
        admission_timeout=0.05,
        max_pending_bytes=2048,
        max_batch_bytes=2048,
        max_message_bytes=1024,
    )
    d = make(limits, TimeoutSettings(send_timeout=30))
    dest = Destination(client, "orders")
    tasks = [asyncio.create_task(d.send(dest, [msg(i, size=200)])) for i in range(50)]
    done, _ = await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_EXCEPTION)
    saturated = [t for t in done if isinstance(t.exception(), Saturated)]
    assert saturated, "requests beyond the byte budget must be refused"
    assert saturated[0].exception().status == 503 and saturated[0].exception().retry_after
    assert d.gate.used <= limits.max_pending_bytes
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    accepted = [r for r in results if r is None]
    refused = [r for r in results if isinstance(r, Saturated)]
    assert len(accepted) + len(refused) == 50 and accepted
    assert d.gate.used == 0


async def test_close_fails_what_could_not_be_sent(make):
    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await asyncio.Event().wait()

    client = FakeClient(behaviour=behaviour)
    d = make(LimitSettings(senders_per_entity=1), TimeoutSettings(send_timeout=60))
    dest = Destination(client, "orders")
    tasks = [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(3)]
    await eventually(lambda: bool(client.batches))
    await d.close(grace=0.05)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, SendFailure) for r in results)
    # In flight or still pending: either way the SHUTDOWN row, which never counts toward
    # failover and asks for a retry at once (another replica can take it).
    assert {r.classification for r in results} == {SHUTDOWN}  # type: ignore[union-attr]
    assert {r.retry_after for r in results} == {1.0}  # type: ignore[union-attr]


async def test_a_send_raises_when_it_is_awaited_never_when_it_is_called(make):
    """`send` is no coroutine function itself (it gives `_submit`'s coroutine): its errors,
    the shutdown's included, still come from the await, so a caller that makes several
    sends before awaiting them (`asyncio.gather`) gets every one's error and none is lost."""
    client = FakeClient()
    d = make()
    dest = Destination(client, "orders")
    await d.close(grace=0.05)
    sends = [d.send(dest, [msg(i)]) for i in range(3)]  # no error yet
    results = await asyncio.gather(*sends, return_exceptions=True)
    assert all(isinstance(r, Draining) for r in results), results
    assert client.batches == []


@pytest.mark.unit
async def test_the_gate_takes_room_at_once_only_while_nobody_waits_for_it():
    """`try_acquire`, the hot path's take without a coroutine, keeps `acquire`'s order: room
    goes to whoever waits first."""
    gate = AdmissionGate(100)
    assert gate.try_acquire(60) and gate.used == 60
    assert not gate.try_acquire(50) and gate.used == 60  # no room
    waiter = asyncio.create_task(gate.acquire(50, 5.0))
    await next_tick()
    assert gate.waiting == 1
    assert not gate.try_acquire(10)  # room for it, but the waiter was first
    gate.release(60)
    await waiter
    assert gate.used == 50 and gate.waiting == 0
    assert gate.try_acquire(10) and gate.used == 60
    gate.release(60)
    assert gate.try_acquire(10_000) and gate.used == 100  # an oversized one alone, capped
    gate.release(10_000)
    assert gate.used == 0


async def test_cancelled_request_that_was_not_handed_over_is_never_sent(make):
    gate = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await gate.wait()

    client = FakeClient(behaviour=behaviour)
    d = make(LimitSettings(senders_per_entity=1, max_in_flight=1), TimeoutSettings(send_timeout=60))
    dest = Destination(client, "orders")
    first = asyncio.create_task(d.send(dest, [msg("first")]))
    await eventually(lambda: bool(client.batches))
    second = asyncio.create_task(d.send(dest, [msg("second")]))
    await next_tick()
    second.cancel()
    gate.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await second
    assert client.sent_ids() == ["first"]


async def test_nothing_opens_before_an_entity_is_sent_to_and_then_one_sender(make):
    client = FakeClient()
    d = make()
    dests = [Destination(client, f"q{i}") for i in range(1000)]  # declared, never used
    await d.send(dests[7], [msg(1)])
    assert client.opened == 1 and d.open_senders == 1 and d.lanes == 1


async def _grow(d: Dispatcher, client: FakeClient, n: int) -> list[asyncio.Task[None]]:
    """`n` requests to "orders", each sent once the one before is with the broker (its
    behaviour holds them): each finds every sender busy, so the lane grows to `n`."""
    sends: list[asyncio.Task[None]] = []
    for i in range(n):
        sends.append(asyncio.create_task(d.send(Destination(client, "orders"), [msg(i)])))
        await eventually(lambda: len(client.batches) == len(sends))
    return sends


def _holding(client: FakeClient, release: asyncio.Event, first: int) -> None:
    """`client` holds the sends of messages with ids below `first` until `release`."""

    async def held(path: str, messages: Sequence[OutboundMessage]) -> None:
        if int(messages[0].message_id) < first:
            await release.wait()

    client.behaviour = held


async def test_a_lane_grows_with_its_load_up_to_senders_per_entity_and_no_further(make):
    client, release = FakeClient(), asyncio.Event()
    _holding(client, release, first=1000)
    d = make(
        LimitSettings(max_in_flight=16, senders_per_entity=3, admission_timeout=60.0),
        TimeoutSettings(send_timeout=60.0),
    )
    dest = Destination(client, "orders")
    sends = await _grow(d, client, 3)
    assert client.opened == 3
    sends += [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(3, 40)]
    await next_tick(5)
    assert client.opened == 3 and len(client.batches) == 3  # at the cap: the rest wait
    release.set()
    await asyncio.gather(*sends)
    assert client.opened == 3 and sorted(client.sent_ids(), key=int) == [str(i) for i in range(40)]


async def test_an_idle_sender_is_closed_and_its_lane_dropped(make):
    client = FakeClient()
    d = make(LimitSettings(senders_per_entity=2, sender_idle_timeout=0.05), TIMEOUTS)
    await d.send(Destination(client, "orders"), [msg(1)])
    await eventually(lambda: client.closed_senders == client.opened == 1)
    await eventually(lambda: d.lanes == 0 and d.open_senders == 0)
    await d.send(Destination(client, "orders"), [msg(2)])  # it comes back on demand
    assert client.sent_ids() == ["1", "2"] and client.opened == 2


async def test_a_grown_lane_shrinks_back_under_steady_light_traffic(make):
    """Every parked worker wakes for each request and one takes it: the others' idle time
    runs on from their last send, so they end while the lane keeps serving."""
    client, release = FakeClient(), asyncio.Event()
    _holding(client, release, first=2)
    d = make(
        LimitSettings(senders_per_entity=2, sender_idle_timeout=0.3, admission_timeout=5.0),
        TimeoutSettings(send_timeout=60.0),
    )
    burst = await _grow(d, client, 2)
    release.set()
    await asyncio.gather(*burst)
    assert client.opened == 2
    sent = 2

    async def one_more_request_then_shrunk() -> bool:
        nonlocal sent
        sent += 1
        await d.send(Destination(client, "orders"), [msg(sent)])
        return client.closed_senders == 1

    await eventually(one_more_request_then_shrunk, within=20.0)
    assert d.open_senders == 1 and d.lanes == 1


# A lane of three workers that stay parked (`_parked_lane`).
PARKED = LimitSettings(senders_per_entity=3, sender_idle_timeout=600, admission_timeout=5.0)


async def _parked_lane(d: Dispatcher, client: FakeClient, n: int) -> _Lane:
    """ "orders" grown to `n` workers (`_grow`), every one of them parked again."""
    release = asyncio.Event()
    _holding(client, release, first=n)
    burst = await _grow(d, client, n)
    release.set()
    await asyncio.gather(*burst)
    lane = d._lanes[Destination(client, "orders").key]
    await eventually(lambda: len(lane.wakeup._waiters) == len(lane.workers) == n)
    return lane


def _count_slots(d: Dispatcher) -> list[int]:
    """Counts the send slots the workers take (one per wake-up that claims work)."""
    taken = [0]
    acquire = d._in_flight.acquire

    async def counting() -> bool:
        taken[0] += 1
        return await acquire()

    d._in_flight.acquire = counting  # type: ignore[method-assign]
    return taken


async def test_a_request_wakes_one_parked_worker_not_every_one(make):
    """The hand-off's cost: with every worker of a lane parked, one request wakes one of
    them (each worker woken takes a send slot before it looks for work)."""
    client = FakeClient()
    d = make(PARKED, TimeoutSettings(send_timeout=60.0))
    lane = await _parked_lane(d, client, 3)
    taken = _count_slots(d)
    for i in range(3, 6):  # one at a time: each finds the lane idle
        await d.send(Destination(client, "orders"), [msg(i)])
        await eventually(lambda: len(lane.wakeup._waiters) == 3)
    assert client.sent_ids()[3:] == ["3", "4", "5"]
    assert taken[0] == 3, f"{taken[0]} wake-ups for 3 requests"


async def test_requests_arriving_while_the_woken_worker_claims_join_its_batch(make):
    """Micro-batching with one worker woken: requests that arrive on the ticks before it
    takes (its yield included) go out with the first, as when every worker woke and the
    first took everything; no second worker is woken to send them apart."""
    client = FakeClient()
    d = make(PARKED, TimeoutSettings(send_timeout=60.0))
    lane = await _parked_lane(d, client, 3)
    taken = _count_slots(d)
    sends = []
    for i in (3, 4):  # one request a tick
        sends.append(asyncio.create_task(d.send(Destination(client, "orders"), [msg(i)])))
        await next_tick()
    await asyncio.gather(*sends)
    assert client.batches[3:] == [("orders", ["3", "4"])]
    await eventually(lambda: len(lane.wakeup._waiters) == 3)
    assert taken[0] == 1, f"{taken[0]} workers woken for one batch"


async def test_a_woken_worker_that_parks_again_without_taking_is_woken_again():
    """Its sender closed for another entity's open, say, a woken worker goes back to wait
    before it took anything, and with the pending requests expired meanwhile nothing is
    pending: the next request must wake it (or a lane of one worker waits out its idle
    timeout, and `_expire` waits for it)."""
    wakeup = _Wakeup()
    w = _Worker(_Lane(Destination(FakeClient(), "orders")), 0.0)
    parked = asyncio.create_task(wakeup.wait(w))
    await next_tick()
    wakeup.set()
    await parked
    assert wakeup.woken is w
    parked = asyncio.create_task(wakeup.wait(w))  # back, without a take
    await next_tick()
    wakeup.set()
    async with no_hang("the second wake-up"):
        await parked


async def test_a_backlog_larger_than_a_batch_still_spreads_over_the_parked_workers(make):
    """One woken worker takes a batch and wakes the next for the rest: sends run in
    parallel as they did when every worker woke."""
    client = FakeClient()
    d = make(dataclasses.replace(PARKED, max_batch_messages=1), TimeoutSettings(send_timeout=60.0))
    await _parked_lane(d, client, 3)
    release = asyncio.Event()
    _holding(client, release, first=6)
    sends = [
        asyncio.create_task(d.send(Destination(client, "orders"), [msg(i)])) for i in (3, 4, 5)
    ]
    await eventually(lambda: len(client.batches) == 6, what="three batches in flight at once")
    release.set()
    await asyncio.gather(*sends)
    assert sorted(client.sent_ids()[3:]) == ["3", "4", "5"] and client.opened == 3


async def test_at_max_open_senders_the_least_recently_used_idle_one_is_closed(make):
    client = FakeClient()
    d = make(LimitSettings(max_open_senders=2, sender_idle_timeout=600), TIMEOUTS)

    async def send(path: str) -> None:
        await d.send(Destination(client, path), [msg(path)])
        await next_tick()  # the worker parks (joins the LRU) once it has settled

    for path in ("a", "b", "a", "c"):  # at c, b is the least recently used: closed
        await send(path)
    assert (client.opened, client.closed_senders, d.open_senders) == (3, 1, 2)
    await send("a")  # still open
    assert client.opened == 3
    await send("b")  # reopened; c goes (a was used since)
    await send("a")
    assert (client.opened, client.closed_senders, d.open_senders) == (4, 2, 2)
    assert client.sent_ids() == ["a", "b", "a", "c", "a", "b", "a"]


async def _fail_with(make, behaviour, retry_after: float) -> SendFailure:
    d = make(timeouts=TimeoutSettings(send_timeout=0.3, retry_after=retry_after))
    with pytest.raises(SendFailure) as info:
        await d.send(Destination(FakeClient(behaviour=behaviour), "orders"), [msg(1)])
    return info.value


async def _hang(path: str, messages: Sequence[OutboundMessage]) -> None:
    await asyncio.Event().wait()


async def _adapter_bug(path: str, messages: Sequence[OutboundMessage]) -> None:
    raise RuntimeError("a bug in an adapter")


async def _unreachable(path: str, messages: Sequence[OutboundMessage]) -> None:
    raise SendFailure(CONNECTION, "unreachable")


@pytest.mark.parametrize(
    ("behaviour", "row"),
    [(_hang, TIMEOUT), (_adapter_bug, UNKNOWN), (_unreachable, CONNECTION)],
    ids=["our send_timeout", "unexpected exception", "a row of the SDK map"],
)
async def test_upstream_failures_use_their_row_and_the_operators_retry_after(
    make, behaviour, row: Classification
):
    """Our own deadline is the TIMEOUT row the SDK's timeout maps to (no second TIMEOUT with
    its own Retry-After); every upstream back-off lasts the configured `retry_after`."""
    failure = await _fail_with(make, behaviour, retry_after=7.0)
    assert failure.classification is row
    assert failure.retry_after == 7.0 and row.retry_after == 10.0


async def test_a_request_no_sender_takes_in_time_is_refused_and_never_sent(make):
    release = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await release.wait()  # the broker does not answer until told to

    client = FakeClient(behaviour=behaviour)
    d = make(
        LimitSettings(max_in_flight=1, senders_per_entity=1, admission_timeout=0.05),
        TimeoutSettings(send_timeout=60),
    )
    dest = Destination(client, "orders")
    first = asyncio.create_task(d.send(dest, [msg("first")]))
    await eventually(lambda: bool(client.batches))
    # The byte budget has plenty of room: only the busy sender keeps these waiting.
    waiting = [asyncio.create_task(d.send(dest, [msg(f"w{i}")])) for i in range(5)]
    async with no_hang("requests waiting behind a sender that never finishes"):
        results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, Saturated) for r in results), results
    assert {r.status for r in results} == {503}  # type: ignore[union-attr]
    assert all(r.retry_after for r in results)  # type: ignore[union-attr]
    assert d.pending_messages() == 0, "the refused requests left the queue"
    release.set()
    await first
    # `first` was taken before the others and outlived their deadline: not refused.
    assert client.sent_ids() == ["first"], "a refused request is never sent"
    assert d.gate.used == 0


class _SlowToOpen(FakeClient):
    """A namespace whose senders open only when `opened_ok` is set (one that is away)."""

    def __init__(self) -> None:
        super().__init__()
        self.opening = asyncio.Event()
        self.opened_ok = asyncio.Event()

    async def open_sender(self, path: str) -> FakeSender:
        self.opening.set()
        await self.opened_ok.wait()
        return await super().open_sender(path)


async def test_requests_are_refused_in_time_while_a_sender_is_still_opening(make):
    client = _SlowToOpen()
    d = make(
        LimitSettings(max_in_flight=1, senders_per_entity=1, admission_timeout=0.05),
        TimeoutSettings(send_timeout=60, connect_timeout=60),
    )
    dest = Destination(client, "orders")
    early = [asyncio.create_task(d.send(dest, [msg(f"e{i}")])) for i in range(3)]
    await client.opening.wait()
    async with no_hang("requests waiting for a sender that is still opening"):
        results = await asyncio.gather(*early, return_exceptions=True)
    # An upstream timeout, not saturation: it counts toward failover, so even a sparse flow
    # whose every request expires while an open hangs still fails the entity over.
    assert all(isinstance(r, SendFailure) and r.classification is TIMEOUT for r in results), results
    assert all(r.classification.counts_toward_failover for r in results)
    assert client.batches == [], "nothing was taken, so nothing was sent"
    client.opened_ok.set()
    await d.send(dest, [msg("later")])
    assert client.sent_ids() == ["later"]
    assert d.gate.used == 0


async def test_a_namespace_whose_opens_hang_leaves_the_send_slots_to_the_others(make):
    """Opening a sender holds no send slot: 8 entities of a namespace that hangs on open
    (each worker trying) must not starve the backlog queue of the other namespace."""
    down = _SlowToOpen()
    up = FakeClient("secondary")
    d = make(
        LimitSettings(max_in_flight=4, senders_per_entity=2, admission_timeout=5.0),
        TimeoutSettings(send_timeout=60, connect_timeout=60),
    )
    stuck = [asyncio.create_task(d.send(Destination(down, f"e{i}"), [msg(i)])) for i in range(8)]
    await down.opening.wait()
    async with no_hang("a send to a healthy namespace while another hangs on open"):
        await d.send(Destination(up, "x-servicebus-transfer/0"), [msg("backlog")])
    assert up.sent_ids() == ["backlog"]
    down.opened_ok.set()
    async with no_hang("the hanging namespace's requests once it opens"):
        await asyncio.gather(*stuck)


async def test_a_zero_admission_timeout_still_sends_through_idle_senders(make):
    """`_expire` runs at the deadline; a worker woken for the request but not yet past
    `take` must keep it (admission_timeout 0 is a valid setting)."""
    client = FakeClient()
    d = make(LimitSettings(admission_timeout=0.0), TIMEOUTS)
    dest = Destination(client, "orders")
    for i in range(20):
        await d.send(dest, [msg(i)])
    assert client.sent_ids() == [str(i) for i in range(20)]


async def test_a_request_expired_during_an_open_takes_the_operators_retry_after(make):
    client = _SlowToOpen()
    d = make(
        LimitSettings(senders_per_entity=1, admission_timeout=0.05),
        TimeoutSettings(send_timeout=60, connect_timeout=60, retry_after=3.0),
    )
    with pytest.raises(SendFailure) as info:
        await d.send(Destination(client, "orders"), [msg("m")])
    assert info.value.classification is TIMEOUT and info.value.retry_after == 3.0
    client.opened_ok.set()


async def test_a_sender_closed_while_its_worker_waits_for_a_slot_is_reopened_outside_it(make):
    """A worker woken for work waits for a send slot while another entity's open closes its
    idle sender (at `max_open_senders`); its reopen must not hold the slot, or one hanging
    open would stall every entity behind it."""
    client, release = ReopensHang(), asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        if path == "b":
            await release.wait()

    client.behaviour = behaviour
    d = make(
        LimitSettings(
            max_in_flight=1, senders_per_entity=1, max_open_senders=2, admission_timeout=60.0
        ),
        TimeoutSettings(send_timeout=60, connect_timeout=60),
    )
    await d.send(Destination(client, "a"), [msg("a1")])
    await next_tick()  # a's worker parks, its sender idle
    b = asyncio.create_task(d.send(Destination(client, "b"), [msg("b1")]))
    await eventually(lambda: "b1" in client.sent_ids())  # b holds the only slot
    a = asyncio.create_task(d.send(Destination(client, "a"), [msg("a2")]))
    await next_tick(5)  # a's worker wakes and waits for the slot
    c = asyncio.create_task(d.send(Destination(client, "c"), [msg("c1")]))
    await eventually(lambda: client.closed_senders == 1)  # c's open closed a's idle sender
    release.set()
    await b
    async with no_hang("an entity's send while another's sender reopens and hangs"):
        await c
    client.reopen.set()
    await a
    assert sorted(client.sent_ids()) == ["a1", "a2", "b1", "c1"]


async def test_requests_that_arrive_while_a_sender_opens_wait_for_it_not_for_a_second_open(make):
    # A cold entity: the first request's worker is opening its sender (an attach and a
    # put-token, round trips to the broker). What arrives meanwhile fits that worker's first
    # batch, so another worker would only open a second sender (a second cold open, at
    # 1,000 entities twice the opens), not send any sooner.
    client = _SlowToOpen()  # a cold entity's sender being attached
    d = make(
        LimitSettings(max_in_flight=16, senders_per_entity=4, admission_timeout=60.0),
        TimeoutSettings(send_timeout=60.0, connect_timeout=60.0),
    )
    dest = Destination(client, "orders")
    first = asyncio.create_task(d.send(dest, [msg(0)]))
    async with no_hang("the first open starts"):
        await client.opening.wait()
    rest = [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(1, 10)]
    await next_tick(5)
    client.opened_ok.set()
    async with no_hang("every send settles"):
        await asyncio.gather(first, *rest)
    assert client.opened == 1
    assert sorted(client.sent_ids(), key=int) == [str(i) for i in range(10)]


async def test_a_burst_larger_than_a_batch_still_grows_the_lane_while_its_sender_opens(make):
    # More than the opening worker's first batch can take: a second worker (and sender) is
    # worth its open.
    client = _SlowToOpen()  # a cold entity's sender being attached
    d = make(
        LimitSettings(
            max_in_flight=16, senders_per_entity=3, admission_timeout=60.0, max_batch_messages=5
        ),
        TimeoutSettings(send_timeout=60.0, connect_timeout=60.0),
    )
    dest = Destination(client, "orders")
    sends = [asyncio.create_task(d.send(dest, [msg(0)]))]
    async with no_hang("the first open starts"):
        await client.opening.wait()
    sends += [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(1, 12)]
    await next_tick(5)
    client.opened_ok.set()
    async with no_hang("every send settles"):
        await asyncio.gather(*sends)
    assert client.opened == 2
    assert sorted(client.sent_ids(), key=int) == [str(i) for i in range(12)]


# -- pacing: a lane's sends spread over the broker's round trip ---------------------------

_RTT = 0.04  # the fake broker's round trip


def _slow_broker(starts: list[float]):
    """A broker that takes `_RTT` to store each batch, recording when each send began."""

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        starts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(_RTT)  # the fake broker's latency, not a wait for a condition

    return behaviour


async def _warm_lane(make) -> tuple[list[float], FakeClient, Dispatcher, Destination]:
    """A lane of 4 senders to the slow broker, its round trip measured (>= `_RTT`) by one
    send; the list of send start times it fills."""
    starts: list[float] = []
    client = FakeClient(behaviour=_slow_broker(starts))
    d = make(dataclasses.replace(LIMITS, senders_per_entity=4))
    dest = Destination(client, "orders")
    await d.send(dest, [msg("warm")])
    return starts, client, d, dest


async def test_a_lane_spreads_its_sends_over_the_round_trip_instead_of_sending_together(make):
    # Unpaced, requests arriving a turn apart while one batch is in flight each woke a
    # worker, and every worker sent within a millisecond: what came next waited for the
    # whole cluster's return, up to a round trip (a 50 ms broker: p99 95 ms for 58 paced).
    starts, client, d, dest = await _warm_lane(make)
    sends = []
    for i in range(4):
        sends.append(asyncio.ensure_future(d.send(dest, [msg(i)])))
        await next_tick(3)
    async with no_hang("the paced sends"):
        await asyncio.gather(*sends)
    assert sorted(client.sent_ids()[1:], key=int) == ["0", "1", "2", "3"]
    paced = starts[1:]
    assert len(paced) >= 2, client.batches
    gap = _RTT / 4  # the round trip / senders_per_entity
    assert all(b - a >= gap * 0.99 for a, b in itertools.pairwise(paced)), paced


async def test_requests_arriving_while_a_worker_waits_out_the_pace_join_its_batch(make):
    _starts, client, d, dest = await _warm_lane(make)
    first = asyncio.ensure_future(d.send(dest, [msg("first")]))
    await next_tick(3)  # in flight: what comes next is paced
    rest = []
    for i in range(20):
        rest.append(asyncio.ensure_future(d.send(dest, [msg(i)])))
        await next_tick()
    async with no_hang("the paced sends"):
        await asyncio.gather(first, *rest)
    # one worker waits out the pace and takes all 20; none is added for them meanwhile
    assert [len(ids) for _, ids in client.batches] == [1, 1, 20], client.batches


async def test_a_lone_request_after_the_lane_went_quiet_is_not_paced(make):
    starts, _client, d, dest = await _warm_lane(make)
    loop = asyncio.get_running_loop()
    asked = loop.time()
    await d.send(dest, [msg("next")])  # nothing in flight: sent at once
    assert starts[1] - asked < _RTT / 4, "a request with nothing in flight must not be paced"


async def test_a_request_past_its_deadline_is_refused_while_a_worker_waits_out_the_pace(make):
    # A pace lasts at most MAX_PACE, but a lane over its capacity has some worker pacing most
    # of the time: the admission deadline must not wait for one (it waited only for a worker
    # about to take within the turn).
    d = make()
    lane = d._lane(Destination(FakeClient(), "orders"))
    pacing = _Worker(lane, 0.0)
    pacing.state = _State.PACING
    lane.workers.append(pacing)
    loop = asyncio.get_running_loop()
    group = _Group([msg(1)], 10, loop.create_future(), deadline=loop.time() - 1.0)
    lane.pending.append(group)
    d._expire(lane)
    assert isinstance(group.future.exception(), Saturated)
    assert lane.expiry is None and not lane.pending
    lane.workers.clear()
