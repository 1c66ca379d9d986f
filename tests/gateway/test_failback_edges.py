"""Send availability at its edges, one deterministic reproduction each, on virtual time.

1. A forced failover holds until an operator marks the entity healthy or a ping *after*
   `ping_primary_interval` succeeds (it used to be undone by an immediate ping).
2. A backlog write that completes after the failback's depth check still wakes the syphon,
   on the same replica or another (it used to wait for the 15-minute safety check).
3. A failback wakes a backlog queue that is backing off (it used to wait for the timer).
4. A scheduled message goes home expiring at its original schedule + TTL.

The same rig (`tests/support/failover_rig.py`) drives the stateful property test in
`test_failback_property.py`; these are the single interleavings the issue reported.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Awaitable, Callable

import pytest

from gateway.core.backlog import BACKLOG_LOCK_DURATION, restore, rewrite
from gateway.core.failover import FORCED, MARKED_HEALTHY, PING_DELIVERED
from gateway.core.message import OutboundMessage
from gateway.core.router import Delivery
from gateway.syphon.syphon import BACKOFF_MAX, MIN_CHECK_SPACING, TTL_EXPIRED
from tests.support.failover_rig import (
    EVENTS,
    FAILOVER,
    ORDERS,
    QUEUES,
    SYPHON,
    TIME_TO_HOME,
    Replica,
    messages,
)
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import ClusterStore, FakeRedis
from tests.support.virtual_time import VirtualTimeLoop, elapse, until

INTERVAL = FAILOVER.ping_primary_interval


class Rig:
    """Replicas on virtual time; `run` executes a scenario coroutine on the loop."""

    def __init__(self) -> None:
        self.loop = VirtualTimeLoop()
        self.redis = FakeRedis()
        self.primary = FakeNamespace("primary")
        self.secondary = FakeNamespace("secondary")
        self.replicas: list[Replica] = []

    async def replica(self, name: str, **kwargs: object) -> Replica:
        r = Replica(name, self.redis, self.primary, self.secondary, **kwargs)  # type: ignore[arg-type]
        await r.start()
        self.replicas.append(r)
        return r

    def now(self) -> float:
        return self.loop.time()

    def backlog_ids(self) -> list[str]:
        return [i for q in QUEUES for i in self.secondary.ids(q)]

    def home_ids(self, path: str = "orders") -> list[str]:
        return self.primary.ids(path)

    def run(self, scenario: Callable[[Rig], Awaitable[None]]) -> None:
        async def main() -> None:
            try:
                await scenario(self)
            finally:
                for r in self.replicas:
                    await r.stop()

        try:
            self.loop.run(main())
        finally:
            self.loop.close()


@pytest.fixture
def rig() -> Rig:
    return Rig()


# -- 1. a forced failover holds --------------------------------------------------------------


def test_a_forced_failover_holds_until_a_ping_after_the_interval(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        forced_at = rig.now()
        assert r.failover.force_failover(ORDERS).status == "failed_over"
        await elapse(0.01)
        [row] = [e for e in await r.failover.describe() if e["entity"] == "orders"]
        assert row["reason"] == FORCED and row["nextPing"] == pytest.approx(forced_at + INTERVAL)
        await elapse(INTERVAL - 0.5)
        assert rig.primary.pings == 0, "no ping before ping_primary_interval"
        assert r.status() == "failed_over"
        delivery = await r.failover.submit(ORDERS, messages("during"))
        assert delivery.route == "backlog"
        took = await until(lambda: r.status() == "healthy", within=2)
        assert rig.primary.pings == 1
        assert rig.now() - forced_at >= INTERVAL and took > 0
        assert r.store.get("orders").reason == PING_DELIVERED

    rig.run(scenario)


def test_a_forced_failover_ends_when_an_operator_marks_the_entity_healthy(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        r.failover.force_failover(ORDERS)
        await elapse(1)
        assert r.failover.mark_healthy(ORDERS).status == "healthy"
        await elapse(INTERVAL * 2)
        assert rig.primary.pings == 0, "pings stop when the failover ends"
        assert r.store.get("orders").reason == MARKED_HEALTHY
        assert (await r.failover.submit(ORDERS, messages("after"))).route == "primary"

    rig.run(scenario)


def test_pings_keep_their_interval_while_the_primary_stays_down(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        rig.primary.down = True
        r.failover.force_failover(ORDERS)
        forced_at = rig.now()
        pings: list[float] = []
        for n in range(1, 4):
            await until(lambda n=n: rig.primary.ping_attempts >= n, within=INTERVAL + 1)
            pings.append(rig.now())
        gaps = [b - a for a, b in zip([forced_at, *pings], pings, strict=False)]
        assert all(g >= INTERVAL - 1e-3 for g in gaps), gaps
        assert r.status() == "failed_over" and rig.primary.pings == 0

    rig.run(scenario)


def test_a_new_failover_while_the_pinger_gives_its_lease_up_still_gets_a_pinger(
    rig: Rig,
) -> None:
    """The pinger of the last failover may still be releasing its lease (a Redis round
    trip) when the entity fails over again: the new failover must still be pinged."""

    class SlowRelease(ClusterStore):
        async def release_lease(self, name: str) -> None:
            await elapse(0.5)
            await super().release_lease(name)

    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0", store=SlowRelease(rig.redis, "r0"))
        r.failover.force_failover(ORDERS)
        await until(lambda: r.status() == "healthy", within=INTERVAL + 1)  # pinged back
        await elapse(0.1)  # the pinger is now giving its lease up
        r.failover.force_failover(ORDERS)
        await until(lambda: r.status() == "healthy", within=INTERVAL + 1)
        assert rig.primary.pings == 2

    rig.run(scenario)


# -- 2. a backlog write that completes after the failback ------------------------------------


async def _write_racing_the_failback(rig: Rig, writer: Replica, failback: Replica) -> list[str]:
    """Fail over, start 4 backlog writes, fail back while they are in flight, complete them."""
    writer.failover.force_failover(ORDERS)
    await elapse(0.1)
    rig.secondary.hold = True
    ids = [f"race-{i}" for i in range(4)]
    requests = [asyncio.ensure_future(writer.failover.submit(ORDERS, messages(i))) for i in ids]
    await until(lambda: len(rig.secondary.held) >= 1, within=1, step=0.001)
    failback.failover.mark_healthy(ORDERS)
    await elapse(0.1)  # every replica saw it, every syphon checked: nothing there yet
    assert rig.backlog_ids() == []
    rig.secondary.hold = False
    rig.secondary.release()
    deliveries: list[Delivery] = list(await asyncio.gather(*requests))
    assert {d.route for d in deliveries} == {"backlog"}, "acknowledged 202"
    return ids


def test_a_backlog_write_completing_after_the_failback_is_moved_home(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        ids = await _write_racing_the_failback(rig, writer=r, failback=r)
        took = await until(lambda: sorted(rig.home_ids()) == ids, within=TIME_TO_HOME)
        assert rig.backlog_ids() == [] and took <= TIME_TO_HOME

    rig.run(scenario)


def test_the_same_when_the_write_and_the_failback_are_on_different_replicas(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        writer = await rig.replica("writer", syphon=False)  # a `gateway serve` without syphon
        other = await rig.replica("other")
        ids = await _write_racing_the_failback(rig, writer=writer, failback=other)
        await until(lambda: sorted(rig.home_ids()) == ids, within=TIME_TO_HOME)
        assert rig.backlog_ids() == []

    rig.run(scenario)


def test_writes_completing_while_redis_is_down_are_moved_once_it_is_back(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        writer = await rig.replica("writer", syphon=False)
        syphon = await rig.replica("syphon")
        await elapse(2)  # the start-up checks are done
        writer.failover.force_failover(ORDERS)
        await elapse(0.1)
        rig.secondary.hold = True
        request = asyncio.ensure_future(writer.failover.submit(ORDERS, messages("m")))
        await until(lambda: len(rig.secondary.held) == 1, within=1, step=0.001)
        syphon.failover.mark_healthy(ORDERS)
        await elapse(0.1)
        rig.redis.stop()  # the announcement cannot be published now
        rig.secondary.hold = False
        rig.secondary.release()
        assert (await request).route == "backlog"
        await elapse(30)
        assert rig.home_ids() == [], "nobody could tell the syphon yet"
        rig.redis.start()
        await until(
            lambda: rig.home_ids() == ["m"], within=rig.redis.reconnect_delay + TIME_TO_HOME
        )
        assert syphon.syphon is not None and syphon.syphon.stats.moved == 1

    rig.run(scenario)


def test_a_replica_that_starts_announces_every_backlog_queue(rig: Rig) -> None:
    """A replica killed between its backlog write and seeing the failback cannot announce
    the write; when it starts again it announces every queue, and a syphon looks."""

    async def scenario(rig: Rig) -> None:
        syphon = await rig.replica("syphon")
        await elapse(1)
        rig.secondary.entities[QUEUES[1]] = []
        # As a dead replica left it: written after the failback check, never announced.
        await rig.secondary.store(QUEUES[1], [rewrite(messages("orphan")[0], "orders", 0.0)])
        await elapse(60)
        assert rig.home_ids() == []
        await rig.replica("restarted", syphon=False)
        await until(lambda: rig.home_ids() == ["orphan"], within=TIME_TO_HOME)
        assert syphon.syphon is not None and syphon.syphon.stats.moved == 1

    rig.run(scenario)


# -- 3. a failback wakes a queue that backs off ----------------------------------------------


def test_a_failback_wakes_a_backlog_queue_in_retry_backoff(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        no_pings = dataclasses.replace(FAILOVER, ping_primary_interval=3600)
        r = await rig.replica("r0", failover=no_pings)
        r.failover.force_failover(ORDERS)
        await elapse(0.1)
        assert (await r.failover.submit(ORDERS, messages("waiting"))).route == "backlog"
        # The syphon finds it, cannot move it (orders is failed over) and backs off, longer
        # each time: after a while its next look is up to BACKOFF_MAX away.
        await elapse(3 * BACKOFF_MAX)
        assert rig.backlog_ids() == ["waiting"]
        # Another entity fails over and back: the syphon checks, but orders is still out.
        r.failover.force_failover(EVENTS)
        await elapse(1)
        r.failover.mark_healthy(EVENTS)
        await elapse(2)
        assert rig.backlog_ids() == ["waiting"]
        r.failover.mark_healthy(ORDERS)
        took = await until(lambda: rig.home_ids() == ["waiting"], within=TIME_TO_HOME)
        assert took <= MIN_CHECK_SPACING + 0.1, f"waited {took:.1f}s for a backoff timer"

    rig.run(scenario)


def test_a_message_locked_by_a_dead_receiver_is_moved_when_its_lock_expires(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        await rig.secondary.store(QUEUES[0], [rewrite(messages("locked")[0], "orders", 0.0)])
        await rig.secondary.receive(QUEUES[0], 1, 0)  # a receiver that then died
        assert r.syphon is not None
        r.syphon.request_check()
        took = await until(lambda: rig.home_ids() == ["locked"], within=120)
        # The lock's expiry, once the receive that found nothing has waited its time.
        bound = BACKLOG_LOCK_DURATION + 1 + MIN_CHECK_SPACING + SYPHON.receive_wait
        assert BACKLOG_LOCK_DURATION <= took <= bound, took

    rig.run(scenario)


# -- 4. scheduled messages through the backlog -----------------------------------------------

T0 = 1_800_000_000.0


def _scheduled(ttl: float, schedule_in: float) -> OutboundMessage:
    return OutboundMessage(
        body=b"s",
        message_id="s",
        time_to_live=dt.timedelta(seconds=ttl),
        scheduled_enqueue_time_utc=dt.datetime.fromtimestamp(T0 + schedule_in, dt.UTC),
    )


@pytest.mark.parametrize(("ttl", "moved_after"), [(10, 5), (10, 89), (3600, 30)])
def test_a_message_moved_before_its_schedule_expires_at_schedule_plus_ttl(
    ttl: float, moved_after: float
) -> None:
    stored = rewrite(_scheduled(ttl, schedule_in=90), "orders", accepted_at=T0)
    back = restore(stored, now=T0 + moved_after)
    assert back is not None and not back.expired
    m = back.message
    assert m.scheduled_enqueue_time_utc is not None and m.time_to_live is not None
    expires = m.scheduled_enqueue_time_utc.timestamp() + m.time_to_live.total_seconds()
    assert m.scheduled_enqueue_time_utc.timestamp() == T0 + 90
    assert expires == T0 + 90 + ttl, "expires home at the original schedule + TTL"


def test_a_message_moved_after_its_schedule_goes_home_unscheduled_with_what_is_left() -> None:
    stored = rewrite(_scheduled(100, schedule_in=90), "orders", accepted_at=T0)
    back = restore(stored, now=T0 + 150)
    assert back is not None and not back.expired
    assert back.message.scheduled_enqueue_time_utc is None
    assert back.message.time_to_live == dt.timedelta(seconds=40)  # 90 + 100 - 150


def test_a_scheduled_message_that_expires_in_the_backlog_is_dead_lettered(rig: Rig) -> None:
    async def scenario(rig: Rig) -> None:
        r = await rig.replica("r0")
        now = rig.now()
        m = OutboundMessage(
            body=b"s",
            message_id="late",
            time_to_live=dt.timedelta(seconds=10),
            scheduled_enqueue_time_utc=dt.datetime.fromtimestamp(now + 20, dt.UTC),
        )
        r.failover.force_failover(ORDERS)
        await elapse(0.1)
        assert (await r.failover.submit(ORDERS, [m])).route == "backlog"
        await elapse(40)  # past schedule + TTL, still failed over
        r.failover.mark_healthy(ORDERS)
        await until(lambda: any(rig.secondary.dead_letters.values()), within=TIME_TO_HOME)
        assert rig.home_ids() == [] and rig.backlog_ids() == []
        [dead] = [s for q in QUEUES for s in rig.secondary.dead_letters.get(q, [])]
        assert (dead.message.message_id, dead.dead_letter_reason) == ("late", TTL_EXPIRED)
        assert r.syphon is not None and r.syphon.stats.expired == 1

    rig.run(scenario)
