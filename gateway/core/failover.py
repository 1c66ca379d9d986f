"""Send availability: per-entity failover to backlog queues, pings, cluster-shared state.

Per entity (docs/design.md#failover-rule, state shared through a `StateStore`):

    healthy ──(first counting failure at t0)──▶ failing ──(no success by t0 + interval)──▶
    failed_over ──(a ping is delivered, or an operator marks it healthy)──▶ healthy
    failing ──(a successful send anywhere in the cluster)──▶ healthy

* healthy / failing: send to the primary. While *failing*, a request whose primary send
  fails with a counting error goes to a backlog queue instead (202), unless
  `strict_primary` (then the failure is answered 503).
* failed_over: send straight to a backlog queue; one replica in the cluster (holder of a
  lease) pings the primary entity every `ping_primary_interval` until a ping is delivered.
  The first ping comes one interval after the failover began, so a failover an operator
  forces holds until they mark the entity healthy or a ping after the interval succeeds.
* Server-busy and unauthorized errors never count (the error table says so).
* Only the broker's failures count. A report from a send that began before the entity's
  last success or recovery seen here is stale and never counts; nor does a timeout during
  which this replica's event loop ran late by more than `loop_lag_tolerance` in all
  (`LoopLag`: the answer may have been waiting in the socket). Such a failure is answered
  as it is (503) while the entity is healthy, and goes to a backlog queue otherwise.

Backlog queues: each replica picks a random healthy one per entity; a send failure takes
that queue out of rotation for the whole cluster for `backlog_reprobe_interval` (then the
next send to it is the re-probe) and the request is retried on another queue; with none
left, 503. The hot path reads only memory: the store persists transitions in the background.

No backlog left behind: a backlog write is announced to every replica's syphon (through the
store) as soon as this replica sees its entity healthy — at once if it already is when the
write completes, else when the failover ends here. The syphon's own depth check at failback
finds what was written before it; the announcements cover what completes after it, even on
another replica. A replica that starts announces every queue (it cannot know what it wrote
before it stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import FailoverSettings, LimitSettings, TimeoutSettings
from gateway.core.backlog import (
    new_fence_token,
    ping_message,
    rewrite,
    rewritten_size,
    session_ranking,
)
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.entities import EntityRef
from gateway.core.looplag import LoopLag
from gateway.core.message import OutboundMessage
from gateway.core.ports import NamespaceClient
from gateway.core.router import Delivery
from gateway.errors import (
    FailureKind,
    GatewayError,
    NoBacklogAvailable,
    PayloadTooLarge,
    SendFailure,
)
from gateway.ledger import EventLedger, NullLedger
from gateway.lifetimes import TaskSet, supervised
from gateway.state.base import BacklogState, EntityState, StateStore, Status
from gateway.state.fence import FenceStore, FenceUnavailable

log = logging.getLogger(__name__)
# The (pair, entity) routes to the primary `Failover` keeps made (`_primary_route`): more
# than a replica serves; past it, the cache starts over.
_PRIMARY_ROUTES = 4096

MAX_BACKLOG_ATTEMPTS = 3
FENCED_SAMPLE = 20  # fenced SessionIds `GET /admin/entities` lists per entity, at most
# A fenced backlog write still pending this long after its request's budget ran out is one
# whose replica died: it no longer holds its session's fence.
FENCE_WRITE_MARGIN = 5.0
# How long a cancelled pinger gets to release its lease (one store call, itself bounded).
STOP_TIMEOUT = 5.0
# Why an entity's state changed, as `GET /admin/entities` shows it ("reason").
PING_DELIVERED = "ping delivered"
MARKED_HEALTHY = "operator: marked healthy"
FORCED = "operator: forced failover"


def request_budget(limits: LimitSettings, timeouts: TimeoutSettings) -> float:
    """How long a request's attempts may take in all, from when it reaches the router: one
    wait for admission and one broker send. A backlog attempt gets what the primary left."""
    return limits.admission_timeout + timeouts.send_timeout


@dataclass(frozen=True, slots=True)
class PairClients:
    """A namespace pair as the failover logic sees it."""

    primary: NamespaceClient
    secondary: NamespaceClient | None
    backlog_queues: tuple[str, ...]  # the usable backlog queue paths in `secondary`


class FailoverObserver:
    """Metric hooks; the default does nothing."""

    def entity_state(self, entity: str, status: Status) -> None: ...

    def entity_declared(self, entity: str) -> None:
        """A declared entity with no state yet (healthy): its series exists from start-up."""

    def backlog_send(self, queue: str, ok: bool) -> None: ...

    def backlog_disabled(self, count: int) -> None: ...

    def ping(self, entity: str, ok: bool) -> None: ...

    def task_restarted(self, task: str) -> None:
        """A pinger raised and is being restarted (gateway.lifetimes)."""


class Failover:
    """The failover router (`submit`) and its pinger supervisor. Owned tasks: the ping loops,
    started on transitions to failed_over, cancelled and awaited by `close()`."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        pairs: Mapping[str, PairClients],
        store: StateStore,
        settings: FailoverSettings,
        limits: LimitSettings,
        observer: FailoverObserver | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        ledger: EventLedger | None = None,
        loop_lag: LoopLag | None = None,
        timeouts: TimeoutSettings | None = None,
        fences: FenceStore | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        # Session fences (docs/failover.md#sessions-keep-their-order); None: no entity is
        # `strict` (every session message is routed as any other).
        self._fences = fences
        self._budget = request_budget(limits, timeouts or TimeoutSettings())
        self._loop_lag = loop_lag
        self._pairs = pairs
        self._store = store
        self._settings = settings
        self._limits = limits
        self._observer = observer or FailoverObserver()
        self._ledger: EventLedger = ledger or NullLedger()
        self._clock = clock
        self._dispatcher_clock = dispatcher.clock  # the clock a failure's `started` is on
        # Per (pair, entity path): the primary's destination and the answer of a send stored
        # there (`_primary_route`).
        self._primary: dict[tuple[str, str], tuple[Destination, Delivery]] = {}
        self._rng = rng or random.Random()  # noqa: S311  # nosec B311  # load spreading, not security
        self._choice: dict[str, str] = {}  # entity key -> this replica's backlog queue
        self._entities: dict[str, EntityRef] = {}
        # Every pinger and timer is owned by `_tasks`; these find an entity's.
        self._tasks = TaskSet("failover")
        self._pingers: dict[str, asyncio.Task[None]] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._next_ping: dict[str, float] = {}  # entity key -> when its pinger pings next
        # Backlog queues this replica wrote an entity's messages to while the entity was not
        # healthy here: announced to the syphons when it is (see the module docstring).
        self._unannounced: dict[str, set[str]] = {}
        # Per entity, when (on the dispatcher's clock) this replica last saw a send to it
        # succeed or the entity recover: a failure of a send that began before is stale.
        self._fresh: dict[str, float] = {}
        self._closed = False
        # Called when a send finds an entity missing at its primary (the app sets it: the
        # entity check then looks at once; gateway.core.presence).
        self.on_entity_not_found: Callable[[], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, entities: Sequence[EntityRef]) -> None:
        """Register the entities and react to state changes (from any replica)."""
        for e in entities:
            self._entities[e.path.lower()] = e
        self._store.subscribe(self._on_entity, self._on_backlog)
        snapshot = self._store.snapshot()
        for key in self._entities.keys() - snapshot.keys():
            self._observer.entity_declared(key)
        for st in snapshot.values():
            self._on_entity(st)
        if any(p.backlog_queues for p in self._pairs.values()):
            self._store.announce_backlog_write(None)

    async def close(self) -> None:
        """Stop the pingers and timers: within `STOP_TIMEOUT + CANCEL_GRACE`."""
        self._closed = True
        await self._tasks.stop(STOP_TIMEOUT)
        self._pingers.clear()
        self._timers.clear()

    # -- the router ----------------------------------------------------------------------

    async def submit(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> Delivery:
        """Deliver `messages` to the primary, or to a backlog queue (the module docstring).

        One deadline for all the attempts: `request_budget` from now. The primary attempt
        is bounded by the dispatcher's own deadlines (its admission wait and one send), so
        it is not timed here (no timer on the hot path); the backlog attempts get what it
        left, and none at all when it left nothing (then its failure is the answer)."""
        key = entity.path.lower()
        pair = self._pairs[entity.pair]
        store = self._store
        state = store.get(key)
        deadline = asyncio.get_running_loop().time() + self._budget
        if state.status == "failed_over" and pair.backlog_queues:
            return await self._to_backlog(entity, pair, messages, None, deadline)
        fences = self._fences
        if (
            pair.backlog_queues
            and fences is not None
            and self._fenced(fences, entity, key, messages)
        ):
            # A fenced session's older messages wait in the backlog: this one goes after
            # them, before any primary attempt, whatever the entity's state.
            return await self._to_backlog(entity, pair, messages, None, deadline)
        primary = self._primary.get((entity.pair, entity.path))
        if primary is None:
            primary = self._primary_route(entity, pair)
        try:
            await self._dispatcher.send(primary[0], messages)
        except SendFailure as failure:
            _untangle(failure)
            if failure.kind is FailureKind.ENTITY_NOT_FOUND and self.on_entity_not_found:
                self.on_entity_not_found()
            if not failure.classification.counts_toward_failover:
                raise
            if self._counts(key, failure):
                self._record_failure(key, failure)
            elif self._store.get(key).status == "healthy":
                raise  # not the broker's failure, as far as we know: the client retries
            if self._settings.strict_primary or not pair.backlog_queues:
                raise
            if asyncio.get_running_loop().time() >= deadline:
                raise  # the primary used the whole budget: nothing left for a backlog
            return await self._to_backlog(entity, pair, messages, failure, deadline)
        # `_record_success`, inline: once per request.
        self._fresh[key] = self._dispatcher_clock()
        state = store.get(key)
        if state.status == "failing":  # a success resets the timer, cluster-wide
            self._propose(state, "healthy", "send succeeded")
        return primary[1]

    def _primary_route(self, entity: EntityRef, pair: PairClients) -> tuple[Destination, Delivery]:
        """Where `entity`'s primary sends go, and the answer when they are stored there: made
        once per entity (both are immutable), not per request. Bounded, as the entities a
        replica serves are: started over when full."""
        if len(self._primary) >= _PRIMARY_ROUTES:
            self._primary.clear()
        route = (Destination(pair.primary, entity.path), Delivery("primary", entity.path))
        self._primary[(entity.pair, entity.path)] = route
        return route

    def _strict(self, entity: EntityRef) -> bool:
        """Does `entity` keep its sessions' order (`session_order = strict`)?"""
        order = entity.session_order or self._settings.session_order
        return self._fences is not None and order == "strict"

    def _fenced(
        self,
        fences: FenceStore,
        entity: EntityRef,
        key: str,
        messages: Sequence[OutboundMessage],
    ) -> bool:
        """Is a session of `messages` fenced in `fences` (memory only: the hot path, which
        calls it only when fences exist)?"""
        for m in messages:  # a loop, not a comprehension: most requests carry no session
            if m.session_id is not None:
                break
        else:
            return False
        if not self._strict(entity):
            return False
        return any(fences.fenced(key, m.session_id) for m in messages if m.session_id is not None)

    def _counts(self, key: str, failure: SendFailure) -> bool:
        """Whether a failure the error table counts is the broker's (the module docstring):
        not stale, and not a timeout of ours."""
        started = failure.started
        if started is None:
            return True
        if started < self._fresh.get(key, float("-inf")):
            log.info(
                "entity %s: a stale failure report does not count (%s)", key, failure.kind.value
            )
            return False
        if failure.kind is FailureKind.TIMEOUT and self._loop_lag is not None:
            lag = self._loop_lag.lag_since(started)
            if lag > self._settings.loop_lag_tolerance:
                log.warning(
                    "entity %s: a timeout while this replica's event loop ran %.3gs late "
                    "does not count toward failover",
                    key,
                    lag,
                    extra={"entity": key, "loop_lag": lag},
                )
                return False
        return True

    def _record_failure(self, key: str, failure: SendFailure) -> None:
        now = self._clock()
        st = self._store.get(key)
        reason = failure.kind.value
        if st.status == "healthy":
            if self._settings.failover_interval <= 0:
                self._propose(st, "failed_over", reason)
            else:
                self._propose(st, "failing", reason, since=now)
        elif st.status == "failing" and now - st.since >= self._settings.failover_interval:
            self._propose(st, "failed_over", reason)

    def _propose(
        self, st: EntityState, status: Status, reason: str, since: float | None = None
    ) -> None:
        new = self._store.propose(st, status, reason, since=since)
        if new is not None and status == "failed_over":
            self._ledger.emit("failover_start", entity=st.entity, reason=reason)
        elif new is not None and st.status == "failed_over":
            self._ledger.emit("failover_end", entity=st.entity, reason=reason)
        if new is not None:
            _log_transition(st, new, reason)

    async def _to_backlog(
        self,
        entity: EntityRef,
        pair: PairClients,
        messages: Sequence[OutboundMessage],
        cause: SendFailure | None,
        deadline: float,
    ) -> Delivery:
        """Up to `MAX_BACKLOG_ATTEMPTS` backlog queues in turn, all before `deadline` (loop
        time). An attempt cut by the deadline takes no queue out of rotation (the request's
        budget ran out, which says little about the queue), but its write may still complete
        (it may have been handed to a sender), so it is announced as any write is."""
        assert pair.secondary is not None
        self._check_sizes(entity, messages)
        now = self._clock()
        key = entity.path.lower()
        fenced = self._strict(entity) and any(m.session_id for m in messages)
        tokens = [new_fence_token() if fenced and m.session_id else None for m in messages]
        rewritten = [rewrite(m, entity.path, now, t) for m, t in zip(messages, tokens, strict=True)]
        tried: set[str] = set()
        last: SendFailure | None = cause
        for _ in range(MAX_BACKLOG_ATTEMPTS):
            write: _FencedWrite | None = None
            if fenced:
                write = await self._begin_fenced(key, pair, messages, tokens, tried, deadline)
            queue = write.queue if write is not None else None
            if not fenced:
                queue = self._pick_backlog(key, pair, tried)
            if queue is None:
                break
            tried.add(queue)
            try:
                async with asyncio.timeout_at(deadline) as within:
                    await self._dispatcher.send(Destination(pair.secondary, queue), rewritten)
            except TimeoutError:
                if write is not None:  # outcome unknown: answered 503, never counted
                    await self._end_fenced(key, write, ok=False)
                if not within.expired():
                    raise
                self._written(key, queue)
                raise NoBacklogAvailable(
                    f"{entity.path!r} is unavailable at the primary and no backlog queue took "
                    f"the message within the request's {self._budget:g}s deadline",
                    entity=entity.path,
                ) from None
            except BaseException as exc:
                if write is not None:
                    await self._end_fenced(key, write, ok=False)
                if not isinstance(exc, SendFailure):
                    raise
                failure = exc
                _untangle(failure)
                last = failure
                self._observer.backlog_send(queue, False)
                if failure.classification.message_fault:
                    raise  # the message's fault, not the queue's: it stays in rotation
                self._store.disable_backlog(
                    queue,
                    self._clock() + self._settings.backlog_reprobe_interval,
                    failure.kind.value,
                )
                log.warning(
                    "backlog queue %s out of rotation: %s",
                    queue,
                    failure.message,
                    extra={"backlog": queue, "entity": entity.path},
                )
                continue
            if write is not None:
                await self._end_fenced(key, write, ok=True)
            self._observer.backlog_send(queue, True)
            self._written(key, queue)
            return Delivery("backlog", queue)
        detail = f" (last error: {last.message})" if last is not None else ""
        raise NoBacklogAvailable(
            f"{entity.path!r} is unavailable at the primary and no backlog queue could take "
            f"the message{detail}",
            entity=entity.path,
        )

    def _check_sizes(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> None:
        """413 for a message that fits the primary but not a backlog queue."""
        for m in messages:
            size = rewritten_size(m, entity.path)
            if size > self._limits.max_message_bytes:
                raise PayloadTooLarge(
                    f"message {m.message_id!r} fits the primary entity but not a backlog "
                    f"queue: with the failover properties it is {size} bytes, over the "
                    f"{self._limits.max_message_bytes}-byte limit, and the primary is "
                    "unavailable; retry later or send a smaller message",
                    messageId=m.message_id,
                    size=size,
                    limit=self._limits.max_message_bytes,
                )

    async def _begin_fenced(
        self,
        key: str,
        pair: PairClients,
        messages: Sequence[OutboundMessage],
        tokens: Sequence[str | None],
        tried: set[str],
        deadline: float,
    ) -> _FencedWrite | None:
        """Record a fenced write of `messages`' sessions before it starts, in every
        session's fence: the first session's fence chooses the queue (its current one, or
        the first in its ranking in rotation), the others follow it to that queue (a new
        generation where it differs). None: no queue left. Raises `NoBacklogAvailable`
        when the fence store is unreachable (fail closed)."""
        fences = self._fences
        assert fences is not None
        disabled = self._store.backlogs_disabled(self._clock()) | tried
        write_id = uuid.uuid4().hex
        until = self._clock() + (deadline - asyncio.get_running_loop().time())
        until += FENCE_WRITE_MARGIN
        by_session: dict[str, list[str]] = {}
        for m, t in zip(messages, tokens, strict=True):
            if m.session_id is not None and t is not None:
                by_session.setdefault(m.session_id, []).append(t)
        write = _FencedWrite(write_id, "", by_session, [])
        try:
            for session in by_session:
                if not write.queue:
                    ranked = session_ranking(key, session, pair.backlog_queues)
                    avoid: frozenset[str] | set[str] = disabled
                else:
                    ranked = [write.queue]
                    avoid = set(pair.backlog_queues) - {write.queue}
                got = await fences.begin_write(key, session, write_id, ranked, avoid, until)
                if got is None:
                    break
                write.begun.append(session)
                write.queue = write.queue or got[0]
                if got[0] != write.queue:  # cannot happen: `avoid` leaves one queue
                    raise FenceUnavailable(f"session {session!r} was fenced to {got[0]}")
        except FenceUnavailable as exc:
            await self._end_fenced(key, write, ok=False)
            raise NoBacklogAvailable(
                "the primary is not taking this session's messages now and the session "
                f"fence cannot be recorded ({exc}); retry later",
                entity=key,
            ) from None
        if len(write.begun) < len(by_session):
            await self._end_fenced(key, write, ok=False)
            return None
        return write

    async def _end_fenced(self, key: str, write: _FencedWrite, ok: bool) -> None:
        fences = self._fences
        assert fences is not None
        for session in write.begun:
            tokens = write.tokens[session]
            await fences.end_write(key, session, write.write_id, tokens, ok)

    def _written(self, key: str, queue: str) -> None:
        """A backlog write completed: announce it now if the entity is healthy here (the
        failback may already have been checked for), else when it becomes healthy."""
        if self._store.get(key).status == "healthy":
            self._store.announce_backlog_write(queue)
        else:
            self._unannounced.setdefault(key, set()).add(queue)

    def _pick_backlog(self, key: str, pair: PairClients, exclude: set[str]) -> str | None:
        disabled = self._store.backlogs_disabled(self._clock())
        current = self._choice.get(key)
        if current is not None and current not in disabled and current not in exclude:
            return current
        healthy = [q for q in pair.backlog_queues if q not in disabled and q not in exclude]
        if not healthy:
            return None
        choice = self._rng.choice(healthy)
        self._choice[key] = choice
        return choice

    # -- operator actions ----------------------------------------------------------------

    def mark_healthy(self, entity: EntityRef, operator: str | None = None) -> EntityState:
        """The old SDK's MarkPathHealthy: back to the primary at once, cluster-wide.
        `operator` (the admin key's rule name; None in open mode) is named in the log line."""
        st = self._store.get(entity.path.lower())
        if st.status == "healthy":
            return st
        new = self._store.propose(st, "healthy", MARKED_HEALTHY)
        if new is not None and st.status == "failed_over":
            self._ledger.emit("failover_end", entity=st.entity, reason="operator")
        if new is not None:
            _log_transition(st, new, MARKED_HEALTHY, operator=operator or "open mode")
        return new or self._store.get(st.entity)

    def force_failover(self, entity: EntityRef, operator: str | None = None) -> EntityState:
        """Send `entity`'s traffic to the backlog now (pings start), cluster-wide.
        `operator`: as in `mark_healthy`."""
        st = self._store.get(entity.path.lower())
        if st.status == "failed_over":
            return st
        new = self._store.propose(st, "failed_over", FORCED)
        if new is not None:
            self._ledger.emit("failover_start", entity=st.entity, reason="operator")
            _log_transition(st, new, FORCED, operator=operator or "open mode")
        return new or self._store.get(st.entity)

    async def describe(self) -> list[dict[str, Any]]:
        """The admin view: state, since, by whom and why (for a healthy entity after a
        failover: `PING_DELIVERED` or `MARKED_HEALTHY`), backlog rotation, pinger."""
        disabled = self._store.backlogs_disabled(self._clock())
        out: list[dict[str, Any]] = []
        for key, ref in sorted(self._entities.items()):
            st = self._store.get(key)
            pair = self._pairs[ref.pair]
            pinger = (
                await self._store.lease_holder(_lease(key)) if st.status == "failed_over" else None
            )
            out.append(
                {
                    "entity": ref.path,
                    "kind": ref.kind,
                    "state": st.status,
                    "epoch": st.epoch,
                    "since": st.since or None,
                    "by": st.by or None,
                    "reason": st.reason or None,
                    "backlog": self._choice.get(key),
                    "backlogQueues": [
                        {"path": q, "inRotation": q not in disabled} for q in pair.backlog_queues
                    ],
                    "pinger": pinger,
                    "nextPing": self._next_ping.get(key) if st.status == "failed_over" else None,
                    "sessionOrder": ref.session_order or self._settings.session_order,
                    "fencedSessions": self._fenced_sessions(key),
                }
            )
        return out

    def _fenced_sessions(self, key: str) -> dict[str, Any]:
        """How many sessions of entity `key` are fenced, and a bounded sample of them."""
        fenced = self._fences.sessions(key) if self._fences is not None else []
        return {"count": len(fenced), "sample": fenced[:FENCED_SAMPLE]}

    # -- reacting to state changes (local or from other replicas) ------------------------

    def _on_entity(self, st: EntityState) -> None:
        self._observer.entity_state(st.entity, st.status)
        if st.status == "healthy":
            if st.epoch > 0:  # a recovery: failures of sends that began before are stale
                self._fresh[st.entity] = self._dispatcher.clock()
            for queue in sorted(self._unannounced.pop(st.entity, ())):
                self._store.announce_backlog_write(queue)
        if st.status == "failing" and not self._closed and st.entity in self._entities:
            self._arm_failover_timer(st)
        wake = self._wake.get(st.entity)
        if wake is not None:
            wake.set()
        if st.status == "failed_over" and not self._closed:
            task = self._pingers.get(st.entity)
            if (task is None or task.done()) and st.entity in self._entities:
                self._wake[st.entity] = asyncio.Event()
                # A fresh context: started by whichever request saw the failure, the pinger
                # outlives it and is no part of its trace.
                self._pingers[st.entity] = self._tasks.spawn(
                    self._pinger(self._entities[st.entity]),
                    name=f"pinger {st.entity}",
                    context=contextvars.Context(),
                )

    def _arm_failover_timer(self, st: EntityState) -> None:
        """Failover engages when `failover_interval` elapses after t0 with no
        successful send — on a timer, not on the next failure. Every replica that sees the
        failing state arms one; the epoch compare-and-set lets exactly one transition win."""
        old = self._timers.pop(st.entity, None)
        if old is not None:
            old.cancel()
        delay = max(st.since + self._settings.failover_interval - self._clock(), 0.0)

        async def fire() -> None:
            await asyncio.sleep(delay)
            current = self._store.get(st.entity)
            if current.status == "failing" and current.epoch == st.epoch:
                self._propose(
                    current,
                    "failed_over",
                    f"no success within {self._settings.failover_interval:g}s",
                )

        task = self._tasks.spawn(
            fire(), name=f"failover timer {st.entity}", context=contextvars.Context()
        )
        self._timers[st.entity] = task
        task.add_done_callback(
            lambda t: (
                self._timers.pop(st.entity, None) if self._timers.get(st.entity) is t else None
            )
        )

    def _on_backlog(self, b: BacklogState) -> None:
        self._observer.backlog_disabled(len(self._store.backlogs_disabled(self._clock())))

    async def _pinger(self, entity: EntityRef) -> None:
        """`_ping_loop`, supervised (restarted if it raises); forgotten when it ends."""
        key = entity.path.lower()
        try:
            await supervised("pinger", functools.partial(self._ping_loop, entity), self._observer)
        finally:
            self._pingers.pop(key, None)
            self._next_ping.pop(key, None)

    async def _ping_loop(self, entity: EntityRef) -> None:
        """While `entity` is failed over: ping the primary one `ping_primary_interval` after
        the failover began, then every interval, if this replica holds the ping lease; the
        first delivered ping makes it healthy. Returns only when the entity is not failed
        over, with no await between that check and the return (so `_on_entity` never sees
        a finishing pinger it should have replaced)."""
        key = entity.path.lower()
        lease = _lease(key)
        interval = self._settings.ping_primary_interval
        wake = self._wake[key]
        pair = self._pairs[entity.pair]
        last_ping: float | None = None
        holds_lease = False
        ttl = max(3 * interval, 1.0)
        try:
            while True:
                st = self._store.get(key)
                if st.status != "failed_over":
                    if not holds_lease:
                        return
                    holds_lease = False
                    await self._release(lease)
                    continue  # the entity may have failed over again meanwhile
                due = max(st.since, last_ping or st.since) + interval
                self._next_ping[key] = due
                delay = due - self._clock()
                if delay > 0 and last_ping is None and not holds_lease:
                    # Take the lease at the failover, not at the first ping one interval
                    # later: `GET /admin/entities` shows who will ping from the start.
                    holds_lease = await self._store.acquire_lease(lease, ttl=ttl)
                if delay > 0:
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await wake.wait()  # a state change ends the wait early
                    continue
                last_ping = self._clock()
                holds_lease = await self._store.acquire_lease(lease, ttl=ttl)
                if not holds_lease:
                    continue  # another replica pings; look again in one interval
                ok = await self._ping(pair, entity)
                self._observer.ping(entity.path, ok)
                self._ledger.emit("ping", entity=entity.path, ok=ok)
                st = self._store.get(key)
                if ok and st.status == "failed_over":
                    self._propose(st, "healthy", PING_DELIVERED)
        except BaseException:
            if holds_lease:  # let another replica take over at once, not when it expires
                await self._release(lease)
            raise

    async def _release(self, lease: str) -> None:
        try:
            await self._store.release_lease(lease)
        except Exception:  # the store never raises for backend errors; a bug must not
            log.exception("releasing lease %s failed", lease)  # stop the pinger

    async def _ping(self, pair: PairClients, entity: EntityRef) -> bool:
        try:
            await self._dispatcher.send(
                Destination(pair.primary, entity.path),
                [ping_message(uuid.uuid4().hex)],
                limited=False,  # a probe of the broker, not a client's request
            )
        except GatewayError as exc:
            log.info(
                "ping to %s failed: %s", entity.path, exc.message, extra={"entity": entity.path}
            )
            return False
        return True


def _log_transition(
    old: EntityState, new: EntityState, reason: str, operator: str | None = None
) -> None:
    """The one line per state change this replica makes (docs/observability.md); an
    operator's change names who made it (the admin key's rule name)."""
    extra: dict[str, Any] = {
        "entity": old.entity,
        "from": old.status,
        "to": new.status,
        "epoch": new.epoch,
    }
    if operator is None:
        log.warning(
            "entity %s: %s -> %s (%s)", old.entity, old.status, new.status, reason, extra=extra
        )
        return
    extra["operator"] = operator
    log.warning(
        "entity %s: %s -> %s (%s, by %s)",
        old.entity,
        old.status,
        new.status,
        reason,
        operator,
        extra=extra,
    )


@dataclass(slots=True)
class _FencedWrite:
    """A backlog write recorded in its sessions' fences (`Failover._begin_fenced`)."""

    write_id: str
    queue: str
    tokens: dict[str, list[str]]  # session -> its messages' fence tokens
    begun: list[str]  # the sessions whose fence recorded the write


def _untangle(failure: SendFailure) -> None:
    """Drop a broker failure's traceback. Raised in a sender worker, it holds the worker's
    frames, which hold the batch's groups, whose futures hold the failure: a cycle per
    failed request that only the cycle collector frees, with the request's memory. The
    traceback tells the client nothing (the answer is the failure's code and message)."""
    failure.__traceback__ = None


def _lease(key: str) -> str:
    return f"ping:{key}"
