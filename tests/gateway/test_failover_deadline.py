"""One deadline per request across its attempts (the primary, then backlog queues).

On virtual time with the namespaces at their ports: a request's attempts together take at
most `request_budget` (`admission_timeout` + `send_timeout`) from when it reached the
router, so a request whose primary attempt used most of it gets only the rest for the
backlog, and one whose primary used all of it is answered without a backlog attempt.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.core.failover import request_budget
from gateway.errors import FailureKind, NoBacklogAvailable, SendFailure
from tests.gateway.test_failover_accounting import on_virtual_time
from tests.support.failover_rig import LIMITS, ORDERS, TIMEOUTS, Replica, messages
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import FakeRedis
from tests.support.virtual_time import VirtualTimeLoop, elapse, until

BUDGET = request_budget(LIMITS, TIMEOUTS)
PRIMARY_TOOK = BUDGET - 3.0  # most of the budget: 3 s are left for the backlog


@asynccontextmanager
async def one_replica() -> AsyncIterator[tuple[Replica, FakeNamespace, FakeNamespace]]:
    primary, secondary = FakeNamespace("primary"), FakeNamespace("secondary")
    replica = Replica("r0", FakeRedis(), primary, secondary, syphon=False)
    await replica.start()
    try:
        yield replica, primary, secondary
    finally:
        for ns in (primary, secondary):
            ns.hold = ns.down = False
            ns.release()
        await replica.stop()


async def fail_primary_after(
    replica: Replica, primary: FakeNamespace, seconds: float
) -> tuple[asyncio.Task[Any], float]:
    """Submit a request whose primary send fails (counting toward failover) after
    `seconds`; returns its task and when it was submitted."""
    loop = asyncio.get_running_loop()
    primary.hold = True
    start = loop.time()
    task = asyncio.create_task(replica.failover.submit(ORDERS, messages("m")))
    await until(lambda: len(primary.held) == 1, within=1)
    await elapse(seconds - (loop.time() - start))
    primary.down = True
    primary.release()
    return task, start


def test_the_budget_is_one_admission_wait_and_one_send():
    assert BUDGET == LIMITS.admission_timeout + TIMEOUTS.send_timeout
    assert PRIMARY_TOOK < TIMEOUTS.send_timeout, "the primary's failure is its own, not ours"


def test_a_backlog_attempt_gets_only_what_the_primary_left():
    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary, secondary):
            secondary.hold = True  # the backlog queue does not answer
            request, start = await fail_primary_after(replica, primary, PRIMARY_TOOK)
            await until(lambda: len(secondary.held) == 1, within=1)
            with pytest.raises(NoBacklogAvailable) as info:
                await request
            took = loop.time() - start
            assert took <= BUDGET + 0.01, f"answered after {took:g}s, over the {BUDGET:g}s budget"
            assert took >= BUDGET - 0.01, "the backlog got less than what was left"
            assert info.value.status == 503 and info.value.retry_after
            assert replica.status() == "failing"

    on_virtual_time(scenario)


def test_a_backlog_attempt_within_what_is_left_is_delivered():
    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary, secondary):
            secondary.hold = True
            request, start = await fail_primary_after(replica, primary, PRIMARY_TOOK)
            await until(lambda: len(secondary.held) == 1, within=1)
            await elapse(2.0)  # less than the 3 s left
            secondary.release()
            delivery = await request
            assert delivery.route == "backlog"
            assert loop.time() - start <= BUDGET
            assert sum(len(q) for q in secondary.entities.values()) == 1

    on_virtual_time(scenario)


def test_a_primary_that_used_the_whole_budget_is_answered_without_a_backlog_attempt():
    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary, secondary):
            primary.hold = True
            start = loop.time()
            request = asyncio.create_task(replica.failover.submit(ORDERS, messages("m")))
            await until(lambda: len(primary.held) == 1, within=1)
            loop._now += BUDGET + 1.0  # the primary's send outlives the whole budget
            with pytest.raises(SendFailure) as info:
                await request
            assert info.value.kind is FailureKind.TIMEOUT
            assert loop.time() - start >= BUDGET
            assert not secondary.held and not secondary.entities, "a backlog was tried"
            assert replica.status() == "failing", "the primary's failure still counts"

    on_virtual_time(scenario)


def test_a_failed_request_leaves_no_cycle_behind():
    """A broker failure, raised in a sender worker's frame, holds that frame in its traceback,
    and the frame holds the requests' groups, whose futures hold the failure: a cycle per
    failed request, only freed by the cycle collector (with all the request's memory, which
    RSS keeps at its high-water mark). The router drops the traceback when it catches one."""

    async def scenario(loop: VirtualTimeLoop) -> None:
        async with one_replica() as (replica, primary, secondary):
            primary.down = secondary.down = True
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for i in range(3):
                    with pytest.raises((SendFailure, NoBacklogAvailable)):
                        await replica.failover.submit(ORDERS, messages(f"m{i}"))
                gc.collect()
                left = [type(o).__name__ for o in gc.garbage]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert "_Group" not in left and "OutboundMessage" not in left, sorted(set(left))

    on_virtual_time(scenario)
