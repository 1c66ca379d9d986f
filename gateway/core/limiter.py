"""Adaptive concurrency limits toward Service Bus: how many requests a namespace may hold.

A fixed cap is right for one broker latency and wrong for the next: when Service Bus slows
down or throttles, requests queue until their deadline instead of being refused at once, and
when it is fast the cap wastes capacity. `GradientLimiter` sets the limit from what it
measures instead, as Netflix's concurrency-limits Gradient2 and Envoy's adaptive concurrency
filter do:

* every settled request gives a **latency sample** (admission to settlement: the broker's
  round trip and the queueing in front of it); samples are averaged over a short window
  (``window`` seconds, at least ``min_samples``);
* the **baseline** is learned from live traffic: an exponential average of the windows'
  latencies over about ``baseline_windows`` windows, pulled down quickly when latency falls
  far below it (a recovery must not wait for the average to forget the slow period);
* at each window's end, when the namespace used at least half its limit (an idle namespace
  learns nothing about its capacity), the limit moves by the **gradient**
  ``clamp(tolerance * baseline / latency, 0.5, 1)``: ``limit * gradient + sqrt(limit)``,
  smoothed. Latency within ``tolerance`` of the baseline grows the limit by about its square
  root; latency far above it shrinks the limit by up to half;
* a **floor from Little's law**: the limit never goes below the namespace's recent peak
  delivery rate (requests stored a second, decaying by ``rate_decay`` a window) times
  ``target_latency``: what it takes to keep storing at that rate with that latency (a
  push-back resets the peak to the rate of its window). A
  gateway short of CPU runs every await late, which the gradient may take for the broker
  slowing down; the floor keeps it from throttling below what the namespace is storing;
* a **drop** — the broker said it is busy, a timeout, a quota error, or a request that found
  no sender free by its admission deadline — cuts the limit at once by ``backoff``
  (multiplicative decrease), at most once per window so one failed batch of many requests is
  one cut.

`try_acquire` is the admission decision: at the limit, the request is refused at once (the
caller answers 503 with Retry-After) — nothing waits for a slot. The limiter is plain
synchronous logic on an injected clock, so its tests need no event loop and no sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# The gradient's bounds: at most halve the limit per window, never grow it from a gradient.
_MIN_GRADIENT = 0.5
_MAX_GRADIENT = 1.0
# Latency this far below the baseline means the slow period is over: forget it faster.
_RECOVERY_RATIO = 2.0
_RECOVERY_DECAY = 0.95


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    """The limiter's settings (from `LimitSettings`'s ``adaptive_*`` fields)."""

    initial: int = 256  # the limit before anything is measured
    minimum: int = 8  # never below: a namespace keeps some concurrency to learn from
    maximum: int = 4096
    backoff: float = 0.7  # the limit's share kept on a drop
    tolerance: float = 1.5  # latency up to this x the baseline does not shrink the limit
    smoothing: float = 0.2  # share of each window's new limit taken
    window: float = 0.1  # seconds per measurement window
    min_samples: int = 5  # samples a window needs before it counts
    baseline_windows: int = 100  # windows the baseline averages over (~10 s at 0.1 s)
    target_latency: float = 0.05  # Little's law floor: peak delivery rate x this (0: none)
    rate_decay: float = 0.95  # the peak rate's share kept each window (halved in ~1.4 s)


class GradientLimiter:
    """One namespace's concurrency limit; see the module docstring. Not thread-safe: used
    from the event loop only."""

    __slots__ = (
        "_clock",
        "_config",
        "_dropped",
        "_floor",
        "_limit",
        "_peak",
        "_samples",
        "_started",
        "_stored",
        "_sum",
        "baseline",
        "in_flight",
        "last_latency",
        "peak_rate",
        "refused",
    )

    def __init__(self, config: LimiterConfig, clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self._limit = float(min(max(config.initial, config.minimum), config.maximum))
        self.in_flight = 0
        self.refused = 0  # requests refused at the limit, ever
        self.baseline: float | None = None  # seconds; None until a window was measured
        self.last_latency: float | None = None  # the last window's mean latency
        self._started = clock()
        self._samples = 0
        self._sum = 0.0
        self._peak = 0  # the most requests in flight during this window
        self._dropped = False
        self._stored = 0  # requests stored during this window (every latency sample)
        self.peak_rate = 0.0  # requests stored a second: the recent peak (Little's floor)
        self._floor = 0  # peak_rate x target_latency; kept apart so the gradient's own limit
        # (which the idle rule compares the in-flight peak with) is not raised by it

    @property
    def limit(self) -> int:
        """Requests this namespace may hold now: the gradient's limit, or Little's floor
        when that is higher."""
        limit = int(self._limit)
        return limit if limit >= self._floor else self._floor

    @property
    def config(self) -> LimiterConfig:
        return self._config

    def try_acquire(self) -> bool:
        """Admit one request (True), or refuse it at the limit (False, counted)."""
        if self.in_flight >= self.limit:
            self.refused += 1
            return False
        self.in_flight += 1
        if self.in_flight > self._peak:
            self._peak = self.in_flight
        return True

    def release(self, latency: float | None = None, *, dropped: bool = False) -> None:
        """One admitted request settled: `latency` (seconds) when it was stored, `dropped`
        when the broker pushed back (busy, timeout, quota, no sender in time); neither for
        outcomes that say nothing about the broker's capacity (a refused message, shutdown)."""
        self.in_flight -= 1
        if dropped:
            self._dropped = True
        elif latency is not None:
            self._samples += 1
            self._sum += latency
            self._stored += 1
        self._maybe_update()

    def _maybe_update(self) -> None:
        now = self._clock()
        cfg = self._config
        if now - self._started < cfg.window:
            return
        if not self._dropped and self._samples < cfg.min_samples:
            return  # too few samples yet: keep the window open
        rate = self._stored / (now - self._started)
        # A push-back says the namespace takes no more than it stores now: the peak is that.
        self.peak_rate = rate if self._dropped else max(rate, self.peak_rate * cfg.rate_decay)
        if self._dropped:
            self._limit = max(cfg.minimum, self._limit * cfg.backoff)
        else:
            self._adjust(self._sum / self._samples)
        self._floor = int(min(float(cfg.maximum), self.peak_rate * cfg.target_latency))
        self._started = now
        self._stored = 0
        self._samples = 0
        self._sum = 0.0
        self._peak = self.in_flight
        self._dropped = False

    def _adjust(self, latency: float) -> None:
        cfg = self._config
        self.last_latency = latency
        if self.baseline is None:
            self.baseline = latency
        else:
            alpha = 2.0 / (cfg.baseline_windows + 1)
            self.baseline += alpha * (latency - self.baseline)
            if self.baseline / latency > _RECOVERY_RATIO:
                self.baseline *= _RECOVERY_DECAY
        if self._peak < self._limit / 2:
            return  # the namespace did not use its limit: nothing learned about capacity
        gradient = min(_MAX_GRADIENT, max(_MIN_GRADIENT, cfg.tolerance * self.baseline / latency))
        target = self._limit * gradient + math.sqrt(self._limit)
        limit = self._limit * (1 - cfg.smoothing) + target * cfg.smoothing
        self._limit = min(float(cfg.maximum), max(float(cfg.minimum), limit))
