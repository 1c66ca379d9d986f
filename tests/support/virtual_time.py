"""An asyncio event loop on virtual time, for deterministic tests of timing logic.

Whenever the loop would block waiting for its next timer, it jumps its clock to that timer
instead: `asyncio.sleep`, `asyncio.timeout`, `call_later` — everything built on
`loop.time()` — runs in order, without real waiting. Callbacks ready at the same instant
run in the order they were scheduled, so a run is reproducible. Real sockets still work
(they are polled without blocking), but a test on virtual time should keep to fakes at
ports: anything that waits on the outside world would see time fly.

`loop.time()` starts at `start` (a wall-clock-like value, so code that turns it into a
datetime keeps working) and is what the code under test must use as its clock.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

DEFAULT_START = 1_800_000_000.0  # 2027-01-15: any wall-clock-like instant will do


class Deadlock(RuntimeError):
    """The loop had nothing ready and nothing scheduled: it would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._vloop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)  # real file descriptors (the loop's self-pipe) never wait
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Deadlock("nothing is ready and no timer is scheduled")
        self._vloop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """See the module docstring."""

    def __init__(self, start: float = DEFAULT_START) -> None:
        self._now = start
        super().__init__(selector=_VirtualSelector(self))
        # At ~1.8e9 s a float's step is ~2.4e-7 s: a timer due "one step later" must count
        # as due now, or the loop would spin on it forever.
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        target = self._now + max(seconds, 0.0)
        if self._scheduled:  # land exactly on the timer that ended the wait
            target = max(target, self._scheduled[0].when())
        self._now = target

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` to completion on virtual time."""
        return self.run_until_complete(coro)

    def settle(self, seconds: float = 0.0) -> None:
        """Let virtual time pass by `seconds` (0: just run what is ready now)."""
        self.run_until_complete(asyncio.sleep(seconds))


async def elapse(seconds: float) -> None:
    """Let `seconds` of virtual time pass: every timer due meanwhile fires, in order, at once.

    The scenario's clock moving on, not a wait for a condition (for that: `until`)."""
    assert isinstance(asyncio.get_running_loop(), VirtualTimeLoop), "virtual time only"
    await asyncio.sleep(seconds)


async def until(predicate: Callable[[], bool], within: float, step: float = 0.05) -> float:
    """Let virtual time pass in `step`s until `predicate()`; returns how long it took.
    Fails after `within` virtual seconds (deterministic: this is the loop's clock)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < within, f"not within {within} s"
        await elapse(step)
    return loop.time() - start
