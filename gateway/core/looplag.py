"""How late this process's event loop runs: the evidence that a timeout was ours.

A send that times out while the loop is stalled (a long synchronous section, or more ready
callbacks than the CPU gets through) may have had its answer waiting in the socket: the
timeout says nothing about the broker. `LoopLag` samples the loop's delay — how late a
callback scheduled every `interval` seconds runs — and answers, for a send that began at
`t`, how long in all the loop ran late since (`lag_since`): one long stall, or many short
ones (a starved loop is late by a little on every turn), counting a stall still under way,
which the sampler cannot have reported yet (its callback is one of those waiting).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable

from gateway.lifetimes import CANCEL_GRACE, stop

# Samples are kept this long: longer than any send or open this replica waits for.
HORIZON = 700.0
# Only delays from this long are kept (a loop keeping up is late by a millisecond or two):
# the history stays small unless the loop really lags.
NOTABLE = 0.01


class LoopLag:
    """The event loop's delay. `start` it in the running loop; `close` stops it. Times are
    the loop's clock (`loop.time()`, monotonic)."""

    def __init__(self, interval: float = 0.1, on_sample: Callable[[float], None] | None = None):
        self._interval = interval
        self._watchers: list[Callable[[float], None]] = [on_sample] if on_sample else []
        self._samples: deque[tuple[float, float]] = deque()  # (woke at, how late)
        self._due: float | None = None  # when the sampler should wake next
        self._task: asyncio.Task[None] | None = None
        self.last = 0.0  # the latest sample, in seconds

    def start(self) -> None:
        self._task = asyncio.create_task(
            self._run(), name="event loop lag", context=contextvars.Context()
        )

    async def close(self) -> None:
        """Stop the sampler (within `CANCEL_GRACE`: it only sleeps)."""
        task, self._task = self._task, None
        if task is not None:
            await stop([task], CANCEL_GRACE, "loop lag")

    def watch(self, on_sample: Callable[[float], None]) -> None:
        """Also call `on_sample(late)` with every sample (seconds)."""
        self._watchers.append(on_sample)

    def lag_since(self, t: float) -> float:
        """How long in all the loop ran late between `t` and now, in seconds (delays under
        `NOTABLE` left out)."""
        now = asyncio.get_running_loop().time()
        total = max(now - self._due, 0.0) if self._due is not None else 0.0
        for woke, late in reversed(self._samples):
            if woke <= t:  # that stall ended before `t`
                break
            total += late
        return total

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self._interval
            await asyncio.sleep(self._interval)
            now = loop.time()
            late = max(now - self._due, 0.0)
            self._due = None
            self.last = late
            if late >= NOTABLE:
                self._samples.append((now, late))
            while self._samples and self._samples[0][0] < now - HORIZON:
                self._samples.popleft()
            for on_sample in self._watchers:
                on_sample(late)
