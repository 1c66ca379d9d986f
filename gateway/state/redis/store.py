"""Failover state shared by every replica through Redis, with memory as the source of reads.

Layout under `{<prefix>}:` (default `{sbgate}:`; the braces make the prefix a Redis Cluster
hash tag, so every key and the events channel live in one slot and every script is
single-slot — on a cluster, under both Azure Managed Redis policies, and on one server):

* `entity:<entity>` — a hash per entity: `status`, `epoch`, `since`, `by`, `reason`;
* `backlog:<queue>` — a hash (`until`, `by`, `reason`) that expires when the disable ends;
* `lease:<name>` — the holder's replica id, set `NX PX ttl`;
* `dataset` — the dataset mark: a random id that the first resync to find it missing sets
  (`SET NX`), so it exists exactly as long as the data written since;
* `events` — the pub/sub channel every applied change is published on (JSON), and the
  announcements that a backlog queue holds messages the syphon may move now (a sharded
  channel in cluster mode: see `gateway.state.connect`).

Every change is one Lua script, so "check, write, publish" is atomic: a transition applies
only if the stored epoch is still the one the proposal was built on (compare-and-set); a
restore applies only if Redis lacks the entity or holds something older. The loser of a
CAS race adopts what Redis holds, so all replicas converge on the first writer.

Hot path: `get`, `snapshot`, `propose`, `backlogs_disabled`, `disable_backlog` and
`enable_backlog` read and write memory only; persisting is the owned writer task's job
(pending writes coalesce by key: only the newest state of an entity is written).

Failure: every Redis call has our own deadline (`op_timeout`). Any failed call marks the
session broken: `connected` turns False, the supervisor task tears the connections down and
reconnects with capped exponential backoff, and each new session subscribes, then reads
everything and merges it with memory (resync) before it writes again. Meanwhile the replica
keeps working on memory (fail open) and no Redis error reaches a caller.

Redis can lose its data under a connection that stays up (a restart the connection pool
reconnects through before the subscriber notices, a failover to an empty replica behind a
proxy, a FLUSHALL): reads then find nothing, which must not pass for "nothing there". Each
session remembers the dataset mark it resynced against; every fence script checks it first
and refuses if it changed (a lost fence is no lifted fence), and the subscriber compares it
every `health_interval`. Either breaks the session: reconnect and resync, which writes
memory back (`stats.data_losses` counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from redis.exceptions import RedisError, ResponseError

from gateway.lifetimes import Backoff, TaskObserver, TaskSet, supervised
from gateway.state.base import BacklogState, EntityState, StateStore, Status
from gateway.state.connect import Client, RedisTarget, Subscriber
from gateway.state.memory import LocalState
from gateway.state.redis.fences import RedisFences
from gateway.state.redis.session import Session, SessionBroken
from gateway.state.redis.values import (
    Invalid,
    backlog_event,
    backlog_from_hash,
    entity_event,
    entity_from_hash,
    event_state,
    written_event,
)

# Reconnecting to Redis: jittered, so that replicas do not stampede a restarted Redis.
RECONNECT = Backoff(0.1, 2.0, jitter=0.25)

log = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

# What a failed Redis call can raise (besides our own deadline's TimeoutError).
_REDIS_ERRORS = (RedisError, OSError, TimeoutError)

# The dataset mark: set it if absent, return what Redis holds. Anything there but a string
# of at most `MARK_MAX` bytes is damage (or hostile) and is replaced: another type would
# fail every check, and a long string would ride on every fence script, which carries it.
MARK_MAX = 64
MARK_LUA = f"""
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and (t ~= 'string' or redis.call('STRLEN', KEYS[1]) > {MARK_MAX}) then
  redis.call('DEL', KEYS[1])
end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""

# How soon to try again when fetching fresh credentials failed (the old ones still work).
_RENEW_RETRY = 10.0


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStateStore(LocalState):
    """The `StateStore` for several replicas sharing Redis (see the module docstring).

    `op_timeout` bounds every Redis round trip; `reconnect_backoff` is the reconnect delay
    (`RECONNECT`: jittered); `health_interval` is how long the subscriber may hear nothing
    before it pings (a stalled Redis is then detected within `health_interval + op_timeout`);
    `resync_timeout` bounds a whole resync (default `5 * op_timeout`); `max_pending` bounds
    the write queue (distinct keys; on overflow the write is dropped, counted, and a full
    resync is scheduled, which writes memory back where Redis is older).
    """

    def __init__(
        self,
        url: str | RedisTarget,
        replica_id: str,
        *,
        prefix: str = "sbgate",
        op_timeout: float = 1.0,
        reconnect_backoff: Backoff = RECONNECT,
        clock: Callable[[], float] = time.time,
        health_interval: float = 1.0,
        resync_timeout: float | None = None,
        max_pending: int = 10_000,
    ) -> None:
        super().__init__(replica_id, clock)
        if op_timeout <= 0 or health_interval <= 0 or max_pending < 1:
            raise ValueError("op_timeout, health_interval and max_pending must be positive")
        self._target = url if isinstance(url, RedisTarget) else RedisTarget(url)
        self._prefix = prefix
        self._channel = f"{{{prefix}}}:events"
        # The untagged layout, read once (a cluster never held it: its writes met MOVED).
        self._legacy_head: str | None = f"{prefix}:" if self._target.mode != "cluster" else None
        self._op_timeout = op_timeout
        self._backoff = reconnect_backoff
        self._health_interval = health_interval
        self._tick = min(0.1, health_interval)  # how soon the subscriber notices `_broken`
        self._resync_timeout = resync_timeout if resync_timeout is not None else 5 * op_timeout
        self._max_pending = max_pending
        # Writes not yet in Redis, coalesced by key: entity -> the epoch its chain of local
        # proposals was built on (the CAS base); queue -> True (disable) / False (enable).
        self._pending_entities: dict[str, int] = {}
        self._pending_backlogs: dict[str, bool] = {}
        # Backlog-write announcements not yet published (a set: one per queue is enough).
        self._pending_writes: dict[str | None, None] = {}
        self._resync_needed = False
        self._sess: Session | None = None
        self._online = asyncio.Event()  # a session is up and resynced
        self._broken = asyncio.Event()  # a call failed: the supervisor must reconnect
        self._wake = asyncio.Event()  # the writer has (or may have) something to do
        self._drained = asyncio.Event()  # the writer found nothing left to write
        self._first_attempt = asyncio.Event()
        self._sessions = 0
        # Sessions replaced before their credentials expired (`_renew`), not counted as
        # reconnects: the replica stayed online.
        self.renewals = 0
        self._tasks = TaskSet(f"state store {replica_id}")  # the supervisor and the writer
        # Told when the writer or the supervisor raised and is restarted (metrics; set by
        # the app before `start`).
        self.task_observer: TaskObserver | None = None
        # Session fences, shared through this store's connection and channel.
        self.fences = RedisFences(self, clock)

    # -- StateStore: lifecycle --------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._online.is_set()

    async def start(self) -> None:
        """Start the supervisor and writer tasks and wait (bounded) for the first attempt
        to connect and resync. Never raises because Redis is down or slow: the supervisor
        keeps retrying in the background. Calling it twice is a no-op."""
        if self._tasks:
            return
        self._bind_loop()
        self._first_attempt.clear()
        observer = self.task_observer
        self._tasks.spawn(
            supervised("state_supervisor", self._supervise, observer),
            name=f"state-supervisor-{self.replica_id}",
        )
        self._tasks.spawn(
            supervised("state_writer", self._write_loop, observer),
            name=f"state-writer-{self.replica_id}",
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2 * self._op_timeout + self._resync_timeout):
                await self._first_attempt.wait()

    async def close(self) -> None:
        """Give the writer up to `op_timeout` to flush pending writes (only if connected),
        then cancel and await both tasks (bounded) and drop the connections. Never raises;
        state not flushed stays only in this replica's memory, which is going away."""
        if not self._tasks:
            return
        if self._online.is_set() and self._has_pending():
            self._drained.clear()
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._op_timeout):
                    await self._drained.wait()
        # The supervisor's teardown has its own deadlines; this bound is a backstop, and a
        # task whose cancel was lost is cancelled again (`TaskSet.stop`, as every owner closes).
        await self._tasks.stop(3 * self._op_timeout)
        self._online.clear()
        self._sess = None
        try:
            async with asyncio.timeout(self._op_timeout):
                await self._target.aclose()
        except Exception as exc:  # an identity library's close; nothing left to protect
            log.debug("state: closing the redis credentials: %r", exc)

    # -- StateStore: hot path (memory only) -------------------------------------------------

    def propose(
        self, current: EntityState, status: Status, reason: str, since: float | None = None
    ) -> EntityState | None:
        base = self.get(current.entity).epoch
        new = self._propose_local(current, status, reason, since)
        if new is not None and new.entity not in self._pending_entities:
            # Already pending: keep the older base, the chain of proposals starts there.
            if self._room_for_one():
                self._pending_entities[new.entity] = base
            self._wake_writer()
        return new

    def disable_backlog(self, queue: str, until: float, reason: str) -> None:
        if self._disable_local(queue, until, reason) is not None:
            self._queue_backlog(queue, True)

    def enable_backlog(self, queue: str) -> None:
        self._enable_local(queue)
        # Sent even if memory had nothing: Redis may hold a disable this replica missed.
        self._queue_backlog(queue, False)

    def announce_backlog_write(self, queue: str | None) -> None:
        self._notify_write(queue)
        # Not state: nothing to coalesce with but itself, and never dropped for room (one
        # entry per backlog queue at most).
        self._pending_writes[queue] = None
        self._wake_writer()

    # -- StateStore: leases (network, bounded) ----------------------------------------------

    async def acquire_lease(self, name: str, ttl: float) -> bool:
        sess = self._sess
        if sess is None:
            return True  # fail open: better two pingers than none
        try:
            async with asyncio.timeout(self._op_timeout):
                got = await sess.acquire(
                    keys=[self._key("lease", name)],
                    args=[self.replica_id, max(1, round(ttl * 1000))],
                    client=sess.client,
                )
        except _REDIS_ERRORS as exc:
            self._call_failed(sess, "acquire_lease", exc)
            return True
        return bool(got)

    async def release_lease(self, name: str) -> None:
        sess = self._sess
        if sess is None:
            return  # it expires by itself
        try:
            async with asyncio.timeout(self._op_timeout):
                await sess.release(
                    keys=[self._key("lease", name)], args=[self.replica_id], client=sess.client
                )
        except _REDIS_ERRORS as exc:
            self._call_failed(sess, "release_lease", exc)

    async def lease_holder(self, name: str) -> str | None:
        sess = self._sess
        if sess is None:
            return None
        key = self._key("lease", name)
        try:
            async with asyncio.timeout(self._op_timeout):
                holder = await sess.client.get(key)
        except ResponseError as exc:  # a key of another type: the next acquire repairs it
            self._invalid("lease", key, exc)
            return None
        except _REDIS_ERRORS as exc:
            self._call_failed(sess, "lease_holder", exc)
            return None
        return cast(str | None, holder)

    # -- memory changes from elsewhere ------------------------------------------------------

    def _adopt_entity(self, state: EntityState) -> None:
        # Whatever was pending for this entity was built on a state the cluster replaced.
        self._pending_entities.pop(state.entity, None)
        super()._adopt_entity(state)

    def _on_event(self, data: str | bytes) -> None:
        """Apply one pub/sub event to memory if it is newer (sync: no await in between).
        An event that is not one we could have published is counted and ignored."""
        try:
            raw = orjson.loads(data)
            if isinstance(raw, dict) and raw.get("kind") == "fence":
                self.fences.on_event(raw)
                return
            event = event_state(raw)
        except ValueError as exc:  # orjson's errors and `Invalid` are ValueErrors
            self._invalid("event", self._channel, f"{str(data)[:200]!r}: {exc}")
            return
        if isinstance(event, EntityState):
            self._on_entity_event(event)
        elif isinstance(event, BacklogState):
            self._on_backlog_event(event)
        else:
            queue, by = event
            if by != self.replica_id:  # our own listeners heard it already
                self._notify_write(queue)

    def _invalid(self, source: str, key: str, problem: object) -> None:
        """Count and log a value read from Redis that does not parse (`source` is one of
        `INVALID_VALUE_SOURCES`); the caller skips it, or writes over it."""
        counts = self.stats.invalid_values
        counts[source] = counts.get(source, 0) + 1
        log.warning(
            "state: ignoring an invalid value in redis at %s (%s): %s", key, source, problem
        )

    def _parsed_or_none(
        self,
        kind: str,
        name: str,
        h: Mapping[str, str] | BaseException | None,
        parse: Callable[[str, Mapping[str, str]], T],
    ) -> T | None:
        """A hash a resync read (`kind` entity or backlog), parsed; None if absent, or if
        invalid (logged and counted): then treated as absent, so that memory, if it holds
        the entity or queue, is written back over it."""
        if not h:
            return None
        key = self._key(kind, name)
        if isinstance(h, BaseException):  # the key is of another type
            self._invalid("resync", key, h)
            return None
        try:
            return parse(name, h)
        except Invalid as exc:
            self._invalid("resync", key, exc)
            return None

    def _entity_from_reply(self, entity: str, reply: list[Any]) -> EntityState | None:
        """The stored state a script returned with {0, ...}, or None if Redis had none (or
        an invalid one, which the scripts report as none)."""
        if len(reply) < 6:
            return None
        _, epoch, status, since, by, reason = reply[:6]
        h = {"epoch": epoch, "status": status, "since": since, "by": by, "reason": reason}
        try:
            return entity_from_hash(entity, h)
        except Invalid as exc:
            self._invalid("reply", self._key("entity", entity), exc)
            return None

    def _on_entity_event(self, s: EntityState) -> None:
        held = self._entities.get(s.entity)
        if held is None or s.newer_than(held):
            self._adopt_entity(s)
        elif s != held:
            self.stats.events_stale += 1
        # s == held: our own transition coming back, or a duplicate.

    def _on_backlog_event(self, b: BacklogState) -> None:
        if b.queue in self._pending_backlogs:
            return  # our own later change is on its way to Redis and will be published
        held = self._backlogs.get(b.queue)
        if b.until <= 0:
            if held is not None:
                self._adopt_backlog(b)
        elif held is None or b.until > held.until:
            self._adopt_backlog(b)
        elif b != held:
            self.stats.events_stale += 1

    # -- the writer -------------------------------------------------------------------------

    def _has_pending(self) -> bool:
        return bool(
            self._pending_entities
            or self._pending_backlogs
            or self._pending_writes
            or self._resync_needed
        )

    def _room_for_one(self) -> bool:
        if len(self._pending_entities) + len(self._pending_backlogs) < self._max_pending:
            return True
        # Memory still has the change; a full resync writes back whatever Redis lacks.
        self.stats.writes_dropped += 1
        self._resync_needed = True
        return False

    def _queue_backlog(self, queue: str, disable: bool) -> None:
        if queue in self._pending_backlogs or self._room_for_one():
            self._pending_backlogs[queue] = disable
        self._wake_writer()

    def _wake_writer(self) -> None:
        self._drained.clear()
        self._wake.set()

    async def _write_loop(self) -> None:
        """Write pending changes one at a time while a session is up. Cancelled by
        `close`. A failed write breaks the session; its key is queued again unless a newer
        change replaced it, and the resync of the next session reconciles the rest."""
        while True:
            await self._wake.wait()
            await self._online.wait()
            sess = self._sess
            if sess is None:  # the session went down between the two events
                await asyncio.sleep(0)
                continue
            job = self._next_job()
            if job is None:
                self._wake.clear()
                self._drained.set()
                continue
            kind, key = job
            try:
                await self._write_job(sess, kind, key)
            except _REDIS_ERRORS as exc:
                if kind == "resync":
                    self._resync_needed = True
                self._call_failed(sess, f"write {kind} {key}", exc)
            except Exception:
                # A bug or a malformed reply: drop this write rather than the writer; the
                # state stays in memory and the next resync writes it back if Redis lacks it.
                log.exception("state: writing %s %r failed unexpectedly", kind, key)

    def _next_job(self) -> tuple[str, str] | None:
        """The next write, in priority order: a resync, an entity's state, a backlog
        queue's rotation, a backlog-written event. None when nothing is pending."""
        if self._resync_needed:
            return ("resync", "")
        if self._pending_entities:
            return ("entity", next(iter(self._pending_entities)))
        if self._pending_backlogs:
            return ("backlog", next(iter(self._pending_backlogs)))
        if self._pending_writes:
            written = next(iter(self._pending_writes))
            return ("written", "" if written is None else written)
        return None

    async def _write_job(self, sess: Session, kind: str, key: str) -> None:
        """Do one write of `_next_job`. On a Redis error the change is queued again (unless
        a newer one replaced it meanwhile) and the error propagates."""
        if kind == "resync":
            self._resync_needed = False
            await self._resync(sess)
        elif kind == "entity":
            await self._write_pending(
                self._pending_entities, key, lambda base: self._write_entity(sess, key, base)
            )
        elif kind == "backlog":
            await self._write_pending(
                self._pending_backlogs, key, lambda off: self._write_backlog(sess, key, off)
            )
        else:
            queue = key or None
            event = written_event(queue, self.replica_id)
            await self._write_pending(
                self._pending_writes,
                queue,
                lambda _: sess.client.execute_command(sess.publish, self._channel, event),
            )

    async def _write_pending(
        self, pending: dict[K, V], key: K, write: Callable[[V], Awaitable[object]]
    ) -> None:
        """Take `key`'s change out of `pending` and write it under our deadline; on a Redis
        error put it back, unless a newer change for `key` arrived meanwhile."""
        value = pending.pop(key)
        try:
            async with asyncio.timeout(self._op_timeout):
                await write(value)
        except _REDIS_ERRORS:
            pending.setdefault(key, value)
            raise

    async def _write_entity(self, sess: Session, entity: str, base: int) -> None:
        state = self._entities.get(entity)
        if state is None:
            return
        reply = await sess.transition(
            keys=[self._key("entity", entity)],
            args=[base, *self._entity_args(state)],
            client=sess.client,
        )
        if reply[0] == 1:
            self.stats.writes += 1
            return
        self.stats.write_conflicts += 1
        stored = self._entity_from_reply(entity, reply)
        if stored is None or stored.epoch < base:
            # Redis lost what our chain was built on (restarted empty, flushed): put ours back.
            await self._restore(sess, self.get(entity))
            return
        held = self.get(entity)
        local = held == state or entity in self._pending_entities
        log.info(
            "state: %s: our epoch %d lost the race to %s (epoch %d, by %s)",
            entity,
            state.epoch,
            stored.status,
            stored.epoch,
            stored.by,
        )
        # The cluster moved on from our base first: the CAS loser adopts the winner, even on
        # a tie, so every replica ends on the state Redis holds.
        if (local and stored != held) or stored.newer_than(held):
            self._adopt_entity(stored)

    async def _restore(self, sess: Session, state: EntityState) -> None:
        """Write `state` if Redis lacks the entity or holds something older; otherwise
        adopt what Redis holds (it is newer, or ties and Redis decides)."""
        reply = await sess.restore(
            keys=[self._key("entity", state.entity)],
            args=self._entity_args(state),
            client=sess.client,
        )
        if reply[0] == 1:
            self.stats.writes += 1
            if self._entities.get(state.entity) == state:
                self._pending_entities.pop(state.entity, None)
            return
        stored = self._entity_from_reply(state.entity, reply)
        held = self.get(state.entity)
        if stored is not None and stored != held and not held.newer_than(stored):
            self._adopt_entity(stored)

    async def _write_backlog(self, sess: Session, queue: str, disable: bool) -> None:
        key = self._key("backlog", queue)
        if not disable:
            event = backlog_event(BacklogState(queue, 0.0, self.replica_id, "enabled"))
            await sess.enable(keys=[key], args=[self._channel, event], client=sess.client)
            self.stats.writes += 1
            return
        held = self._backlogs.get(queue)
        if held is None:
            return
        px = round((held.until - self._clock()) * 1000)
        if px <= 0:
            return  # already over: nothing to tell anyone
        reply = await sess.disable(
            keys=[key],
            args=[repr(held.until), px, held.by, held.reason, self._channel, backlog_event(held)],
            client=sess.client,
        )
        if reply[0] == 1:
            self.stats.writes += 1
            return
        try:
            stored = backlog_from_hash(
                queue, {"until": reply[1], "by": reply[2], "reason": reply[3]}
            )
        except (Invalid, IndexError) as exc:
            self._invalid("reply", key, exc)
            return
        if stored.until > held.until:
            self._adopt_backlog(stored)

    # -- sessions ---------------------------------------------------------------------------

    def _call_failed(self, sess: Session, where: str, exc: BaseException) -> None:
        """A call on `sess` failed: break the session, unless it is already a past one."""
        if sess is self._sess:
            self._session_failed(where, exc)
        else:
            self.stats.redis_errors += 1

    def _session_failed(self, where: str, exc: BaseException | None) -> None:
        """Mark the session broken (sync: callable from anywhere). Memory keeps serving."""
        self.stats.redis_errors += 1
        if self._online.is_set():
            log.warning(
                "state: redis unreachable (%s: %r); replica %s works on memory until it returns",
                where,
                exc,
                self.replica_id,
            )
        else:
            log.debug("state: redis call failed while offline (%s: %r)", where, exc)
        self._online.clear()
        self._sess = None
        self._broken.set()

    async def _supervise(self) -> None:
        """Run sessions forever, reconnecting with capped exponential backoff (jittered so
        replicas do not stampede a restarted Redis). Cancelled by `close`."""
        backoff = self._backoff
        delay: float | None = None
        while True:
            sessions_before = self._sessions
            try:
                await self._session()
            except SessionBroken:
                pass  # already counted and logged where the call failed
            except Exception:
                # A bug (bad data, unexpected reply): log it loudly, keep the replica alive.
                log.exception("state: session failed unexpectedly; reconnecting")
                self._session_failed("session", None)
            self._first_attempt.set()
            if self._sessions != sessions_before:
                delay = None  # that session got up: start the backoff from the bottom
            delay = backoff.next(delay)
            await asyncio.sleep(backoff.wait(delay))

    async def _session(self) -> None:
        """Connect, subscribe, resync, go online, then listen until something breaks.
        Always raises; always closes what it opened (bounded)."""
        try:
            await self._target.prepare()
        except Exception as exc:  # no credentials (Entra ID unreachable, no oid claim, ...)
            self._session_failed("credentials", exc)
            raise SessionBroken from exc
        client: Client | None = None
        pubsub: Subscriber | None = None
        try:
            self._broken.clear()
            # No retries inside redis-py: a failure must surface here, so that we resync.
            client = await self._target.open_client(
                op_timeout=self._op_timeout, name=f"sbgate-state-{self.replica_id}"
            )
            # Subscribe before reading the snapshot: a change made while we read is then
            # either in what we read or in an event we will get (both are idempotent).
            pubsub = await self._target.subscriber(client, self._channel, self._op_timeout)
            sess = Session.open(client, pubsub.publish)
            await self._resync(sess)  # sets sess.mark
            if self._broken.is_set():
                raise SessionBroken
            self._sess = sess
            self._online.set()
            if self._sessions:
                self.stats.reconnects += 1
            self._sessions += 1
            self._first_attempt.set()
            log.info("state: replica %s connected to redis and resynced", self.replica_id)
            # Announcements published while this replica was not subscribed are lost to it:
            # its syphon looks at every backlog queue instead.
            self._notify_write(None)
            while True:
                await self._listen(pubsub, self._renew_in())
                # Only now does listen return: the credentials are about to expire.
                try:
                    await self._target.prepare()
                except Exception as exc:  # the current credentials still work for a while
                    log.warning("state: renewing the redis credentials failed: %r", exc)
                    await self._listen(pubsub, _RENEW_RETRY)
                    continue
                client, pubsub = await self._renew(client, pubsub)
        except _REDIS_ERRORS as exc:
            self._session_failed("session", exc)
            raise SessionBroken from exc
        finally:
            self._online.clear()
            self._sess = None
            if client is not None:
                await self._dispose(pubsub, client)

    def _renew_in(self) -> float | None:
        renew_in = self._target.renew_in()
        # Never sooner than one op_timeout: a provider that keeps answering "now" must not
        # make us spin through sessions.
        return None if renew_in is None else max(renew_in, self._op_timeout)

    async def _renew(self, client: Client, pubsub: Subscriber) -> tuple[Client, Subscriber]:
        """Make before break: open a new client and subscription (the connections fetch
        fresh credentials), switch every caller to them, keep listening on the new one for
        `op_timeout` — the bound on any call still running on the old connections — and
        only then close the old ones. Nothing is missed (both subscriptions overlap), so no
        resync is needed, and the replica never goes offline. On failure the new
        connections are closed and the error propagates (the session ends, as on any
        failure); the old ones are closed in every case."""
        new_client: Client | None = None
        new_pubsub: Subscriber | None = None
        try:
            new_client = await self._target.open_client(
                op_timeout=self._op_timeout, name=f"sbgate-state-{self.replica_id}"
            )
            new_pubsub = await self._target.subscriber(new_client, self._channel, self._op_timeout)
            await self._drain(pubsub)
            mark = self._sess.mark if self._sess is not None else ""
            self._sess = Session.open(new_client, new_pubsub.publish, mark)
            self.renewals += 1
            log.debug("state: replica %s renewed its redis connections", self.replica_id)
            await self._listen(new_pubsub, self._op_timeout)
        except BaseException:
            if new_client is not None:
                await self._dispose(new_pubsub, new_client)
            raise
        finally:
            await self._dispose(pubsub, client)
        return new_client, new_pubsub

    async def _drain(self, pubsub: Subscriber) -> None:
        """Apply what the old subscription still holds. Called once the new one is
        confirmed: an event published before that went to the old one only. If the old
        connection fails instead, a resync on the new session recovers what it held."""
        try:
            async with asyncio.timeout(self._op_timeout):
                await pubsub.drain(f"{{{self._prefix}}}:barrier", self._on_event)
        except _REDIS_ERRORS as exc:
            log.info("state: draining the old subscription failed (%r); resyncing", exc)
            self._resync_needed = True
            self._wake_writer()

    async def _listen(self, pubsub: Subscriber, duration: float | None = None) -> None:
        """Apply events until the connection dies, goes silent (no PONG within
        `op_timeout` of a ping), or another call breaks the session (raises) — or, given a
        `duration`, until that many seconds have passed (returns)."""
        loop = asyncio.get_running_loop()
        last_heard = loop.time()
        until = None if duration is None else last_heard + duration
        ping_sent: float | None = None
        mark_due = last_heard + self._health_interval
        while True:
            if self._broken.is_set():
                raise SessionBroken
            if until is not None and loop.time() >= until:
                return
            if loop.time() >= mark_due:
                await self._check_mark()
                mark_due = loop.time() + self._health_interval
            async with asyncio.timeout(self._tick + self._op_timeout):
                msg = await pubsub.get_message(wait=self._tick)
            now = loop.time()
            if msg is not None:
                last_heard, ping_sent = now, None
                if msg["type"] == "message":
                    self._on_event(msg["data"])
                continue
            if ping_sent is not None:
                if now - ping_sent > self._op_timeout:
                    raise TimeoutError("redis did not answer the subscriber's PING")
            elif now - last_heard >= self._health_interval:
                async with asyncio.timeout(self._op_timeout):
                    await pubsub.ping()
                ping_sent = now

    async def _check_mark(self) -> None:
        """Raise `SessionBroken` if Redis no longer holds this session's dataset mark: it
        lost its data under a live connection (the module docstring)."""
        sess = self._sess
        if sess is None:
            return
        try:
            async with asyncio.timeout(self._op_timeout):
                found = await sess.client.get(self.dataset_key)
        except ResponseError as exc:  # not a string there (WRONGTYPE): damaged, so lost
            found = f"unreadable: {exc}"
        if found != sess.mark:
            self._data_lost(repr(found))
            raise SessionBroken

    def _data_lost(self, found: str) -> None:
        self.stats.data_losses += 1
        log.warning(
            "state: redis lost its data since replica %s resynced (dataset mark now %s); "
            "resyncing, which writes memory back",
            self.replica_id,
            found[:100],  # a value read from Redis: bounded in the log
        )

    async def _adopt_mark(self, sess: Session) -> None:
        """Set the dataset mark if Redis lacks it, and adopt the one it holds."""
        async with asyncio.timeout(self._op_timeout):
            sess.mark = str(await sess.client.eval(MARK_LUA, 1, self.dataset_key, uuid.uuid4().hex))

    async def _dispose(self, pubsub: Subscriber | None, client: Client) -> None:
        # Best effort and bounded: a stalled server must not hold up a reconnect or close.
        closers = [client.aclose] if pubsub is None else [pubsub.aclose, client.aclose]
        for closer in closers:
            try:
                async with asyncio.timeout(self._op_timeout):
                    await closer()
            except (*_REDIS_ERRORS, RuntimeError) as exc:
                log.debug("state: closing a redis connection: %r", exc)

    # -- resync -----------------------------------------------------------------------------

    async def _resync(self, sess: Session) -> None:
        """Read every entity and backlog from Redis and merge with memory: adopt what Redis
        holds unless memory is newer; write back (restore) what memory has newer or Redis
        lacks. Bounded by `resync_timeout`; raises the Redis error if it fails."""
        async with asyncio.timeout(self._resync_timeout):
            await self._adopt_mark(sess)  # first: what is read next belongs to it
            entities = await self._read_layouts(sess, "entity")
            backlogs = await self._read_layouts(sess, "backlog")
            now = self._clock()
            # Decide in one synchronous step against memory as it is now.
            restore: list[EntityState] = []
            for entity in set(entities) | set(self._entities):
                h = entities.get(entity)
                stored = self._parsed_or_none("entity", entity, h, entity_from_hash)
                held = self._entities.get(entity)
                if held is None:
                    if stored is not None:
                        self._adopt_entity(stored)
                elif stored is None or held.newer_than(stored):
                    restore.append(held)
                    self._pending_entities.pop(entity, None)  # the restore covers it
                elif stored != held:
                    self._adopt_entity(stored)
                else:
                    self._pending_entities.pop(entity, None)
            disable: list[str] = []
            for queue in set(backlogs) | set(self._backlogs):
                if queue in self._pending_backlogs:
                    continue  # our later change is queued and will be written after this
                stored_b = self._parsed_or_none(
                    "backlog", queue, backlogs.get(queue), backlog_from_hash
                )
                held_b = self._backlogs.get(queue)
                if held_b is not None and held_b.until <= now:
                    del self._backlogs[queue]  # expired: forget it quietly
                    held_b = None
                if stored_b is not None and (held_b is None or stored_b.until > held_b.until):
                    if stored_b.until > now:
                        self._adopt_backlog(stored_b)
                elif held_b is not None and (stored_b is None or held_b.until > stored_b.until):
                    disable.append(queue)
            for state in restore:
                await self._restore(sess, state)
            for queue in disable:
                await self._write_backlog(sess, queue, True)
            await self.fences.resync(sess)
        self.stats.resyncs += 1
        self._legacy_head = None  # imported once: from now on only the tagged layout

    async def _read_layouts(
        self, sess: Session, kind: str
    ) -> dict[str, dict[str, str] | BaseException]:
        """`_read_all`, plus — on this process's first resync, on one endpoint — the hashes of
        the untagged layout that releases before the hash tag wrote (`<prefix>:<kind>:`),
        where the tagged layout lacks them: state decided before an upgrade carries over."""
        found = await self._read_all(sess, kind)
        if self._legacy_head is None:
            return found
        old = await self._read_all(sess, kind, f"{self._legacy_head}{kind}:")
        return {**old, **found}

    async def _read_all(
        self, sess: Session, kind: str, head: str | None = None
    ) -> dict[str, dict[str, str] | BaseException]:
        """Every `{<prefix>}:<kind>:*` hash (or `<head>*`), keyed by the name after it; the
        error instead for a key that could not be read (of another type: one bad key never
        fails the whole read)."""
        head = head if head is not None else self._key(kind, "")
        keys = [k async for k in sess.client.scan_iter(match=_glob_escape(head) + "*", count=500)]
        if not keys:
            return {}
        pipe = sess.client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        values = await pipe.execute(raise_on_error=False)
        return {k[len(head) :]: v for k, v in zip(keys, values, strict=True) if v}

    # -- for the fences (gateway.state.redis.fences) -----------------------------------------

    @property
    def session(self) -> Session | None:
        """The current connection generation (None while Redis is unreachable)."""
        return self._sess

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def op_timeout(self) -> float:
        return self._op_timeout

    def call_failed(self, sess: Session, where: str, exc: BaseException) -> None:
        self._call_failed(sess, where, exc)

    def invalid(self, source: str, key: str, problem: object) -> None:
        self._invalid(source, key, problem)

    def key(self, kind: str, name: str) -> str:
        return self._key(kind, name)

    @property
    def dataset_key(self) -> str:
        """Where the dataset mark lives (the module docstring)."""
        return f"{{{self._prefix}}}:dataset"

    def data_lost(self, sess: Session, where: str, exc: BaseException) -> None:
        """A script on `sess` refused: its dataset mark is gone (count, log, break)."""
        if sess is self._sess:
            self._data_lost(f"other than {sess.mark} ({where})")
        self._call_failed(sess, where, exc)

    # -- helpers ----------------------------------------------------------------------------

    def _key(self, kind: str, name: str) -> str:
        return f"{{{self._prefix}}}:{kind}:{name}"

    def _entity_args(self, s: EntityState) -> list[str | int]:
        event = entity_event(s).decode()
        return [s.epoch, s.status, repr(s.since), s.by, s.reason, self._channel, event]


if TYPE_CHECKING:  # mypy proves the store satisfies the port

    def _conforms(store: RedisStateStore) -> StateStore:
        return store
