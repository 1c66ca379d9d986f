"""Settled, bounded, micro-batched sends: the accumulator and the sender workers.

Layers (as in aiokafka): `Dispatcher.send` (API) → a per-destination `_Lane` (the pending
buffer) → the lane's worker tasks (delivery), each owning one open `Sender`.

* **Cost per entity is what it uses**: a lane, its workers and their senders exist only
  while the destination is sent to. A lane starts with no worker; a request that finds no
  free one (idle, or opening its sender with at most a batch's requests pending: it takes
  them once open) adds one, up to `senders_per_entity` (the lane grows with its load); a worker
  that waited `sender_idle_timeout` for work closes its sender and ends, and the last one
  drops its lane. Open senders are capped across all destinations (`max_open_senders`):
  to open another at the cap, the least recently used idle one is closed.

* **Settled**: `send` returns only when the broker stored every message, or raises.
* **Bounded**: an `AdmissionGate` caps bytes held for pending sends, and a request waits at
  most `admission_timeout` in all for room and then for a worker to take it (else
  `Saturated` → 503, never sent), so a broker that stops answering cannot pile requests up
  behind busy workers; a semaphore caps broker operations in flight across all destinations
  (`max_in_flight`).
* **Micro-batched without a linger timer**: a free worker takes *everything pending* for its
  destination (up to the batch limits) after yielding one event-loop tick, so batches grow
  with load by themselves and a lone request is sent at once. A request wakes one parked
  worker of its lane (`_Wakeup`: the one parked last), and none while the one woken has not
  taken yet; a take that leaves requests pending (over a batch, another session's) wakes
  the next. A request's messages always travel in one broker batch, so a request never
  partially succeeds.
* **Paced**: while one of a lane's batches is in flight, the lane starts the next no sooner
  than its round trip / `senders_per_entity` after the last (the round trip a moving
  average of its sends, the gap at most `MAX_PACE`): its sends spread over the round trip
  instead of leaving together. Unpaced, a lane sends in a cluster: the workers back from
  their sends each take a few requests within a millisecond, all of them are then busy, and
  what arrives waits for the cluster's return, up to a whole round trip (measured in
  process, a 50 ms broker: p50 70 and p99 95 ms, the batch starts in clusters a round trip
  apart; paced, 54 and 58 ms: `bench.pacing_bench`). A lone request (nothing in flight) is
  still sent at once.
* **Isolated**: a batch the broker refuses because of one message (`message_fault` in the
  error table) is bisected between requests, so only the offending request gets the 4xx
  (`_isolate`, bounded by `split_budget`).
* **Owned**: every worker task belongs to the dispatcher, which cancels and awaits it in
  `close()`; a worker never dies from a send error.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.admission import AdmissionGate
from gateway.core.limiter import GradientLimiter, LimiterConfig
from gateway.core.looplag import LoopLag
from gateway.core.message import OutboundMessage, envelope_size
from gateway.core.ports import NamespaceClient, Sender, Tracer
from gateway.errors import (
    SHUTDOWN,
    TIMEOUT,
    UNKNOWN,
    Draining,
    FailureKind,
    GatewayError,
    Saturated,
    SendFailure,
)
from gateway.lifetimes import CANCEL_GRACE, close_quietly, stop

log = logging.getLogger(__name__)

# With tracing on, an admission wait at least this long is an event on the request's span.
ADMISSION_WAIT_TRACED = 0.001
# Our deadline on closing one sender; a stopped worker closes its own.
SENDER_CLOSE_TIMEOUT = 5.0
# The broker pushing back: the adaptive limit is cut (gateway.core.limiter).
_PUSHBACK = frozenset({FailureKind.SERVER_BUSY, FailureKind.TIMEOUT, FailureKind.QUOTA_EXCEEDED})
# Pacing (the module docstring): the gap between a lane's send starts is its round trip /
# senders_per_entity, at most this (a broker slower than 8 x this is paced over part of it),
# the round trip an exponential average of its sends taking this share of each.
MAX_PACE = 0.0125
# A gap under this is not paced: the event loop's timers have a millisecond's resolution, so a
# shorter wait would be a millisecond all the same (a broker that fast clusters its sends
# within its round trip, a few ms, which pacing would not beat).
MIN_PACE = 0.001
_RTT_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a lane sends: an entity path in one namespace."""

    client: NamespaceClient
    path: str
    # Its lane's key: the namespace and the path in lower case (Service Bus's names are
    # case-insensitive). Computed once: a router keeps one per entity (gateway.core.failover).
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.client.name, self.path.lower()))

    def __str__(self) -> str:
        return f"{self.client.name}/{self.path}"


class _Group:
    """The messages of one request: sent together, settled together. A plain slotted class,
    not a dataclass: one is made per request, on the hot path."""

    __slots__ = ("batch_key", "deadline", "future", "messages", "size", "trace")

    def __init__(
        self,
        messages: Sequence[OutboundMessage],
        size: int,
        future: asyncio.Future[None],
        deadline: float,  # loop time by which a worker must have taken it (else: Saturated)
        trace: object | None = None,  # the sender's span context (tracing on), linked to the batch
    ) -> None:
        self.messages = messages
        self.size = size
        self.future = future
        self.deadline = deadline
        self.trace = trace
        self.batch_key: str | None = messages[0].batch_key if messages else None


def split_budget(requests: int) -> int:
    """The extra sends `_isolate` may make for a refused batch of `requests` requests:
    enough to bisect down to two offenders (2·⌈log2 n⌉ each), and the last two halves."""
    return 4 * math.ceil(math.log2(requests)) + 2 if requests > 1 else 0


class DispatchObserver:
    """Hooks for metrics. The default does nothing."""

    def batch_sent(self, dest: str, messages: int, seconds: float, outcome: str) -> None:
        """One broker operation finished (`outcome` is "ok" or a FailureKind value)."""

    def in_flight(self, delta: int) -> None:
        """Broker operations in flight changed by `delta`."""

    def sender_recreated(self, dest: str) -> None:
        """A suspect sender was closed and will be reopened."""

    def batch_split(self, dest: str) -> None:
        """One extra broker send made to isolate a refused message (`Dispatcher._isolate`)."""

    def task_restarted(self, task: str) -> None:
        """A worker met an unexpected error and ended (the next request starts another)."""

    def limiter_created(self, namespace: str, limiter: GradientLimiter) -> None:
        """A namespace's adaptive limiter exists (its first send); read it at scrape time."""

    def limit_refused(self, namespace: str) -> None:
        """A request was refused at its namespace's adaptive limit."""


class _State(enum.Enum):
    """What a worker is doing: its lane grows, `_expire` refuses and `close` waits by it."""

    STARTING = "starting"  # created, not yet running: it will take what is pending
    IDLE = "idle"  # parked on its lane's `wakeup`
    OPENING = "opening"  # opening its sender, outside the send slots
    PACING = "pacing"  # for its lane's pace, before a send slot: it takes what is pending
    WAITING = "waiting"  # for a send slot
    CLAIMING = "claiming"  # holding a send slot, about to take what is pending
    SENDING = "sending"  # delivering what it took (reopening, too, within a bisection)


class _Worker:
    """One worker task of a lane and the sender it owns (None until it needs one)."""

    __slots__ = ("lane", "last_used", "sender", "slot", "state", "task")

    def __init__(self, lane: _Lane, now: float) -> None:
        self.lane = lane
        self.state = _State.STARTING
        self.sender: Sender | None = None
        self.slot = False  # holds one of the send slots (`max_in_flight`)
        self.task: asyncio.Task[None] | None = None
        self.last_used = now  # loop time of its last send (or of its start)


class _Wakeup:
    """A lane's "work is pending" flag that wakes ONE parked worker, not all of them.

    An `asyncio.Event` wakes every waiter, and all but one park again: a task step, a send
    slot, a timeout and a future each, per request. Here `set` wakes the most recently parked
    worker (the others' idle time runs on, so a lane with light traffic shrinks), and none
    while the one it woke is still on its way to take what is pending (`woken`, until the
    lane's next `take`): requests arriving meanwhile join its batch, as they joined the
    batch of the first of the workers an Event woke. A take that leaves work pending wakes
    the next worker (a backlog still spreads over the lane), and so does the woken worker
    when it must open its sender first, or ends, instead (`release`).
    """

    __slots__ = ("_flag", "_waiters", "woken")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[tuple[_Worker, asyncio.Future[None]]] = []  # the latest last
        self.woken: _Worker | None = None  # woken, and has not taken yet

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        """Nothing is pending (so nobody is on the way to take it)."""
        self._flag = False
        self.woken = None

    def set(self) -> None:
        """Work is pending: wake one parked worker, unless one woken is on its way."""
        self._flag = True
        if self.woken is not None:
            return
        waiters = self._waiters
        while waiters:
            w, fut = waiters.pop()
            if not fut.done():  # (a cancelled wait's entry is removed by `wait`, too)
                fut.set_result(None)
                self.woken = w
                return

    def took(self) -> None:
        """The lane's pending requests were taken: the next request wakes a worker again."""
        self.woken = None

    def release(self, w: _Worker) -> None:
        """`w` will not take soon (it opens its sender first) or ends: if it was the one
        woken, wake another for what is pending."""
        if self.woken is w:
            self.woken = None
            if self._flag:
                self.set()

    def set_all(self) -> None:
        """Wake every parked worker (shutdown)."""
        self._flag = True
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self, w: _Worker) -> None:
        """Park `w` until woken (`set`); the caller checks `is_set` first."""
        if self.woken is w:  # back without a take (its sender was closed meanwhile, say)
            self.woken = None
        entry = (w, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        finally:
            if not entry[1].done() or entry[1].cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)


class _Lane:
    """Pending requests for one destination and the workers that send them."""

    __slots__ = ("dest", "expiry", "next_send", "pending", "rtt", "wakeup", "workers")

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self.pending: deque[_Group] = deque()
        self.wakeup = _Wakeup()
        self.workers: list[_Worker] = []
        self.expiry: asyncio.TimerHandle | None = None  # for the oldest pending group
        self.rtt = 0.0  # seconds: its sends' moving average (0 until one succeeded)
        self.next_send = 0.0  # loop time: the earliest the next paced send may start

    def take(self, max_messages: int, max_bytes: int) -> list[_Group]:
        """Whole groups from the front, within the limits and sharing one batch key. The
        first group is always taken (the edge held it to the limits alone); more join while
        the batch's bound (`batch_size`: the groups' sizes and the envelope) stays within
        `max_bytes`."""
        self.wakeup.took()
        taken: list[_Group] = []
        count = size = 0
        key: str | None = None
        skipped: list[_Group] = []
        while self.pending:
            g = self.pending[0]
            if g.future.done():  # its caller was cancelled: never sent
                self.pending.popleft()
                continue
            if taken and (count + len(g.messages) > max_messages or size + g.size > max_bytes):
                break
            self.pending.popleft()
            if taken and g.batch_key != key:
                skipped.append(g)  # another partition/session: keep for the next batch
                if len(skipped) > 64:
                    break
                continue
            if not taken:
                key = g.batch_key
                size = envelope_size(g.messages[0]) if g.messages else 0
            taken.append(g)
            count += len(g.messages)
            size += g.size
        self.pending.extendleft(reversed(skipped))
        if self.pending:
            self.wakeup.set()  # more than one batch: the next parked worker takes the rest
        else:
            self.wakeup.clear()
        return taken

    def has(self, *states: _State) -> bool:
        """Whether one of the lane's workers is in one of `states`."""
        return any(w.state in states for w in self.workers)


class Dispatcher:
    """Sends messages to destinations, bounded and micro-batched. See the module docstring."""

    def __init__(
        self,
        limits: LimitSettings,
        timeouts: TimeoutSettings,
        observer: DispatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
        loop_lag: LoopLag | None = None,
    ) -> None:
        self._limits = limits
        # The adaptive limit's samples leave out how late the event loop ran meanwhile: a
        # gateway short of CPU must not take its own lag for the broker's latency.
        self._loop_lag = loop_lag
        self._tracer = tracer or Tracer()
        self._timeouts = timeouts
        self._observer = observer or DispatchObserver()
        self._clock = clock
        self._gate = AdmissionGate(limits.max_pending_bytes)
        self._in_flight = asyncio.Semaphore(limits.max_in_flight)
        self._lanes: dict[tuple[str, str], _Lane] = {}
        self._senders: set[Sender] = set()  # every sender open now
        # Workers holding an open sender and not sending, least recently used first (the LRU).
        self._parked: OrderedDict[_Worker, None] = OrderedDict()
        self._closing = False
        self._stopping = False  # the workers must end (seen even by one whose cancel was lost)
        # Adaptive admission (gateway.core.limiter): one limiter per namespace, made on its
        # first send; None when it is off.
        self._limiter_config: LimiterConfig | None = None
        if limits.adaptive_admission:
            self._limiter_config = LimiterConfig(
                initial=limits.adaptive_initial_limit,
                minimum=limits.adaptive_min_limit,
                maximum=limits.adaptive_max_limit,
                backoff=limits.adaptive_backoff,
                tolerance=limits.adaptive_tolerance,
            )
        self._limiters: dict[str, GradientLimiter] = {}

    @property
    def gate(self) -> AdmissionGate:
        return self._gate

    @property
    def clock(self) -> Callable[[], float]:
        """The clock a failure's `started` is on (the event loop's, by default)."""
        return self._clock

    def pending_messages(self) -> int:
        return sum(len(g.messages) for lane in self._lanes.values() for g in lane.pending)

    @property
    def open_senders(self) -> int:
        """Senders open now, all destinations."""
        return len(self._senders)

    @property
    def lanes(self) -> int:
        """Destinations with a lane now (sent to recently, or with requests pending)."""
        return len(self._lanes)

    # -- API -----------------------------------------------------------------------------

    def limiter(self, namespace: str) -> GradientLimiter | None:
        """`namespace`'s adaptive limiter (None when adaptive admission is off, or before
        its first send)."""
        return self._limiters.get(namespace)

    def send(
        self, dest: Destination, messages: Sequence[OutboundMessage], *, limited: bool = True
    ) -> Coroutine[Any, Any, None]:
        """Send `messages` to `dest` as one unit; await it to wait until they are settled.

        Raises `Saturated` at once when the namespace is at its adaptive limit (`limited`:
        a client's request; the syphon's moves and the failover pings are not limited, a
        refusal would say nothing about the broker), or when no room frees up within
        `admission_timeout`; `Draining` during shutdown, `SendFailure` when the broker did
        not store them. If the caller is cancelled before its messages were handed to a
        worker, they are never sent.

        Not a coroutine function itself: without the adaptive limit (the default) it gives
        `_submit`'s coroutine, one frame fewer for every suspension and resumption of a
        request; every error is still raised when it is awaited, never by the call.
        """
        if self._closing or (self._limiter_config is not None and limited):
            return self._limited_send(dest, messages, limited)
        return self._submit(dest, messages)

    async def _limited_send(
        self, dest: Destination, messages: Sequence[OutboundMessage], limited: bool
    ) -> None:
        """`send` during shutdown, or under the adaptive limit."""
        if self._closing:
            raise Draining("the gateway is shutting down")
        if self._limiter_config is None or not limited:
            await self._submit(dest, messages)
            return
        namespace = dest.client.name
        limiter = self._limiters.get(namespace)
        if limiter is None:
            limiter = GradientLimiter(self._limiter_config, self._clock)
            self._limiters[namespace] = limiter
            self._observer.limiter_created(namespace, limiter)
        if not limiter.try_acquire():
            self._observer.limit_refused(namespace)
            raise Saturated(
                f"Service Bus namespace {namespace} is at its adaptive concurrency limit "
                f"({limiter.limit} requests); retry later"
            )
        started, loop_started = self._clock(), asyncio.get_running_loop().time()
        latency: float | None = None
        dropped = False
        try:
            await self._submit(dest, messages)
            latency = self._clock() - started
            if self._loop_lag is not None:  # its samples are on the loop's clock
                latency = max(0.0, latency - self._loop_lag.lag_since(loop_started))
        except Saturated:
            dropped = True  # no room or no sender in time: the path to the broker is full
            raise
        except SendFailure as failure:
            dropped = failure.kind in _PUSHBACK
            raise
        finally:
            limiter.release(latency, dropped=dropped)

    async def _submit(self, dest: Destination, messages: Sequence[OutboundMessage]) -> None:
        """`send` once admitted by the adaptive limit (or without it)."""
        size = 0
        for m in messages:
            size += m.size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.admission_timeout
        tracer = self._tracer
        if tracer.enabled:
            waiting_since = self._clock()
            try:
                await self._gate.acquire(size, self._limits.admission_timeout)
            finally:  # a wait that ended in 503 is visible too
                waited = self._clock() - waiting_since
                if waited >= ADMISSION_WAIT_TRACED:
                    tracer.admission_waited(waited)
        elif not self._gate.try_acquire(size):
            await self._gate.acquire(size, self._limits.admission_timeout)
        group: _Group | None = None
        try:
            if self._closing:  # shutdown began while this request waited for room
                raise Draining("the gateway is shutting down")
            lane = self._lane(dest)
            trace = tracer.current() if tracer.enabled else None
            group = _Group(messages, size, loop.create_future(), deadline, trace)
            lane.pending.append(group)
            lane.wakeup.set()
            for w in lane.workers:  # inline: once per request
                state = w.state
                if state is _State.IDLE or state is _State.STARTING:
                    break
                # Opening its sender (or waiting out the pace), it takes what is pending when
                # done: a second worker would add a second cold open (or a send the pace
                # holds back), not an earlier send, unless the pending requests exceed one
                # batch.
                takes_soon = state is _State.OPENING or state is _State.PACING
                if takes_soon and len(lane.pending) <= self._limits.max_batch_messages:
                    break
            else:
                if len(lane.workers) < self._limits.senders_per_entity:
                    self._spawn(lane)  # no worker free: the lane grows with its load
            if lane.expiry is None:
                lane.expiry = loop.call_at(deadline, self._expire, lane)
            try:
                await group.future
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):
                    lane.pending.remove(group)  # not handed to a worker yet: never sent
                raise
        finally:
            self._gate.release(size)
            # A failure's traceback holds this frame, whose group holds the future holding
            # the failure: a cycle only the cycle collector frees, with the request's memory.
            group = None

    async def close(self, grace: float) -> None:
        """Stop taking work, let pending sends finish for up to `grace` seconds, then stop
        every worker; whatever did not go out fails with a 503-class error. Takes at most
        `grace + 2 * SENDER_CLOSE_TIMEOUT + 2 * CANCEL_GRACE`, whatever the senders do: a
        worker whose cancel the SDK lost ends at the top of its loop, or at a second cancel."""
        self._closing = True
        deadline = self._clock() + grace
        while any(lane.pending or lane.has(_State.SENDING) for lane in self._lanes.values()):
            if self._clock() >= deadline:
                break
            await asyncio.sleep(0.01)
        self._stopping = True
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.wakeup.set_all()
        workers = [w.task for lane in lanes for w in lane.workers if w.task is not None]
        # A cancelled worker closes its sender (SENDER_CLOSE_TIMEOUT) before it ends.
        await stop(workers, SENDER_CLOSE_TIMEOUT + CANCEL_GRACE, "dispatcher")
        for lane in lanes:
            if lane.expiry is not None:
                lane.expiry.cancel()
                lane.expiry = None
            self._fail(lane.pending, SendFailure(SHUTDOWN, "the gateway shut down"))
            lane.pending.clear()
        # A sender opened by a send that shutdown cancelled belongs to no worker any more.
        left, self._senders = list(self._senders), set()
        await asyncio.gather(*(_close_quietly(s) for s in left))

    # -- internals -----------------------------------------------------------------------

    def _expire(self, lane: _Lane) -> None:
        """Refuse the pending groups no worker took by their deadline (never handed over, so
        never sent): `Saturated` when the workers are busy, a `TIMEOUT` failure when they are
        still opening a sender; then wait for the next oldest one. One timer per
        lane: groups are appended in deadline order."""
        lane.expiry = None
        loop = asyncio.get_running_loop()
        # (Not a worker waiting out the pace: it takes within MAX_PACE, but a lane over its
        # capacity has one pacing most of the time, and the deadline must not wait on it.)
        if lane.has(_State.CLAIMING) or (
            lane.wakeup.is_set()
            and (
                lane.has(_State.STARTING)
                or (lane.wakeup.woken is not None and lane.wakeup.woken.state is _State.IDLE)
            )
        ):
            # A worker is about to take what is pending: look again once it has.
            lane.expiry = loop.call_later(0.01, self._expire, lane)
            return
        now = loop.time()
        waited = f"{self._limits.admission_timeout:g}s"
        while lane.pending and lane.pending[0].deadline <= now:
            group = lane.pending.popleft()
            if group.future.done():
                continue
            if lane.has(_State.OPENING) and not lane.has(_State.SENDING):
                # Waiting on the namespace, not on us: an upstream timeout, which counts
                # toward failover. (As `Saturated`, the requests of a sparse flow could all
                # expire while each open hangs, and the entity would never fail over.)
                error: Exception = self._with_retry_after(
                    SendFailure(
                        TIMEOUT, f"no sender to {lane.dest} could be opened within {waited}"
                    )
                )
            else:
                error = Saturated(
                    f"the gateway is saturated: no sender took this request within {waited}; "
                    "retry later"
                )
            if isinstance(error, SendFailure):  # it waited for the open from its arrival
                error.started = group.deadline - self._limits.admission_timeout
            group.future.set_exception(error)
        if lane.pending:
            lane.expiry = loop.call_at(lane.pending[0].deadline, self._expire, lane)
        else:
            lane.wakeup.clear()

    def _lane(self, dest: Destination) -> _Lane:
        key = dest.key
        lane = self._lanes.get(key)
        if lane is None:
            lane = _Lane(dest)
            self._lanes[key] = lane
        return lane

    def _spawn(self, lane: _Lane) -> None:
        """One more worker for `lane`; it takes what is pending once it runs."""
        w = _Worker(lane, asyncio.get_running_loop().time())
        lane.workers.append(w)
        # A fresh context: a worker outlives the request whose send created it, and must not
        # carry that request's context (its span, say) in its own.
        w.task = asyncio.create_task(
            self._worker(w), name=f"sender {lane.dest}", context=contextvars.Context()
        )

    def _retire(self, w: _Worker) -> None:
        """`w` ends: off its lane, and the lane off the map once it has no worker and nothing
        pending (a later send makes a new one)."""
        lane = w.lane
        self._parked.pop(w, None)
        with contextlib.suppress(ValueError):
            lane.workers.remove(w)
        lane.wakeup.release(w)
        if not lane.workers and not lane.pending and self._lanes.get(lane.dest.key) is lane:
            if lane.expiry is not None:  # nothing pending: nothing to expire
                lane.expiry.cancel()
                lane.expiry = None
            del self._lanes[lane.dest.key]

    async def _park(self, w: _Worker) -> bool:
        """Wait for work; False when `w` has sent nothing for `sender_idle_timeout` (it then
        ends). A request wakes one parked worker (`_Wakeup`), the one parked last: the idle
        time counts from the last send, not from the last wake-up, so under steady light
        traffic the others run out of it and the lane shrinks."""
        lane = w.lane
        w.state = _State.IDLE
        if lane.wakeup.is_set():
            return True  # work is pending (a busy lane): no deadline to arm
        try:
            async with asyncio.timeout_at(w.last_used + self._limits.sender_idle_timeout):
                await lane.wakeup.wait(w)
        except TimeoutError:
            return bool(lane.pending)  # work arrived just as the wait ran out: take it
        return True

    async def _worker(self, w: _Worker) -> None:
        """Send what the lane has pending until idle or stopped. An unexpected error (a bug)
        fails the requests it held, is logged with its traceback and counted
        (`sbgate_task_restarts_total{task="sender_worker"}`); the worker ends, and the lane's
        next request starts another (never at once: a bug that recurs must not spin)."""
        lane = w.lane
        groups: list[_Group] = []
        try:
            while not self._stopping:
                groups = []
                if not await self._park(w):
                    return
                if self._stopping:
                    break
                # Open the sender before taking anything, and outside the send slots: while
                # a namespace is away the open can take connect_timeout, and requests left
                # pending meanwhile meet their admission deadline (503 at once) instead of
                # waiting it out, while other destinations (the backlog queues) keep their
                # slots.
                opening: BaseException | None = None
                open_started: float | None = None
                if w.sender is None and lane.pending:
                    open_started = self._clock()
                    w.state = _State.OPENING
                    lane.wakeup.release(w)  # a parked worker with its sender open takes them
                    opening = await self._open(w)
                await self._pace(w)
                w.state = _State.WAITING
                await self._take_slot(w)
                try:
                    w.state = _State.CLAIMING  # until `take`, `_expire` leaves pending alone
                    await asyncio.sleep(0)  # one tick: requests arriving now join
                    if w.sender is None and opening is None:
                        # Its sender was closed for another entity's open while it waited,
                        # or the work came after it looked: it opens outside the slot first.
                        continue
                    groups = lane.take(
                        self._limits.max_batch_messages, self._limits.max_batch_bytes
                    )
                    if not groups:
                        continue
                    await self._send(w, groups, opening, open_started)
                finally:
                    self._give_slot(w)
        except asyncio.CancelledError:
            # Shutdown (or a lost cancel's second one): whatever this worker held and did not
            # settle — halves `_isolate` had not sent yet, a batch whose suspect sender was
            # being discarded — fails now, or its callers would wait for ever.
            self._fail(groups, SendFailure(SHUTDOWN, "the gateway shut down during the send"))
            raise
        except Exception:
            log.exception("sender worker for %s failed; the next request starts another", lane.dest)
            self._observer.task_restarted("sender_worker")
            self._fail(groups, SendFailure(UNKNOWN, "unexpected error in the gateway"))
        finally:
            self._retire(w)
            sender, w.sender = w.sender, None
            if sender is not None:
                self._senders.discard(sender)
                await _close_quietly(sender)

    async def _send(
        self,
        w: _Worker,
        groups: list[_Group],
        opening: BaseException | None,
        open_started: float | None,
    ) -> None:
        """`w` (holding a send slot) delivers the `groups` it took."""
        w.state = _State.SENDING
        self._observer.in_flight(1)
        self._parked.pop(w, None)  # in use: not a candidate for eviction
        try:
            # A failed open is reported as of when it began (failover weighs it against the
            # entity's last success and this replica's lag).
            started = open_started if opening is not None else None
            await self._deliver(w, groups, opening, started=started)
        finally:
            self._observer.in_flight(-1)
            w.last_used = asyncio.get_running_loop().time()
            if w.sender is not None:
                self._parked[w] = None  # the most recently used

    async def _pace(self, w: _Worker) -> None:
        """Wait until `w`'s lane may start another send (see "Paced" in the module
        docstring): at once when none of its batches is in flight; else no sooner than a gap
        after the last start (or the last one reserved by a worker still waiting for it)."""
        lane = w.lane
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not lane.rtt or not lane.has(_State.SENDING):
            lane.next_send = now
            return
        gap = min(lane.rtt / self._limits.senders_per_entity, MAX_PACE)
        if gap < MIN_PACE:
            return
        at = max(now, lane.next_send + gap)
        lane.next_send = at
        if at > now:
            w.state = _State.PACING
            await asyncio.sleep(at - now)

    async def _take_slot(self, w: _Worker) -> None:
        """One of the `max_in_flight` send slots for `w`."""
        await self._in_flight.acquire()
        w.slot = True

    def _give_slot(self, w: _Worker) -> None:
        """`w`'s send slot back, if it holds one."""
        if w.slot:
            w.slot = False
            self._in_flight.release()

    async def _open(self, w: _Worker) -> BaseException | None:
        """The only way a sender is opened: `w`'s, within connect_timeout, never while `w`
        holds a send slot. At `max_open_senders`, the least recently used idle sender is
        closed first (its worker stays, and reopens on its next work). Returns why it could
        not be opened (reported to the groups it fails, by `_deliver`), or None."""
        assert not w.slot and w.sender is None
        lane = w.lane
        try:
            async with asyncio.timeout(self._timeouts.connect_timeout):
                if len(self._senders) >= self._limits.max_open_senders and self._parked:
                    idle, _ = self._parked.popitem(last=False)
                    evicted, idle.sender = idle.sender, None
                    if evicted is not None:
                        self._senders.discard(evicted)
                        await _close_quietly(evicted)
                sender = await lane.dest.client.open_sender(lane.dest.path)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        self._senders.add(sender)
        w.sender = sender
        return None

    async def _deliver(
        self,
        w: _Worker,
        groups: list[_Group],
        opening: BaseException | None = None,
        *,
        started: float | None = None,
    ) -> None:
        """Send `groups` as one batch on `w`'s sender; settle every group's future. `w.sender`
        is None afterwards when it must be reopened. `opening`: why the sender could not be
        opened just before (`started`: when that open began); the groups fail with it. A
        batch of several requests refused for a message's sake is bisected (`_isolate`)."""
        started = self._clock() if started is None else started
        loop_started = asyncio.get_running_loop().time()
        failure = await self._attempt(w, groups, opening)
        if failure is None and opening is None:
            lane = w.lane
            seconds = asyncio.get_running_loop().time() - loop_started
            lane.rtt = seconds if not lane.rtt else lane.rtt + _RTT_WEIGHT * (seconds - lane.rtt)
            self._observe_send(lane, started, loop_started)
        if failure is not None and failure.classification.message_fault and len(groups) > 1:
            self._observe(w.lane, groups, started, failure)
            await self._isolate(w, groups)
            return
        self._settle(w.lane, groups, started, failure)

    async def _attempt(
        self, w: _Worker, groups: list[_Group], opening: BaseException | None = None
    ) -> SendFailure | None:
        """One broker send of `groups`' messages on `w`'s sender, unsettled: the failure, if
        any (`w.sender` is None when it must be reopened). On cancellation (shutdown
        mid-send) the groups fail with `SHUTDOWN` and the cancellation goes on."""
        messages = [m for g in groups for m in g.messages]
        lane = w.lane
        try:
            if opening is not None:
                raise opening
            assert w.sender is not None, "a sender is opened outside the send slot, first"
            async with asyncio.timeout(self._timeouts.send_timeout):
                await w.sender.send(messages)
        except asyncio.CancelledError:
            # Shutdown mid-send: the outcome is unknown, so it must not be reported as stored.
            self._fail(groups, SendFailure(SHUTDOWN, "the gateway shut down during the send"))
            raise
        except TimeoutError:
            await self._discard(w)
            return SendFailure(
                TIMEOUT, f"no answer from Service Bus within {self._timeouts.send_timeout:g}s"
            )
        except SendFailure as failure:
            if failure.classification.recreate_sender:
                await self._discard(w)
            return failure
        except Exception as exc:  # a bug in an adapter must fail the requests, not the worker
            log.exception("unexpected error sending to %s", lane.dest)
            await self._discard(w)
            return SendFailure(UNKNOWN, f"unexpected error: {type(exc).__name__}")
        return None

    async def _isolate(self, w: _Worker, groups: list[_Group]) -> None:
        """`groups` (several requests) were refused together because of a message in one of
        them (`message_fault`): send the halves again, and the halves of a half refused
        again, so every other request is stored (201) and only the offending one gets its
        4xx. One offender costs at most 2·⌈log2 n⌉ extra sends; all of them together at
        most `split_budget(n)`, after which the requests not yet told apart get 503
        `saturated` (retry; never counted toward failover). A half failing for another
        reason (a timeout, say) settles with it as any batch does; a sender it made suspect
        is reopened outside the send slot. Settles every group."""
        lane = w.lane
        budget = split_budget(len(groups))
        mid = len(groups) // 2
        todo = [groups[mid:], groups[:mid]]  # a stack: the first half first
        while todo:
            part = [g for g in todo.pop() if not g.future.done()]
            if not part:
                continue
            if self._stopping:  # a worker whose cancel was lost sends nothing more
                self._fail(part, SendFailure(SHUTDOWN, "the gateway shut down"))
                continue
            if budget <= 0:
                self._fail(
                    part,
                    Saturated(
                        "the batch this request was sent in held several messages the broker "
                        "refused, and it could not be told apart from them; retry"
                    ),
                )
                continue
            budget -= 1
            self._observer.batch_split(str(lane.dest))
            started = self._clock()
            opening = await self._reopen(w) if w.sender is None else None
            failure = await self._attempt(w, part, opening)
            if failure is not None and failure.classification.message_fault and len(part) > 1:
                self._observe(lane, part, started, failure)
                mid = len(part) // 2
                todo += [part[mid:], part[:mid]]
                continue
            self._settle(lane, part, started, failure)

    async def _reopen(self, w: _Worker) -> BaseException | None:
        """`_open` for a worker holding a send slot: it gives the slot back for the open."""
        self._give_slot(w)
        opening = await self._open(w)
        await self._take_slot(w)
        return opening

    async def _discard(self, w: _Worker) -> None:
        sender, w.sender = w.sender, None
        if sender is not None:
            self._senders.discard(sender)
            self._observer.sender_recreated(str(w.lane.dest))
            await _close_quietly(sender)

    def _settle(
        self, lane: _Lane, groups: list[_Group], started: float, failure: SendFailure | None
    ) -> None:
        # The requests first: nothing below may leave one unsettled.
        if failure is None:
            for g in groups:
                if not g.future.done():
                    g.future.set_result(None)
        else:
            failure.started = started  # failover weighs the report by when the send began
            self._fail(groups, self._with_retry_after(failure))
        self._observe(lane, groups, started, failure)

    def _observe_send(self, lane: _Lane, started: float, loop_started: float) -> None:
        """A send's round trip, to its namespace's adaptive limiter (the broker floor), the
        loop's own lag left out."""
        limiter = self._limiters.get(lane.dest.client.name)
        if limiter is not None:
            seconds = self._clock() - started
            if self._loop_lag is not None:
                seconds = max(0.0, seconds - self._loop_lag.lag_since(loop_started))
            limiter.observe_send(seconds)

    def _observe(
        self, lane: _Lane, groups: list[_Group], started: float, failure: SendFailure | None
    ) -> None:
        """One broker operation's metrics and span."""
        n = sum(len(g.messages) for g in groups)
        outcome = "ok" if failure is None else failure.kind.value
        seconds = self._clock() - started
        self._observer.batch_sent(str(lane.dest), n, seconds, outcome)
        if self._tracer.enabled:
            links = [g.trace for g in groups]
            error = None if failure is None else outcome
            dest = lane.dest
            self._tracer.batch_sent(dest.client.name, dest.path, links, n, seconds, error)

    def _with_retry_after(self, failure: SendFailure) -> SendFailure:
        """The table's rows say whether the client must back off; how long is the operator's
        setting (default: the table's 10 s). Shutdown does not pass here."""
        if failure.retry_after is not None:
            failure.retry_after = self._timeouts.retry_after
        return failure

    @staticmethod
    def _fail(groups: Iterable[_Group], failure: GatewayError) -> None:
        for g in groups:
            if not g.future.done():
                g.future.set_exception(failure)


async def _close_quietly(sender: Sender) -> None:
    await close_quietly("closing a sender", sender.close(), SENDER_CLOSE_TIMEOUT)
