"""Waiting in tests without a bare sleep or a timed assertion.

* `eventually` polls a condition with a deadline;
* `no_hang` fails a block that never finishes — a liveness check, not a timing one;
* `next_tick` yields to the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

# How long `no_hang` lets a block run: many times any deadline a test configures (those are
# at most a few seconds), so a loaded machine cannot trip it, but a missing deadline does.
HANG_GUARD = 30.0


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]],
    within: float = 10.0,
    every: float = 0.01,
    what: str = "",
) -> None:
    """Return as soon as `predicate()` is true; fail the test after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s: {what or predicate}")
        await asyncio.sleep(every)


@asynccontextmanager
async def no_hang(what: str, guard: float = HANG_GUARD) -> AsyncIterator[None]:
    """Fail the test if the block is still running after `guard` seconds.

    Use it where the property under test is "our own deadline ends this wait": without the
    deadline the block would wait forever (a hanging broker, a paused Redis, a stuck sink),
    so finishing at all is the evidence. How fast it finished is for `bench/` to measure."""
    cm = asyncio.timeout(guard)
    try:
        async with cm:
            yield
    except TimeoutError:
        if cm.expired():
            raise AssertionError(f"{what}: still waiting after {guard}s (no deadline?)") from None
        raise


async def next_tick(n: int = 1) -> None:
    """Let the event loop run `n` rounds of ready callbacks (not a wait for a condition)."""
    for _ in range(n):
        await asyncio.sleep(0)
