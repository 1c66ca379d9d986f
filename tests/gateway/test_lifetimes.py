"""The task-lifetime kit (`gateway.lifetimes`), tested once: the backoff value, the owned
task set, the bounded stop and close, and the supervised loop's restarts."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from gateway.lifetimes import (
    CANCEL_GRACE,
    Backoff,
    TaskSet,
    close_quietly,
    stop,
    supervised,
)
from tests.support.fakes import Restarts


@pytest.mark.unit
def test_a_backoff_doubles_from_its_first_delay_up_to_its_cap() -> None:
    b = Backoff(0.5, 3.0)
    delays, delay = [], None
    for _ in range(6):
        delay = b.next(delay)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert b.wait(2.0) == 2.0  # no jitter


@pytest.mark.unit
def test_a_jittered_wait_is_at_most_the_delay_and_at_least_its_share() -> None:
    b = Backoff(1.0, 8.0, jitter=0.25)
    waits = [b.wait(4.0) for _ in range(200)]
    assert all(3.0 <= w <= 4.0 for w in waits) and len(set(waits)) > 1


@pytest.mark.unit
@pytest.mark.parametrize(
    "args", [(0.0, 1.0), (2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 2.0, 2.0, 1.0), (-1.0, 1.0)]
)
def test_a_backoff_refuses_what_is_not_one(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="not a backoff"):
        Backoff(*args)


@pytest.mark.unit
async def test_a_task_set_forgets_its_finished_tasks() -> None:
    tasks = TaskSet("test")
    done = [tasks.spawn(asyncio.sleep(0), name=f"t{i}") for i in range(1000)]
    async with asyncio.timeout(5):
        await asyncio.gather(*done)
    assert len(tasks) == 0


@pytest.mark.unit
async def test_a_task_set_logs_a_task_that_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("a bug")

    tasks = TaskSet("owner")
    with caplog.at_level(logging.ERROR, logger="gateway.lifetimes"):
        task = tasks.spawn(fails(), name="failing")
        async with asyncio.timeout(5):
            await asyncio.wait({task})
        await asyncio.sleep(0)  # the done callback
    assert len(tasks) == 0
    assert any("owner: task failing failed" in r.getMessage() for r in caplog.records)


@pytest.mark.unit
async def test_a_task_set_stops_within_its_bound_even_when_a_cancel_is_lost() -> None:
    """A task that swallows its first cancel (as the SDK's code may: gateway/lifetimes/
    closing.py) is cancelled again at the bound; `stop` returns on time either way."""
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)  # the second cancel ends it

    tasks = TaskSet("test")
    tasks.spawn(stubborn(), name="stubborn")
    tasks.spawn(asyncio.sleep(3600), name="plain")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(5):
        left = await tasks.stop(0.05)
    assert left == 0 and swallowed.is_set() and len(tasks) == 0
    assert loop.time() - started < 0.05 + CANCEL_GRACE


@pytest.mark.unit
async def test_finish_lets_a_task_end_and_cancels_only_what_outlives_its_bound() -> None:
    """`finish` is `stop` without the first cancel: a task about to end is not cancelled
    (a connection's hand-over, gateway/accepting.py), one still running at the bound is."""
    release = asyncio.Event()
    ended: list[str] = []

    async def ends_when_released() -> None:
        await release.wait()
        ended.append("released")

    tasks = TaskSet("test")
    tasks.spawn(ends_when_released(), name="ending")
    forever = tasks.spawn(asyncio.sleep(3600), name="forever")
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_soon(release.set)  # after `finish` has begun waiting
    async with asyncio.timeout(5):
        left = await tasks.finish(0.05)
    assert left == 0 and ended == ["released"] and forever.cancelled()


@pytest.mark.unit
async def test_stop_gives_up_on_a_task_that_never_ends(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="gateway.lifetimes"):
        async with asyncio.timeout(5):
            assert await stop([task], 0.01, "owner") == 1
    assert "did not stop in time" in caplog.text
    release.set()
    async with asyncio.timeout(5):
        await task


@pytest.mark.unit
async def test_close_quietly_bounds_a_close_and_keeps_its_failure_quiet() -> None:
    async def hangs() -> None:
        await asyncio.sleep(3600)

    async def fails() -> None:
        raise ConnectionError("the link is gone")

    async with asyncio.timeout(5):
        await close_quietly("closing", hangs(), 0.01)
        await close_quietly("closing", fails(), 1.0)


@pytest.mark.unit
async def test_a_supervised_loop_restarts_after_its_backoff_and_a_return_ends_it() -> None:
    runs: list[float] = []
    loop = asyncio.get_running_loop()

    async def flaky() -> None:
        runs.append(loop.time())
        if len(runs) < 4:
            raise RuntimeError("a bug")

    restarts = Restarts()
    async with asyncio.timeout(5):
        await supervised("test_loop", flaky, restarts, backoff=Backoff(0.01, 0.04))
    assert len(runs) == 4 and restarts.counts["test_loop"] == 3
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 0.01 and gaps[1] >= 0.02 and gaps[2] >= 0.04
