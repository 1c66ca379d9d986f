"""Waiting for a condition without a bare sleep: poll with a deadline, or yield to the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], within: float = 10.0, every: float = 0.01
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
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(every)


async def next_tick(n: int = 1) -> None:
    """Let the event loop run `n` rounds of ready callbacks (not a wait for a condition)."""
    for _ in range(n):
        await asyncio.sleep(0)
