"""The syphon: moves backlogged messages home, honours TTL, costs almost nothing when idle.

For one namespace pair: a task per backlog queue receives in peek-lock from the secondary
namespace (at most one receive per queue in flight), restores each message (SessionId, TTL
and schedule, original path; MessageId kept), sends it to its entity on the primary through
the dispatcher, and **only then** completes it in the backlog; at most `workers` queues move
at once. A message whose original TTL ran out is dead-lettered in the backlog
(``TTLExpiredException``) and never sent. A message for an entity that is still failed over
is abandoned and its queue waits (no hammering).

Idle cost: a queue is polled only while it may hold messages. After an empty receive it is
marked empty; it becomes runnable again when
* an entity comes back to healthy (a failback, from any replica): every queue's backoff is
  cancelled and a depth check (one management call for every backlog queue) follows within
  `MIN_CHECK_SPACING`;
* a replica announces a backlog write that completed once its entity was healthy (see
  `gateway.core.failover`), or any queue after a reconnect of the shared state;
* its retry timer fires (backoff after a broker error or a blocked entity);
* or the slow safety check runs (`idle_check_interval`, 15 min):
about 4 broker operations per hour when nothing is failed over, against the old SDK's 40.

No lost wake-up: a queue woken while its receive or move is in flight looks again at once,
instead of going to sleep on an answer that predates the wake-up. Hence the bound on the
time to home in a healthy system: once an entity is healthy and the write that holds its
message has completed, a syphon receives the message within
``MIN_CHECK_SPACING + receive_wait + send_timeout`` (the depth-check spacing, one receive
that was already waiting, one move that was already under way), whatever
`idle_check_interval` is.

Sessions (docs/failover.md#sessions-keep-their-order): a receive is grouped by (entity,
session); each session's messages go home one at a time in stored order, each completed
only after it is stored at home, and a failure abandons it and every later message of that
session in the receive. A fenced session moves only from the queue, and the receiver, that
holds its oldest acknowledged message, and only that generation's messages
(`FenceStore.movable`); each move is counted in its fence, which lifts when nothing
acknowledged is left. An *unknown* fence (Redis lost its contents) holds every message of
its session until a syphon rebuilds it: it peeks every backlog queue of the pair and puts
the session's messages back in its fence in the order they were acknowledged. Messages
without a session move in parallel, as before.

Effectively once: a crash between the send and the complete redelivers the message; the
MessageId is kept, so an entity with duplicate detection stores it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.config import SyphonSettings, TimeoutSettings
from gateway.core.backlog import (
    BACKLOG_LOCK_DURATION,
    PATH,
    PING_CONTENT_TYPE,
    RestoreError,
    accepted_at,
    restore,
)
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.message import OutboundMessage
from gateway.core.ports import BacklogPort, Clock, NamespaceClient, RealClock, Received, Tracer
from gateway.errors import BrokerFailure, FailureKind, GatewayError, SendFailure
from gateway.ledger import EventLedger, NullLedger
from gateway.lifetimes import CANCEL_GRACE, Backoff, TaskSet, supervised
from gateway.state.base import BacklogState, EntityState, StateStore
from gateway.state.fence import FenceStore, order_found

log = logging.getLogger(__name__)

TTL_EXPIRED = "TTLExpiredException"
NOT_A_BACKLOG_MESSAGE = "NotABacklogMessage"
# A message that cannot go home is dead-lettered in its backlog queue with one of these
# reasons, never retried for ever (backlog queues never dead-letter by delivery count):
RESTORE_FAILED = "RestoreFailed"  # unreadable, a rewrite property wrong, or not our entity
REFUSED_BY_PRIMARY = "RefusedByPrimary"  # the primary refused it for its own sake
MIN_CHECK_SPACING = 1.0  # at most one depth check per second, however many failbacks
# While a backlog may hold messages (the last check saw some, or an entity is not healthy),
# depths are checked this often: the backlog gauges stay fresh for dashboards and alerts.
# Idle (everything healthy and empty) only the safety check runs.
BUSY_CHECK_INTERVAL = 60.0
BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0
RETRY = Backoff(BACKOFF_MIN, BACKOFF_MAX)
# Rebuilding unknown fences peeks every backlog queue: in pages of `PEEK_PAGE`, at most
# `MAX_PEEK` messages a queue (a session's messages past that are ordered by their queue
# alone).
PEEK_PAGE, MAX_PEEK = 250, 20_000


# How the syphon settles a backlog message it does not move or dead-letter.
Settlement = Literal["complete", "abandon"]


@dataclass(frozen=True, slots=True)
class GoesHome:
    """A backlog message to send home: its entity and the message restored for it."""

    entity: str
    message: OutboundMessage
    fence_token: str | None = None  # what its session's fence counts it by


# A received message on its way home: the backlog copy, the restored message, its token.
Item = tuple[Received, OutboundMessage]


class Held(enum.Enum):
    """A backlog message that does not go home now."""

    BLOCKED = "blocked"  # its entity is still failed over: abandoned, retried later
    SETTLED = "settled"  # settled here: a ping completed, or dead-lettered


# `_triage`'s verdict on one received message.
Triage = GoesHome | Held


class SyphonObserver:
    """Metric hooks; the default does nothing."""

    def moved(self, entity: str, n: int) -> None: ...

    def expired(self, entity: str) -> None: ...

    def abandoned(self, n: int) -> None: ...

    def dead_lettered(self, reason: str) -> None: ...

    def operation(self, kind: str) -> None: ...

    def dwell(self, entity: str, seconds: float) -> None:
        """A message moved home `seconds` after the gateway answered 202 for it."""

    def backlog_depths(self, depths: Mapping[str, int]) -> None:
        """Active messages per backlog queue, from a depth check."""

    def backlog_oldest(self, queue: str, accepted_at: float | None) -> None:
        """When the oldest message a receive found at the head of `queue` was accepted
        (unix time); None: the queue was found empty."""

    def task_restarted(self, task: str) -> None:
        """A syphon loop raised and is being restarted (gateway.lifetimes)."""

    def session_move(self, outcome: str) -> None:
        """One session's messages of one receive were moved ("moved"), held back by its
        fence or a failure before them ("waited"), or stopped by a failure ("failed")."""


@dataclass
class SyphonStats:
    moved: int = 0
    expired: int = 0
    abandoned: int = 0
    dead_lettered: int = 0
    operations: Counter[str] = field(default_factory=Counter)


def fence_stamp(
    m: OutboundMessage | None, entities: Collection[str], now: float
) -> tuple[str, str, str, float] | None:
    """A peeked backlog message's (entity key, session, fence token, acceptance time), for
    rebuilding its fence; `entities`: the pair's entity keys (lower case). None if it
    lacks one, or any does not read back, or it is not for one of `entities`: it is then
    ordered by its own queue alone, like a message its fence never counted. Anyone with
    Send on the secondary namespace can write these: nothing here may raise."""
    if m is None:
        return None
    try:
        restored = restore(m, now)
    except Exception:  # RestoreError, or whatever else hostile properties may cause
        return None
    if restored is None or restored.entity_path.lower() not in entities:
        return None
    session, token = restored.message.session_id, restored.fence_token
    at = restored.accepted_at
    if session is None or token is None or at is None:
        return None
    return restored.entity_path.lower(), session, token, at


class Syphon:
    """One pair's syphon. Owned tasks: a supervisor and one loop per backlog queue, all
    cancelled and awaited by `close()`."""

    def __init__(
        self,
        *,
        backlog: BacklogPort,
        queues: Sequence[str],
        dispatcher: Dispatcher,
        primary: NamespaceClient,
        entities: Collection[str],
        store: StateStore | None,
        settings: SyphonSettings,
        timeouts: TimeoutSettings,
        clock: Clock | None = None,
        observer: SyphonObserver | None = None,
        ledger: EventLedger | None = None,
        tracer: Tracer | None = None,
        fences: FenceStore | None = None,
    ) -> None:
        self._backlog = backlog
        self._fences = fences
        self._tracer = tracer or Tracer()
        self._queues = list(queues)
        self._dispatcher = dispatcher
        self._primary = primary
        # The entities this gateway serves in this pair, by lower-case path: the only places
        # a backlog message may be sent (x-ms-path is data anyone with Send can write).
        self._entities = {e.lower(): e for e in entities}
        self._store = store
        self._settings = settings
        self._timeouts = timeouts
        self._clock = clock or RealClock()
        self._observer = observer or SyphonObserver()
        self._ledger: EventLedger = ledger or NullLedger()
        self.stats = SyphonStats()
        self._runnable = {q: asyncio.Event() for q in self._queues}
        self._signals = dict.fromkeys(self._queues, 0)  # wake-ups so far, per queue
        self._expected: set[str] = set()  # a depth check saw messages in these queues
        self._depths: dict[str, int] = {}  # as of the last depth check
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._check_requested = True  # the first pass checks depths
        self._last_check = float("-inf")
        self._sem = asyncio.Semaphore(settings.workers)
        self._tasks = TaskSet("syphon")  # its loops, and a reset of the receivers
        self._reset_task: asyncio.Task[None] | None = None  # closing receivers after a fault
        self._reset_wanted = False
        self._rebuilding = asyncio.Lock()  # one rebuild of unknown fences at a time
        self._moving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self.last_fault: float | None = None  # when a namespace fault was last seen
        self.fault_seen = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._store is not None:
            self._store.subscribe(self._on_entity, self._on_backlog, self._on_write)
        observer = self._observer
        self._tasks.spawn(
            supervised("syphon_supervisor", self._supervise, observer), name="syphon supervisor"
        )
        for q in self._queues:
            loop = functools.partial(self._queue_loop, q)
            self._tasks.spawn(supervised("syphon_queue", loop, observer), name=f"syphon {q}")

    async def close(self, grace: float) -> None:
        """Let moves in flight finish for up to `grace` seconds, then cancel and await every
        task (within `CANCEL_GRACE`, + as much again for a lost cancel). Nothing is completed
        in a backlog unless its send succeeded."""
        self._stopping = True
        for ev in self._runnable.values():
            ev.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self._idle.wait()  # moves in flight finish
        await self._tasks.stop(CANCEL_GRACE)
        self._reset_task = None
        await self._backlog.close()

    def request_check(self) -> None:
        """Ask for a depth check soon (e.g. a failback was seen)."""
        self._check_requested = True
        self._wake.set()

    # -- state events --------------------------------------------------------------------

    def _on_entity(self, st: EntityState) -> None:
        if st.status != "healthy":
            self._wake.set()  # the supervisor re-plans: depths are checked while busy
            return
        # A failback: what waited for it may be movable now. The queues that hold its
        # messages may be backing off because it was failed over; none must wait for a
        # timer now.
        self._retry_at.clear()
        self._backoff.clear()
        self.request_check()

    def _on_backlog(self, b: BacklogState) -> None:
        return None

    def _on_write(self, queue: str | None) -> None:
        if queue is None:
            self.request_check()
        elif queue in self._runnable:
            self._signal(queue)

    def _signal(self, queue: str) -> None:
        """Make `queue` runnable now, and let a receive or move in flight know it must look
        again rather than sleep (see `_queue_loop`)."""
        if self._stopping:
            return
        self._signals[queue] += 1
        self._retry_at.pop(queue, None)
        self._runnable[queue].set()

    # -- supervisor ----------------------------------------------------------------------

    async def _supervise(self) -> None:
        next_safety = self._clock.now() + self._settings.idle_check_interval
        while not self._stopping:
            now = self._clock.now()
            for q, at in list(self._retry_at.items()):
                if at <= now:
                    del self._retry_at[q]
                    self._runnable[q].set()
            if now >= next_safety:
                self._check_requested = True
                next_safety = now + self._settings.idle_check_interval
            busy_at = self._last_check + BUSY_CHECK_INTERVAL if self._busy() else float("inf")
            if now >= busy_at:
                self._check_requested = True
            if self._check_requested and now - self._last_check >= MIN_CHECK_SPACING:
                self._check_requested = False
                self._last_check = now
                await self._depth_check()
                continue
            wake_at = min([next_safety, busy_at, *self._retry_at.values()])
            if self._check_requested:
                wake_at = min(wake_at, self._last_check + MIN_CHECK_SPACING)
            self._wake.clear()
            await self._clock.wait(self._wake, max(wake_at - self._clock.now(), 0.0))

    async def _depth_check(self) -> None:
        self._op("depth_check")
        try:
            async with asyncio.timeout(self._timeouts.connect_timeout):
                depths = await self._backlog.depths(self._queues)
        except TimeoutError:
            depths = None
        if depths is not None:
            self._depths = {q: depths.get(q, 0) for q in self._queues}
            self._observer.backlog_depths(self._depths)
            if self._fences is not None and not any(self._depths.values()):
                # Every backlog queue of the pair is empty: a fence whose contents were lost
                # holds nothing back any more.
                await self._fences.backlog_empty(list(self._entities))
        for q in self._queues:
            if q in self._retry_at:
                continue
            if depths is None or depths.get(q, 0) > 0:
                if depths is not None:
                    self._expected.add(q)
                self._signal(q)

    def _busy(self) -> bool:
        """A backlog may hold messages: the last check saw some, or an entity is not
        healthy (its messages may be arriving in a backlog now)."""
        if any(self._depths.values()):
            return True
        return self._store is not None and any(
            s.status != "healthy" for s in self._store.snapshot().values()
        )

    # -- moving --------------------------------------------------------------------------

    async def _queue_loop(self, path: str) -> None:
        runnable = self._runnable[path]
        while True:
            await runnable.wait()
            if self._stopping:
                return
            seen = self._signals[path]
            expected = path in self._expected
            self._expected.discard(path)
            self._moving += 1
            self._idle.clear()
            try:
                outcome = await self._move_once(path)
            finally:
                self._moving -= 1
                if self._moving == 0:
                    self._idle.set()
            if outcome == "moved":
                self._backoff.pop(path, None)
                continue
            if self._signals[path] != seen:
                continue  # woken meanwhile: this answer may predate what woke it
            runnable.clear()
            if outcome == "empty" and expected:
                # A depth check counted messages this receive could not get: another
                # receiver holds their locks (one that died mid-move, say). They come back
                # when the lock expires: look again then, not at the next safety check.
                self._recheck(path, self._clock.now() + BACKLOG_LOCK_DURATION + 1.0)
            elif outcome in {"blocked", "failed"}:
                delay = RETRY.next(self._backoff.get(path))
                if outcome == "blocked":
                    delay = max(delay, self._settings.receive_wait)
                self._backoff[path] = delay
                self._retry_at[path] = self._clock.now() + delay
                self._wake.set()

    async def _move_once(self, path: str) -> str:
        """One receive and the moves it allows: "empty", "moved", "blocked" (a target is
        still failed over) or "failed" (a broker error: back off). The receive runs outside
        the worker pool (one per queue at most), so a queue's messages start home without
        waiting for other queues' moves; the moves take a worker."""
        self._op("receive")
        try:
            async with asyncio.timeout(self._settings.receive_wait + self._timeouts.send_timeout):
                received = await self._backlog.receive(
                    path, self._settings.max_batch, self._settings.receive_wait
                )
        except (BrokerFailure, TimeoutError) as exc:
            self._fault(path, exc)
            return "failed"
        oldest = min(
            (t for r in received if (t := accepted_at(r.message)) is not None), default=None
        )
        self._observer.backlog_oldest(path, oldest)
        if not received:
            return "empty"
        async with self._sem:
            return await self._move_received(path, received)

    async def _move_received(self, path: str, received: list[Received]) -> str:
        now = self._clock.now()
        groups: dict[str, list[tuple[Received, OutboundMessage]]] = {}
        # Session messages, per (entity, session), in stored order; their fence tokens.
        chains: dict[tuple[str, str], list[Item]] = {}
        tokens: dict[int, str] = {}  # id(received) -> its fence token
        held_back: set[str] = set()  # entities held back in this receive
        blocked = False
        # In stored order: a receive that follows an abandon may hand messages back in
        # another (seen on the local broker: a session's abandoned messages came back last
        # first). Stable: without sequence numbers, the order received.
        received = sorted(received, key=lambda r: (r.sequence is None, r.sequence or 0))
        for r in received:
            try:  # per message: one that cannot go home never holds up the others
                triaged = await self._triage(path, r, now, held_back)
            except Exception as exc:
                log.exception("syphon: a message in %s could not be read back", path)
                reason = f"{type(exc).__name__}: {exc}"[:1000]
                await self._dead_letter(path, r, RESTORE_FAILED, reason)
                continue
            if isinstance(triaged, GoesHome):
                session = triaged.message.session_id
                if session is None:
                    groups.setdefault(triaged.entity, []).append((r, triaged.message))
                    continue
                chains.setdefault((triaged.entity, session), []).append((r, triaged.message))
                if triaged.fence_token is not None:
                    tokens[id(r)] = triaged.fence_token
            elif triaged is Held.BLOCKED:
                blocked = True
        failed = False
        for entity, items in groups.items():
            if not await self._move(path, entity, items):
                failed = True
        outcomes = await asyncio.gather(
            *(self._move_session(path, e, s, items, tokens) for (e, s), items in chains.items())
        )
        if "failed" in outcomes:
            failed = True
        if "waited" in outcomes:
            blocked = True
        if failed:
            return "failed"
        return "blocked" if blocked else "moved"

    async def _move_session(
        self, path: str, entity: str, session: str, items: list[Item], tokens: dict[int, str]
    ) -> str:
        """Move one session's messages of one receive home, one at a time in stored order,
        as many as its fence allows (a prefix: `FenceStore.movable`; the rest abandoned).
        "moved"; "waited" (its fence holds them all back: abandoned, the queue waits; an
        unknown fence is rebuilt from the backlog first); or "failed" (a move failed: it
        and every later one abandoned, never sent first)."""
        key = entity.lower()
        fences = self._fences
        n = len(items)
        if fences is not None:
            n = await fences.movable(key, session, path, [tokens.get(id(r)) for r, _ in items])
        if n == 0:
            await self._abandon_all(path, items)
            self._observer.session_move("waited")
            if fences is not None and await fences.unknown(key, session):
                await self._rebuild_fences(fences)
            return "waited"
        for i, item in enumerate(items[:n]):
            if not await self._move(path, entity, [item]):
                await self._abandon_all(path, items[i + 1 :])
                self._observer.session_move("failed")
                return "failed"
            token = tokens.get(id(item[0]))
            if fences is not None and token is not None:
                await fences.moved(key, session, [token])
        await self._abandon_all(path, items[n:])  # a later generation's: after another queue's
        self._observer.session_move("moved")
        return "moved"

    async def _rebuild_fences(self, fences: FenceStore) -> None:
        """Unknown fences (Redis lost their contents) are rebuilt from the backlog: every
        backlog queue of the pair is peeked (locked messages included, up to `MAX_PEEK`
        each), and each fenced session found gets its messages back in its fence, in the
        order they were acknowledged (`order_found`: stored order per queue, the queues
        merged by acceptance time). One pass at a time; a pass that cannot peek every
        queue rebuilds nothing (the fences stay unknown: the next wait tries again)."""
        if self._rebuilding.locked():
            return  # one pass is under way; a session it missed waits for the next
        async with self._rebuilding:
            found: dict[tuple[str, str], dict[str, list[tuple[str, float]]]] = {}
            seen: set[tuple[str, str, str]] = set()  # (entity, session, token): once each
            for q in self._queues:
                start, count = 1, 0
                while count < MAX_PEEK:
                    self._op("peek")
                    try:
                        async with asyncio.timeout(self._timeouts.send_timeout):
                            page = await self._backlog.peek(q, start, PEEK_PAGE)
                    except (BrokerFailure, TimeoutError) as exc:
                        log.warning("syphon: cannot peek %s to rebuild fences: %s", q, exc)
                        return
                    if not page:
                        break
                    count += len(page)
                    for seq, m in page:
                        start = max(start, seq + 1)
                        stamp = fence_stamp(m, self._entities, self._clock.now())
                        if stamp is not None and stamp[:3] not in seen:
                            seen.add(stamp[:3])
                            entity, session, token, at = stamp
                            found.setdefault((entity, session), {}).setdefault(q, []).append(
                                (token, at)
                            )
            for (entity, session), queues in found.items():
                if fences.fenced(entity, session):
                    await fences.rebuild(entity, session, order_found(queues))
        for q in self._queues:
            self._signal(q)  # what waited for a rebuilt fence may move now

    async def _abandon_all(self, path: str, items: list[Item]) -> None:
        for r, _ in items:
            await self._settle(path, r, "abandon")
        if items:
            self.stats.abandoned += len(items)
            self._observer.abandoned(len(items))

    def _failed_over(self, entity: str) -> bool:
        state = self._store.get(entity.lower()) if self._store else None
        return state is not None and state.status == "failed_over"

    async def _triage(self, path: str, r: Received, now: float, blocked: set[str]) -> Triage:
        """Where backlog message `r` goes: `GoesHome` (its entity and the restored message),
        `Held.BLOCKED` (its entity is still failed over: abandoned) or `Held.SETTLED` (settled
        here: a ping, or dead-lettered because it cannot or must not go home)."""
        if r.unreadable is not None:
            await self._dead_letter(path, r, RESTORE_FAILED, r.unreadable)
            return Held.SETTLED
        if r.message.content_type == PING_CONTENT_TYPE:
            await self._settle(path, r, "complete")
            return Held.SETTLED
        try:
            restored = restore(r.message, now)
        except RestoreError as exc:
            await self._dead_letter(path, r, RESTORE_FAILED, str(exc))
            return Held.SETTLED
        if restored is None:
            await self._dead_letter(path, r, NOT_A_BACKLOG_MESSAGE, f"no {PATH} property")
            return Held.SETTLED
        entity = self._entities.get(restored.entity_path.lower())
        if entity is None:
            await self._dead_letter(
                path,
                r,
                RESTORE_FAILED,
                f"{PATH} {restored.entity_path[:200]!r} names no entity this gateway serves "
                "in this namespace pair",
            )
            return Held.SETTLED
        if restored.expired:
            await self._dead_letter(
                path,
                r,
                TTL_EXPIRED,
                f"the message's time to live ran out in the backlog before it could be "
                f"moved to {entity}",
            )
            self.stats.expired += 1
            self._observer.expired(entity)
            await self._gone(entity, restored.message.session_id, restored.fence_token)
            self._ledger.emit(
                "expired",
                message_id=r.message.message_id,
                entity=entity,
                backlog=path,
                size=r.message.size,
            )
            return Held.SETTLED
        if entity in blocked or self._failed_over(entity):
            # Once one message of an entity is held back, every later one in this receive
            # is too (the state may change between two): no session's later message first.
            blocked.add(entity)
            await self._settle(path, r, "abandon")
            return Held.BLOCKED
        return GoesHome(entity, restored.message, restored.fence_token)

    async def _move(
        self, path: str, entity: str, items: list[tuple[Received, OutboundMessage]]
    ) -> bool:
        """Send `items` home, each as its own request (the dispatcher batches them, and
        bisects a batch the primary refuses for one message's sake), then settle each by
        its own outcome: complete, dead-letter (`REFUSED_BY_PRIMARY`) or abandon. False if
        any was abandoned (back off)."""
        await self._renew_if_needed(path, [r for r, _ in items])
        # The remaining TTL is computed again now, at send time: time passed since receive.
        fresh: list[tuple[Received, OutboundMessage]] = []
        now = self._clock.now()
        for r, _ in items:
            try:
                again = restore(r.message, now)
            except RestoreError as exc:  # it restored a moment ago; the clock cannot break it
                await self._dead_letter(path, r, RESTORE_FAILED, str(exc))
                continue
            if again is None or again.expired:
                await self._dead_letter(path, r, TTL_EXPIRED, "the time to live ran out")
                self.stats.expired += 1
                self._observer.expired(entity)
                continue
            fresh.append((r, again.message))
        items = fresh
        if not items:
            return True
        self._op("send")
        moved = [m for _, m in items]
        dest = Destination(self._primary, entity)
        # The move span (tracing on) links to each message's original context; the
        # messages keep theirs: they arrive home with it, not with the move's.
        with self._tracer.moving(entity, path, [m.application_properties for m in moved]):
            outcomes = await asyncio.gather(
                # Not limited by the adaptive admission: a refused move would be abandoned,
                # and each abandon brings a message nearer its MaxDeliveryCount.
                *(self._dispatcher.send(dest, [m], limited=False) for m in moved),
                return_exceptions=True,
            )
        home: list[tuple[Received, OutboundMessage]] = []
        failed: list[tuple[Received, BaseException]] = []
        for (r, m), outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                home.append((r, m))
            elif isinstance(outcome, SendFailure) and outcome.classification.message_fault:
                await self._dead_letter(
                    path,
                    r,
                    REFUSED_BY_PRIMARY,
                    f"{entity} refused the message: {outcome.message}"[:1000],
                )
            elif isinstance(outcome, asyncio.CancelledError):
                raise outcome
            else:
                failed.append((r, outcome))
        if failed:
            first = failed[0][1]
            log.warning(
                "syphon: moving %d message(s) to %s failed: %s",
                len(failed),
                entity,
                first.message if isinstance(first, GatewayError) else repr(first),
                extra={"entity": entity, "backlog": path},
            )
            for r, _ in failed:
                await self._settle(path, r, "abandon")
            self.stats.abandoned += len(failed)
            self._observer.abandoned(len(failed))
            failure = next((e for _, e in failed if isinstance(e, SendFailure)), None)
            if failure is not None:
                self._fault(path, failure)
        if home:
            await self._arrived(path, entity, home)
        return not failed

    async def _arrived(
        self, path: str, entity: str, items: list[tuple[Received, OutboundMessage]]
    ) -> None:
        """`items` were stored at the primary: complete them in the backlog, only now."""
        home = self._clock.now()
        for r, m in items:
            await self._settle(path, r, "complete")
            accepted = accepted_at(r.message)
            if accepted is not None:
                self._observer.dwell(entity, max(home - accepted, 0.0))
            self._ledger.emit(
                "syphoned",
                message_id=m.message_id,
                entity=entity,
                route="primary",
                backlog=path,
                size=m.size,
            )
        self.stats.moved += len(items)
        self._observer.moved(entity, len(items))
        log.info(
            "syphon: moved %d message(s) to %s",
            len(items),
            entity,
            extra={
                "entity": entity,
                "backlog": path,
                "message_ids": [m.message_id for _, m in items][:20],
            },
        )

    async def _gone(self, entity: str, session: str | None, token: str | None) -> None:
        """A fenced message that will never go home (expired): its fence stops waiting."""
        if self._fences is not None and session is not None and token is not None:
            await self._fences.moved(entity.lower(), session, [token])

    async def _renew_if_needed(self, path: str, items: list[Received]) -> None:
        margin = self._timeouts.send_timeout + 5.0
        now = self._clock.now()
        for r in items:
            if r.locked_until is not None and r.locked_until - now < margin:
                self._op("renew_lock")
                with contextlib.suppress(BrokerFailure, TimeoutError):
                    async with asyncio.timeout(self._timeouts.send_timeout):
                        await self._backlog.renew(path, r)

    async def _settle(self, path: str, r: Received, how: Settlement) -> None:
        self._op(how)
        try:
            async with asyncio.timeout(self._timeouts.send_timeout):
                if how == "complete":
                    await self._backlog.complete(path, r)
                else:
                    await self._backlog.abandon(path, r)
        except (BrokerFailure, TimeoutError) as exc:
            # A complete that fails leaves the message to be redelivered (and deduplicated
            # by MessageId at the primary); an abandon that fails lets the lock expire.
            # Either way it reappears when its lock expires: look at the queue again then.
            log.warning("syphon: %s in %s failed: %s", how, path, exc)
            self._recheck(path, (r.locked_until or self._clock.now()) + 1.0)

    def _recheck(self, path: str, at: float) -> None:
        """Make `path` runnable again at `at` (unix time), whatever receives say meanwhile."""
        current = self._retry_at.get(path)
        self._retry_at[path] = at if current is None else min(current, at)
        self._wake.set()

    async def _dead_letter(self, path: str, r: Received, reason: str, description: str) -> None:
        self._op("dead_letter")
        try:
            async with asyncio.timeout(self._timeouts.send_timeout):
                await self._backlog.dead_letter(path, r, reason, description)
        except (BrokerFailure, TimeoutError) as exc:
            log.warning("syphon: dead-letter in %s failed: %s", path, exc)
            return
        self.stats.dead_lettered += 1
        self._observer.dead_lettered(reason)
        if reason in {RESTORE_FAILED, REFUSED_BY_PRIMARY, NOT_A_BACKLOG_MESSAGE}:
            log.warning(
                "syphon: dead-lettered %s in %s (%s): %s",
                r.message.message_id,
                path,
                reason,
                description,
                extra={"backlog": path, "reason": reason},
            )
        if reason != TTL_EXPIRED:  # expiries are recorded as "expired"
            self._ledger.emit(
                "dead_lettered", message_id=r.message.message_id, backlog=path, reason=reason
            )

    def _fault(self, path: str, exc: BaseException) -> None:
        """A namespace fault (docs/design.md#faults-and-closing): close every backlog
        receiver within 5 seconds — the partner of a failed primary or secondary — so that
        nothing stays locked; the retry timers reopen them with backoff."""
        kind = exc.kind if isinstance(exc, BrokerFailure) else FailureKind.TIMEOUT
        if kind not in {FailureKind.CONNECTION, FailureKind.TIMEOUT, FailureKind.UNAUTHORIZED}:
            return
        self.last_fault = self._clock.now()
        self.fault_seen.set()
        # One reset at a time, owned by close(): a fault during a reset asks for one more
        # (receivers reopened meanwhile are closed too), and nothing is kept once it ends —
        # a task per fault, kept for ever, grew by ~9 MB a day while a namespace was away.
        self._reset_wanted = True
        if self._reset_task is None or self._reset_task.done():
            self._reset_task = self._tasks.spawn(
                self._reset_receivers(), name="syphon: close receivers after a fault"
            )

    async def _reset_receivers(self) -> None:
        """Close every backlog receiver, each pass within 5 s, until no fault asks again."""
        while self._reset_wanted and not self._stopping:
            self._reset_wanted = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self._backlog.reset()

    def _op(self, kind: str) -> None:
        self.stats.operations[kind] += 1
        self._observer.operation(kind)
