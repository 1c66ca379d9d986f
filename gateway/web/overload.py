"""Shedding overload at the cheapest point that still tells the client.

A gateway in front of a broker must refuse a burst quickly and clearly, so that clients back
off (``Retry-After``) and the autoscaler sees it, instead of every client timing out. In
CPython an HTTP-level 503 still costs a good part of a 201 (parsing is shared), so the caps
act before any of the request's own work:

* **Connections** (``http.max_connections``): at the cap, the process **stops listening**
  (`Listener.pause`), so the kernel refuses new connections at once (a reset: the client's
  ``connect`` fails with "connection refused" within a round trip) at no cost to the event
  loop; it listens again once the count is back to `RESUME_SHARE` of the cap. (A smaller
  listen backlog would not do: a full accept queue makes Linux *drop* SYNs, and the client
  then waits out its SYN retransmits, 1 + 2 + 4 + 8 s, instead of failing fast.) A
  connection accepted over the cap all the same (accepted before the pause took effect) is
  answered ``503 overloaded`` at once (pre-encoded bytes, before its request is read) and
  closed.
* **A loop that is behind** (`MAX_LOOP_LAG`, fastify's under-pressure rule): while the
  event loop's measured delay (`gateway.core.looplag`) is over the bound at two samples in
  a row, the process stops listening the same way, until a sample is under half of it.
  The listener also closes for a moment when connections pile up in the kernel's accept
  queue (`gateway.web.listener.ShedSite`): libuv, under uvloop, accepts one connection a
  turn of the loop, so without these two the excess waits in the accept queue and in SYN
  retransmits, where no cap sees it. While requests have room (`Shedder.has_room`: under
  half the in-progress limit, the loop not behind) the site takes the queue itself, so a
  connection the process can serve is accepted at once rather than reset by a pause.
* **Requests in progress** (``http.max_requests_in_progress``, or the adaptive limit below
  when it is lower): each request is counted as its head is parsed, in the connection's
  ``data_received`` (`gateway.web.shedding`), so a burst of heads parsed in one turn of the
  loop is counted before any of their handlers runs. A head that arrives at the limit is
  refused there, before a request object, a task or a handler exists: when its connection is
  idle and its body already in, pre-encoded ``503 overloaded`` bytes are written at once and
  the connection stays open (the client's next request is read as usual); otherwise (a body
  still arriving, a pipelined request behind another) it is answered ``503`` before its body
  is read or its token checked, and its connection is closed (the unread body is not worth
  reading). This is uvicorn's ``limit_concurrency``, at the cheapest point.
* **The adaptive limit** (with ``limits.adaptive_admission``, docs/admission.md): the
  in-progress limit is the sum of the namespaces' adaptive limits (`gateway.core.limiter`,
  set from the broker's measured latency), floored by Little's law, requests in progress =
  rate x latency: the rate this process completes requests (its recent peak: what it can
  do) times the latency it aims at, `TARGET_LATENCY`, or the namespaces' learned send
  latency times ``adaptive_tolerance`` when the broker is slower than that (so the floor
  rises with the broker's latency and the throughput is kept). The floor keeps a limiter
  that mistakes the gateway's own slowness for the broker's from throttling below what is
  being delivered. Never below `MIN_LIMIT`, never above ``http.max_requests_in_progress``.
  With ``limits.adaptive_latency_goal`` set (off by default), under that ceiling the limit
  **follows the requests' own latency** (head parsed to answer, each window's mean): over
  the goal (or ``adaptive_tolerance`` x the broker's measured latency, when higher) two
  windows in a row, it is cut toward the recent peak rate x the goal, a fifth at most a
  window and never under half the ceiling; near the goal it grows back by a quarter a
  window; far under it, it is the ceiling. Where the gateway's CPU is the bottleneck, the
  requests it admits then wait for it a goal's worth, not a cap's. With adaptive admission
  off the limit is that cap.

Probes, metrics and the admin API are never shed by the request caps (nor counted): a
liveness probe answered 503 under load would have Kubernetes restart a replica that is
merely busy, and an operator must be able to act during an overload. A closed listener
cannot tell them apart (it acts before a request is read), so the probes have a port of
their own (``probe_port``, `gateway.web.probes`) that is never closed: the chart points its
probes there.

The caps count this process; each replica sheds for itself. Shed requests are counted in
``sbgate_http_shed_total{reason}`` and nowhere else (no access line: a flood must not cost
a log line per request). Refusals by the kernel never reach the process: the pauses are
counted instead, ``sbgate_http_listener_pauses_total{reason}`` and
``sbgate_http_listener_paused_seconds_total{reason}`` (reason: connections, loop_lag,
accept_queue), with ``sbgate_http_listening`` 0 while paused.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import orjson

from gateway.errors import Overloaded

ShedReason = Literal["connections", "in_progress", "head_wait"]
SHED_REASONS: Final[tuple[ShedReason, ...]] = ("connections", "in_progress", "head_wait")
# Why the listener stopped listening (a pause is counted under the reason that began it).
PauseReason = Literal["connections", "loop_lag", "accept_queue"]
PAUSE_REASONS: Final[tuple[PauseReason, ...]] = ("connections", "loop_lag", "accept_queue")
OVERLOADED: Final = Overloaded.code
# Never shed, by exact route: the probes, the scrape and the admin API (an operator acting on
# an overloaded replica). Exact, not prefixes: `/metrics/messages` and `/admin/x/messages` are
# the short routes of entities named `metrics` and `admin/x`, and are shed like any send.
EXEMPT_PATHS: Final = frozenset(("/healthz", "/readyz", "/metrics", "/admin/entities"))
_EXEMPT_ADMIN: Final = re.compile(r"/admin/entities/.+/(?:healthy|failover)")


def exempt(path: str) -> bool:
    """Whether a request for `path` is never shed (see `EXEMPT_PATHS`)."""
    return path in EXEMPT_PATHS or (
        path.startswith("/admin/entities/") and _EXEMPT_ADMIN.fullmatch(path) is not None
    )


# The listen backlog: connections the kernel completes before the process accepts them.
LISTEN_BACKLOG: Final = 2048
# The listener pauses while the event loop runs later than this (see the module docstring).
MAX_LOOP_LAG: Final = 0.25
# A paused listener listens again once the connections are a tenth (at least one) under the
# cap: not at the first close, or it would flap (listen, take a burst, pause) at every close.
RESUME_SHARE: Final = 0.9
# The adaptive in-progress limit (Little's law): the completion rate times this latency (half
# the 2xx p99 the overload goals allow), recomputed every `RATE_WINDOW` seconds; the rate is
# the recent peak, decaying by `RATE_DECAY` a window (halved in ~8 s) so a slower period
# lowers it.
TARGET_LATENCY: Final = 0.05
RATE_WINDOW: Final = 0.25
RATE_DECAY: Final = 0.98
# The adaptive limit never goes under this many requests (a burst after an idle spell).
MIN_LIMIT: Final = 32
# The head's own latency (a request's head parsed to its answer), averaged over each
# `RATE_WINDOW`: over this goal two windows in a row (one is a hiccup), the limit is cut
# toward Little's law at the goal (the recent peak completion rate x the goal), at most to
# `MAX_CUT` of itself a window and never under `MIN_SHARE` of the ceiling; within it, the
# limit grows back by `GROWTH` a window; under half of it (or with too few answers to tell)
# it is the ceiling above (the limit without this rule). The goal is raised to `tolerance` x
# the broker's measured latency when that is higher (a slower broker is not the gateway's
# own queueing), and the limit moves with it (Little's law). Off by default: measured, a
# goal of 25 ms halved the median under overload and cost a tenth of the goodput or more
# (docs/admission.md).
LATENCY_GOAL: Final = 0.0  # off: the default of ``limits.adaptive_latency_goal``
MAX_CUT: Final = 0.8
GROWTH: Final = 1.25
# A cut never takes the limit under this share of the ceiling: a latency the limit cannot
# bring down (refusals or another edge's load on the same CPU) must not spiral it down.
MIN_SHARE: Final = 0.5
# A window needs this many answered requests before its mean latency counts.
MIN_LATENCY_SAMPLES: Final = 20


class ListenerStats(Protocol):
    """What the listener reports for the metrics (`gateway.web.listener.ShedSite`)."""

    @property
    def listening(self) -> bool:
        """Whether the listen port accepts connections now."""

    def pauses(self, reason: PauseReason) -> int:
        """Pauses begun for `reason` so far."""

    def paused_seconds(self, reason: PauseReason) -> float:
        """Seconds spent not listening in pauses begun for `reason`, the current one included."""


class Listener(Protocol):
    """The listening socket(s), as the shedder drives them (`gateway.web.listener.ShedSite`)."""

    def pause(self, reason: PauseReason) -> None:
        """Stop listening now: new connections are refused by the kernel."""

    def resume(self) -> None:
        """Listen again (soon: reopening may take a loop turn)."""


@dataclass(frozen=True, slots=True)
class OverloadLimits:
    """The caps (0 turns one off) and the Retry-After the 503s carry."""

    max_connections: int
    max_requests_in_progress: int
    max_head_wait: float
    retry_after: float
    max_loop_lag: float = 0.0  # the listener pauses while the loop runs this late (0: never)
    target_latency: float = TARGET_LATENCY  # the latency an adaptive limit aims at
    tolerance: float = 1.5  # x the namespaces' learned latency, when that is higher
    latency_goal: float = LATENCY_GOAL  # the head's mean latency the limit follows (0: off)


# What the namespaces' limiters tell the head (`Shedder.attach_limit`): their limits' sum,
# the highest learned latency (None until measured), the highest broker floor (0 until then).
LimitSource = tuple[int, float | None, float]


class Shedder:
    """The process's counts of connections and requests in progress, and the decisions.

    Not thread-safe: the event loop's thread alone calls it (from the protocol)."""

    __slots__ = (
        "_clock",
        "_completed",
        "_late_before",
        "_latency_count",
        "_latency_sum",
        "_limits",
        "_listener",
        "_on_shed",
        "_over_goal",
        "_raw_body",
        "_raw_head",
        "_raw_head_kept",
        "_resume_at",
        "_source",
        "_window_end",
        "_window_start",
        "connections",
        "in_progress",
        "lagging",
        "latency",
        "latency_goal",
        "limit",
        "paused",
        "peak_rate",
    )

    def __init__(
        self,
        limits: OverloadLimits,
        on_shed: Callable[[ShedReason], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._on_shed = on_shed or (lambda _reason: None)
        self._clock = clock
        self.connections = 0
        self.in_progress = 0
        # Requests admitted at once now (0: no limit): the cap, or the adaptive limit
        # (`attach_limit`), recomputed every RATE_WINDOW as requests complete.
        self.limit = limits.max_requests_in_progress
        self._source: Callable[[], LimitSource | None] | None = None
        self.peak_rate = 0.0  # requests completed a second: the recent peak
        self._completed = 0
        self._latency_sum = 0.0  # this window's answered requests' head-to-answer seconds
        self._latency_count = 0
        self.latency: float | None = None  # the last window's mean of those (None: too few)
        self.latency_goal = limits.latency_goal  # the last window's goal (raised by the broker)
        self._over_goal = False  # the last window's latency was over its goal
        self._window_start = clock()
        self._window_end = self._window_start + RATE_WINDOW
        self._listener: Listener | None = None
        self.paused = False  # the process is at its connection cap
        self.lagging = False  # the event loop runs later than `max_loop_lag`
        self._late_before = False  # the last sample was over `max_loop_lag`
        cap = limits.max_connections
        self._resume_at = cap - max(1, round(cap * (1 - RESUME_SHARE)))
        self._raw_body = overloaded_body("connections")
        self._raw_head = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Retry-After: %s\r\n"
            b"Connection: close\r\n" % (len(self._raw_body), self.retry_after.encode())
        )
        self._raw_head_kept = b"".join(
            (
                b"HTTP/1.1 503 Service Unavailable\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n" % len(_IN_PROGRESS_BODY),
                b"Retry-After: %s\r\n" % self.retry_after.encode(),
            )
        )

    @property
    def retry_after(self) -> str:
        return str(max(1, round(self._limits.retry_after)))

    def attach(self, listener: Listener) -> None:
        """Pause `listener` while the connections are at the cap (no cap: never)."""
        self._listener = listener

    def connection_opened(self) -> bool:
        """Count a new connection; False (and counted as shed) when it is over the cap. The
        connection that reaches the cap pauses the listener."""
        cap = self._limits.max_connections
        if cap and self.connections >= cap:
            self._on_shed("connections")
            return False
        self.connections += 1
        if cap and self.connections == cap and self._listener is not None and not self.paused:
            self.paused = True
            self._steer()
        return True

    def connection_closed(self) -> None:
        self.connections -= 1
        if self.paused and self.connections <= self._resume_at:
            self.paused = False
            self._steer()

    def loop_sampled(self, late: float) -> None:
        """A sample of the event loop's delay (`gateway.core.looplag`): over `max_loop_lag`
        twice in a row (one late turn is a hiccup: a collection, a start-up), stop
        listening; under half of it, listen again (unless at the connection cap)."""
        bound = self._limits.max_loop_lag
        if not bound or self._listener is None:
            return
        late_before, self._late_before = self._late_before, late > bound
        if late > bound and late_before and not self.lagging:
            self.lagging = True
            self._steer()
        elif late < bound / 2 and self.lagging:
            self.lagging = False
            self._steer()

    def _steer(self) -> None:
        listener = self._listener
        if listener is None:
            return
        if self.paused or self.lagging:
            listener.pause("connections" if self.paused else "loop_lag")
        else:
            listener.resume()

    def attach_limit(self, source: Callable[[], LimitSource | None]) -> None:
        """Set the in-progress limit by Little's law (see the module docstring) from
        `source`: the sum of the namespaces' adaptive limits, the highest of their learned
        latencies (None until measured) and of their broker floors (the fastest recent send,
        0 until measured), or None while no namespace has a limiter."""
        self._source = source
        self.limit = self._compute_limit(self._source())

    def _compute_limit(self, got: LimitSource | None) -> int:
        """The ceiling: the cap, or the namespaces' limits floored by Little's law."""
        cap = self._limits.max_requests_in_progress
        if got is None:
            return cap
        adaptive, baseline, _floor = got
        target = self._limits.target_latency
        if baseline is not None and baseline * self._limits.tolerance > target:
            target = baseline * self._limits.tolerance
        limit = max(MIN_LIMIT, adaptive, int(self.peak_rate * target))
        return min(limit, cap) if cap else limit

    def at_limit(self) -> bool:
        """Whether a request arriving now would be refused (nothing counted)."""
        limit = self.limit
        return bool(limit) and self.in_progress >= limit

    def has_room(self) -> bool:
        """Whether new connections are worth taking at once (`ShedSite`): fewer requests in
        progress than half the limit, and the loop not behind."""
        limit = self.limit
        return not self.lagging and not (limit and self.in_progress * 2 >= limit)

    def refused(self) -> None:
        """A request was refused at the limit before it was parsed: counted as shed."""
        self._on_shed("in_progress")

    def admit_head(self) -> bool:
        """A request whose head was just parsed: counted in progress (True) until `done()`,
        or refused at the limit (False, counted as shed: the caller answers 503)."""
        limit = self.limit
        if limit and self.in_progress >= limit:
            self._on_shed("in_progress")
            return False
        self.in_progress += 1
        return True

    def admitted_at_head(self, waited: float) -> ShedReason | None:
        """A request counted by `admit_head` reaches its handler after `waited` seconds:
        None, or "head_wait" (counted as shed and no longer in progress: the caller answers
        503 and does not call `done()`)."""
        if self._limits.max_head_wait and waited > self._limits.max_head_wait:
            self.in_progress -= 1
            self._on_shed("head_wait")
            return "head_wait"
        return None

    def admit(self, waited: float) -> ShedReason | None:
        """Whether a request not counted at its head (`admit_head`), whose head waited
        `waited` seconds, may run now; when it may, it is counted in progress until
        `done()`."""
        limit = self.limit
        reason: ShedReason | None = None
        if limit and self.in_progress >= limit:
            reason = "in_progress"
        elif self._limits.max_head_wait and waited > self._limits.max_head_wait:
            reason = "head_wait"
        if reason is not None:
            self._on_shed(reason)
            return reason
        self.in_progress += 1
        return None

    def done(self, latency: float | None = None) -> None:
        """An admitted request is answered (`latency`: seconds from its head to its answer)
        or abandoned (None): no longer in progress. Every `RATE_WINDOW` the completion
        rate's peak and the limit are brought up to date."""
        self.in_progress -= 1
        self._completed += 1
        if latency is not None:
            self._latency_sum += latency
            self._latency_count += 1
        now = self._clock()
        if now >= self._window_end:
            elapsed = now - self._window_start
            self.peak_rate = max(self._completed / elapsed, self.peak_rate * RATE_DECAY)
            count = self._latency_count
            self.latency = self._latency_sum / count if count >= MIN_LATENCY_SAMPLES else None
            self._completed = 0
            self._latency_sum = 0.0
            self._latency_count = 0
            self._window_start = now
            self._window_end = now + RATE_WINDOW
            if self._source is not None:
                got = self._source()
                self.limit = self._follow_latency(self._compute_limit(got), got)

    def _follow_latency(self, ceiling: int, got: LimitSource | None) -> int:
        """The limit under `ceiling` that holds the head's mean latency at its goal (see
        `LATENCY_GOAL`): cut toward the recent peak rate x the goal while the latency was
        over it, grown back toward the ceiling while within it."""
        goal = self._limits.latency_goal
        latency = self.latency
        if not goal or got is None:
            return ceiling
        _adaptive, baseline, floor = got
        broker = max(baseline or 0.0, floor)
        goal = max(goal, self._limits.tolerance * broker)
        before, self.latency_goal = self.latency_goal, goal
        over_before, self._over_goal = self._over_goal, latency is not None and latency > goal
        if latency is None or latency <= goal / 2:
            return ceiling  # far within it (or too few answers to tell): the ceiling
        # The same rate at another latency takes proportionally more (or fewer) requests in
        # progress (Little's law): a broker found slower moves the limit with the goal at
        # once, rather than cutting a limit now too low for it.
        current = (self.limit or ceiling) * goal / before
        if self._over_goal and over_before:  # two windows in a row: one is a hiccup
            little = self.peak_rate * goal  # at the recent peak: a cut lowering the rate
            # it is measured by would spiral
            limit = min(current, max(current * MAX_CUT, little, ceiling * MIN_SHARE))
        elif self._over_goal:
            limit = current
        else:
            limit = current * GROWTH
        return max(MIN_LIMIT, min(ceiling, int(limit)))

    def raw_503(self) -> bytes:
        """A complete ``503 overloaded`` response that closes the connection, as bytes."""
        request_id = os.urandom(16).hex().encode()
        return self._raw_head + b"X-Request-Id: " + request_id + b"\r\n\r\n" + self._raw_body

    def raw_503_in_progress(self, *, keep_alive: bool) -> bytes:
        """A complete ``503 overloaded`` response for a request refused at the in-progress
        limit, as bytes: the connection kept open (`keep_alive`) or closed after it."""
        request_id = os.urandom(16).hex().encode()
        return b"".join(
            (
                self._raw_head_kept,
                b"X-Request-Id: ",
                request_id,
                b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n",
                _IN_PROGRESS_BODY,
            )
        )


def overloaded_body(reason: ShedReason) -> bytes:
    return orjson.dumps({"error": OVERLOADED, "message": _MESSAGES[reason]})


_MESSAGES: Final[dict[ShedReason, str]] = {
    "connections": "this replica has too many open connections; retry later",
    "in_progress": "this replica has too many requests in progress; retry later",
    "head_wait": "this replica is behind: the request waited too long to be served; retry later",
}


_IN_PROGRESS_BODY: Final = overloaded_body("in_progress")
