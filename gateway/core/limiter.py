"""Adaptive concurrency limits toward Service Bus: how many requests a namespace may hold.

A fixed cap is right for one broker latency and wrong for the next: when Service Bus slows
down or throttles, requests queue until their deadline instead of being refused at once, and
when it is fast the cap wastes capacity. `GradientLimiter` sets the limit from what it
measures instead, as Netflix's concurrency-limits Gradient2 and Envoy's adaptive concurrency
filter do:

* every settled request gives a **latency sample** (admission to settlement: the broker's
  round trip and the queueing in front of it); samples are averaged over a short window
  (``window`` seconds, at least ``min_samples``);
* the **baseline** is the broker's round trip without our own queueing: an exponential
  average, over about ``baseline_windows`` windows, of each window's *least* sample (the
  request that queued least), pulled down quickly when that falls far below it (a recovery
  must not wait for the average to forget the slow period). Not the windows' means: those
  hold the queueing the limit itself causes, and a baseline learning it raises the latency
  aimed at, which raises the limit, which raises the queueing;
* at each window's end the limit moves by the **gradient** ``clamp(goal / latency, 0.5,
  2)``, where the goal is the latency budget ``target_latency`` or ``tolerance * baseline``
  (or the broker floor's, below) when the broker is slower than that:
  ``limit * gradient + sqrt(limit)``, smoothed (a
  fifth of the way). A latency within the goal grows the limit (at most by a fifth a
  window), one above it shrinks it (at most by a tenth): held against a saturated resource,
  where latency = limit / throughput, the limit settles where the latency is the goal, the
  throughput times the goal (Little's law). A latency within the budget is never a reason
  to refuse: measured, a gradient against 1.5x the baseline (a few ms) took bursts that
  queued 30-50 ms in the gateway's CPU for the broker slowing, and refused 86 % of a load
  of half what the gateway sustains (docs/performance-results.md). A
  namespace that did not use half its limit in the window (it learned nothing about how
  far it may grow) may only see its limit fall;
* a **floor from Little's law**: the limit never goes below the namespace's recent peak
  delivery rate (requests stored a second, decaying by ``rate_decay`` a window) times
  ``target_latency``: what it takes to keep storing at that rate with that latency (a
  push-back resets the peak to the rate of its window). A
  gateway short of CPU runs every await late, which the gradient may take for the broker
  slowing down; the floor keeps it from throttling below what the namespace is storing;
* a **broker floor** under the goal: the broker's own round trip. The limiter is told
  each successful *send*'s time (a batch's send alone: no queueing in the gateway, the
  loop's lag left out); the goal is never below ``tolerance`` times the fastest send of the
  last ``rtt_windows`` windows, up to twice the budget (the 2xx p99 the overload goals
  allow). When even that send is slower than the budget, no request can settle within it:
  without the floor the limit fell toward its minimum until the baseline (which averages
  over ~10 s) had learned the slower broker (measured: 1,059 to 61 when the round trip
  went from 5 to 50 ms). The fastest send queues least, and none of the gateway's own
  queueing is in it: only a broker slower for every send raises the floor, and one fast
  send lowers it again. Past twice the budget the broker is in trouble, not just farther:
  the limit is cut as before, until the baseline has learned the new round trip;
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

# The gradient's bounds: at most halve the limit per window, at most double it.
_MIN_GRADIENT = 0.5
_MAX_GRADIENT = 2.0
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
    target_latency: float = 0.05  # the latency budget the gradient aims at; Little's floor:
    # peak delivery rate x this (0: no budget, no floor)
    rate_decay: float = 0.95  # the peak rate's share kept each window (halved in ~1.4 s)
    rtt_windows: int = 3  # windows whose fastest send is the broker floor (0: no floor)


class GradientLimiter:
    """One namespace's concurrency limit; see the module docstring. Not thread-safe: used
    from the event loop only."""

    __slots__ = (
        "_clock",
        "_config",
        "_dropped",
        "_floor",
        "_limit",
        "_min",
        "_peak",
        "_rtt",
        "_rtts",
        "_samples",
        "_started",
        "_stored",
        "_sum",
        "baseline",
        "broker_floor",
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
        self._min = math.inf  # the window's lowest sample: the least queued round trip
        self._peak = 0  # the most requests in flight during this window
        self._dropped = False
        self._stored = 0  # requests stored during this window (every latency sample)
        self.peak_rate = 0.0  # requests stored a second: the recent peak (Little's floor)
        self._floor = 0  # peak_rate x target_latency; kept apart so the gradient's own limit
        # (which the idle rule compares the in-flight peak with) is not raised by it
        self._rtt = math.inf  # the window's fastest send (the broker's round trip)
        self._rtts: list[float] = []  # the last rtt_windows windows' fastest sends
        self.broker_floor = 0.0  # seconds: the fastest of those (0 until rtt_windows)

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
            if latency < self._min:
                self._min = latency
            self._stored += 1
        self._maybe_update()

    def observe_send(self, seconds: float) -> None:
        """A send to the broker succeeded in `seconds` (the send alone: the broker floor)."""
        if seconds < self._rtt:
            self._rtt = seconds

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
        if cfg.rtt_windows and self._rtt < math.inf:
            self._rtts.append(self._rtt)
            del self._rtts[: -cfg.rtt_windows]
            if len(self._rtts) == cfg.rtt_windows:
                self.broker_floor = min(self._rtts)
        self._rtt = math.inf
        if self._dropped:
            self._limit = max(cfg.minimum, self._limit * cfg.backoff)
        else:
            self._adjust(self._sum / self._samples, self._min)
        self._floor = int(min(float(cfg.maximum), self.peak_rate * cfg.target_latency))
        self._started = now
        self._stored = 0
        self._samples = 0
        self._sum = 0.0
        self._min = math.inf
        self._peak = self.in_flight
        self._dropped = False

    def _adjust(self, latency: float, least: float) -> None:
        """A window's mean `latency` moves the limit; its `least` sample (the request that
        queued least: the round trip) moves the baseline."""
        cfg = self._config
        self.last_latency = latency
        if self.baseline is None:
            self.baseline = least
        else:
            alpha = 2.0 / (cfg.baseline_windows + 1)
            self.baseline += alpha * (least - self.baseline)
            if least > 0 and self.baseline / least > _RECOVERY_RATIO:
                self.baseline *= _RECOVERY_DECAY
        # The latency aimed at: the budget, or the learned latency's tolerance when the
        # broker is slower than that (a latency within the budget is no reason to refuse).
        floor = min(cfg.tolerance * self.broker_floor, 2 * cfg.target_latency)
        goal = max(cfg.tolerance * self.baseline, cfg.target_latency, floor)
        ratio = goal / latency if latency > 0 else _MAX_GRADIENT
        gradient = min(_MAX_GRADIENT, max(_MIN_GRADIENT, ratio))
        target = self._limit * gradient + math.sqrt(self._limit)
        limit = self._limit * (1 - cfg.smoothing) + target * cfg.smoothing
        if limit >= self._limit and self._peak < self._limit / 2:
            return  # it did not use its limit: nothing learned about how far it may grow
        self._limit = min(float(cfg.maximum), max(float(cfg.minimum), limit))
