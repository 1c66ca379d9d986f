"""Capped exponential backoff, as a value (as redis-py expresses it).

A `Backoff` says how long to wait after a failure: `next(None)` is the first delay, and
`next(previous)` the one after `previous` (`factor` times longer, at most `cap`). Whoever
retries keeps the last delay it waited (None again once a try succeeded), so one value
serves a loop's restarts, a reconnect loop and a table of per-queue retry timers alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    first: float
    cap: float
    factor: float = 2.0
    # Each wait is scaled by a uniform factor in [1 - jitter, 1], so that replicas retrying
    # the same server do not all come back at once (0: no jitter).
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.first <= self.cap and self.factor >= 1 and 0 <= self.jitter < 1):
            raise ValueError(f"not a backoff: {self!r}")

    def next(self, previous: float | None) -> float:
        """The delay after `previous` (None: the first failure), before jitter."""
        return self.first if previous is None else min(self.cap, previous * self.factor)

    def wait(self, delay: float) -> float:
        """How long to actually wait for `delay`: jittered."""
        if not self.jitter:
            return delay
        return delay * random.uniform(1 - self.jitter, 1.0)  # noqa: S311  # jitter, not security
