"""Only the broker's failures count toward failover.

* A send timeout while this replica's event loop was stalled is ours, not the broker's: a
  healthy entity stays healthy (on virtual time, the loop stalled longer than `send_timeout`
  while a send waits for its answer; against the local broker, the loop blocked by
  synchronous sections while a send is in flight).
* A failure reported by a send that began before the entity's last success is stale: it
  never flips a healthy entity back to failing (the failover logic on virtual time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from gateway.core.looplag import LoopLag
from gateway.errors import FailureKind, SendFailure
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_failover import FAILOVER, entity_state
from tests.support.failover_rig import FAILOVER as FAILOVER_SETTINGS
from tests.support.failover_rig import ORDERS, TIMEOUTS, Replica, messages
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import FakeRedis
from tests.support.virtual_time import VirtualTimeLoop, elapse, until

SEND_TIMEOUT = 1.0


def block_the_loop(seconds: float) -> None:
    """A synchronous section: nothing else runs on the loop meanwhile (the fault injected,
    not a wait)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def starve(seconds: float, turn: float) -> None:
    """Starve the loop for `seconds`: each turn of the loop, a synchronous section of `turn`
    seconds (as when it has more ready callbacks than the CPU gets through)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        block_the_loop(turn)
        await asyncio.sleep(0)


@pytest.mark.parametrize("turn", [2 * SEND_TIMEOUT, 0.3], ids=["one stall", "a starved loop"])
async def test_a_starved_loop_does_not_fail_a_healthy_entity_over(
    gateway: GatewayFactory, control: ControlClient, turn: float
):
    gw = await gateway(
        {
            **FAILOVER,  # failover_interval 0: the first failure that counts fails over
            "SBGATE_SEND_TIMEOUT": str(SEND_TIMEOUT),
            "SBGATE_SDK_RETRY_TOTAL": "0",
            "SBGATE_LOOP_LAG_TOLERANCE": "0.25",
        }
    )
    assert (await gw.post("/orders/messages", data=b"warm")).status == 201
    await control.set_latency("primary", round_trip_ms=50, store_ms=0)
    post = asyncio.create_task(gw.post("/orders/messages", data=b"x"))
    await starve(3 * SEND_TIMEOUT, turn)
    resp = await post
    assert (await entity_state(gw))["state"] == "healthy", "our own stall is not the broker's"
    assert resp.status in (201, 503), "answered, not sent to a backlog"
    await control.set_latency("primary", round_trip_ms=0, store_ms=0)
    assert (await gw.post("/orders/messages", data=b"y")).status == 201
    metrics = await (await gw.get("/metrics")).text()
    assert "sbgate_event_loop_lag_seconds" in metrics


def on_virtual_time(scenario: Callable[[VirtualTimeLoop], Coroutine[Any, Any, None]]) -> None:
    loop = VirtualTimeLoop()
    try:
        loop.run(scenario(loop))
    finally:
        loop.close()


@asynccontextmanager
async def one_replica(**kwargs: Any) -> AsyncIterator[tuple[Replica, FakeNamespace]]:
    """A replica (no syphon) and its primary namespace, on the running (virtual) loop."""
    primary, secondary = FakeNamespace("primary"), FakeNamespace("secondary")
    replica = Replica("r0", FakeRedis(), primary, secondary, syphon=False, **kwargs)
    await replica.start()
    try:
        yield replica, primary
    finally:
        primary.hold = primary.down = False
        await replica.stop()


def test_a_timeout_while_the_loop_stalled_does_not_count():
    """The stall on virtual time: a send in flight, then a synchronous section longer than
    `send_timeout`; the send's deadline passes during it."""

    async def scenario(loop: VirtualTimeLoop) -> None:
        lag = LoopLag()
        lag.start()
        settings = replace(FAILOVER_SETTINGS, failover_interval=0.0)
        async with one_replica(failover=settings, loop_lag=lag) as (replica, primary):
            primary.hold = True  # the broker has not answered yet
            request = asyncio.create_task(replica.failover.submit(ORDERS, messages("m")))
            await until(lambda: len(primary.held) == 1, within=1)
            loop._now += 2 * TIMEOUTS.send_timeout  # the loop stalls; time goes on
            with pytest.raises(SendFailure) as info:
                await request
            assert info.value.kind is FailureKind.TIMEOUT
            assert replica.status() == "healthy", "our own stall failed the entity over"
            # Without a stall, a timeout counts as before.
            late = asyncio.create_task(replica.failover.submit(ORDERS, messages("n")))
            await until(lambda: late.done(), within=2 * TIMEOUTS.send_timeout)
            assert late.result().route == "backlog" and replica.status() == "failed_over"
        await lag.close()

    on_virtual_time(scenario)


def test_a_failure_of_a_send_that_began_before_the_last_success_never_counts():
    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary):
            primary.hold = True
            early = asyncio.create_task(replica.failover.submit(ORDERS, messages("early")))
            await until(lambda: len(primary.held) == 1, within=1)
            primary.hold = False
            delivery = await replica.failover.submit(ORDERS, messages("later"))
            assert delivery.route == "primary"
            primary.down = True  # the early send fails after the later one succeeded
            primary.release()
            with pytest.raises(SendFailure):
                await early  # answered as it is (503): not the broker's failure now
            primary.down = False
            assert replica.status() == "healthy", "a stale report flipped the entity"
            # A failure of a send that begins after the success counts as before.
            primary.down = True
            late = await replica.failover.submit(ORDERS, messages("late"))
            assert late.route == "backlog" and replica.status() == "failing"

    on_virtual_time(scenario)


def test_the_loop_lag_counts_a_stall_still_under_way():
    async def scenario(loop: VirtualTimeLoop) -> None:
        lag = LoopLag(interval=0.1)
        lag.start()
        try:
            await elapse(1.0)
            since = loop.time()
            assert lag.lag_since(since) == 0.0
            loop._now += 5.0  # a synchronous section of 5 s, as the loop's clock sees it
            assert lag.lag_since(since) >= 4.8, "under way, not yet sampled"
            await elapse(0.2)
            assert lag.lag_since(since) >= 4.8, "sampled"
            for _ in range(10):  # a starved loop: late by a little on every turn
                await elapse(0.1)
                loop._now += 0.2
            assert lag.lag_since(since) >= 4.8 + 1.8, "many short stalls add up"
            await elapse(1.0)
            assert lag.lag_since(loop.time()) == 0.0, "over"
        finally:
            await lag.close()

    on_virtual_time(scenario)


def test_the_primarys_routes_are_made_once_per_entity_and_bounded(monkeypatch):
    """`Failover` keeps each entity's route to the primary (its destination and the answer of
    a send stored there) instead of making them per request; the cache starts over when
    full, and a route made again sends the same way."""
    from gateway.core import failover as failover_module

    monkeypatch.setattr(failover_module, "_PRIMARY_ROUTES", 2)
    entities = [replace(ORDERS, path=f"orders-{i}") for i in range(3)]

    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary):
            first = await replica.failover.submit(entities[0], messages("a"))
            again = await replica.failover.submit(entities[0], messages("b"))
            assert first is again and (first.route, first.destination) == ("primary", "orders-0")
            for i, entity in enumerate(entities[1:], 1):
                done = await replica.failover.submit(entity, messages(f"c{i}"))
                assert (done.route, done.destination) == ("primary", f"orders-{i}")
                assert len(replica.failover._primary) <= 2
            back = await replica.failover.submit(entities[0], messages("d"))
            assert (back.route, back.destination) == ("primary", "orders-0")
            stored = {path: primary.ids(path) for path in ("orders-0", "orders-1", "orders-2")}
            assert stored == {"orders-0": ["a", "b", "d"], "orders-1": ["c1"], "orders-2": ["c2"]}

    on_virtual_time(scenario)
