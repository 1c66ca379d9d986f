"""The in-process failover state: one replica's memory, and the embedded default store.

`LocalState` holds what every store keeps in memory (entity states, disabled backlog queues,
listeners) and the rules for changing it; `MemoryStateStore` is that plus leases, for a
single process (the embedded default, no `REDIS_URL`). `RedisStateStore` builds on the same
`LocalState`, so both stores answer the hot path the same way.

Listeners are always called with `loop.call_soon` (never from inside `propose`), so a
caller sees the same ordering whichever store it runs on: `propose` returns first, the
listeners run on the next turn of the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, TypeVar

from gateway.state.base import (
    BacklogListener,
    BacklogState,
    BacklogWriteListener,
    EntityState,
    StateListener,
    StateStore,
    Status,
)
from gateway.state.fence import MemoryFences

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_HEALTHY_CACHE = 4096


@dataclass(slots=True)
class StoreStats:
    """Counters a store keeps about itself (exported as metrics by the app)."""

    redis_errors: int = 0  # failed or timed-out Redis calls
    reconnects: int = 0  # sessions established after the first one
    resyncs: int = 0  # full merges of memory with Redis completed
    data_losses: int = 0  # times Redis was found to have lost its data (the dataset mark)
    events_applied: int = 0  # pub/sub events (or resync reads) that changed memory
    events_stale: int = 0  # pub/sub events ignored because memory was newer
    writes: int = 0  # transitions, restores and backlog changes Redis accepted
    write_conflicts: int = 0  # CAS rejections: the cluster had moved on first
    writes_dropped: int = 0  # pending writes dropped because the queue was full
    # Values read from the backend that did not parse (skipped or repaired), by where they
    # were read (`INVALID_VALUE_SOURCES`).
    invalid_values: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """The counters; `invalid_values` as its total."""
        return {
            f.name: sum(self.invalid_values.values())
            if f.name == "invalid_values"
            else getattr(self, f.name)
            for f in fields(self)
        }


class LocalState:
    """Memory every store keeps, and the rules for changing it. Synchronous, never blocks.

    Not thread-safe: call it from the event loop's thread only (as the gateway does).
    """

    def __init__(self, replica_id: str, clock: Callable[[], float] = time.time) -> None:
        self._replica_id = replica_id
        self._clock = clock
        self._entities: dict[str, EntityState] = {}
        self._healthy: dict[str, EntityState] = {}  # cached defaults for unknown entities
        self._backlogs: dict[str, BacklogState] = {}
        self._entity_listeners: list[StateListener] = []
        self._backlog_listeners: list[BacklogListener] = []
        self._write_listeners: list[BacklogWriteListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = StoreStats()

    @property
    def replica_id(self) -> str:
        return self._replica_id

    # -- reads (hot path) -------------------------------------------------------------------

    def get(self, entity: str) -> EntityState:
        state = self._entities.get(entity)
        if state is not None:
            return state
        # Most entities are healthy and never in `_entities`; building a frozen dataclass
        # costs ~10x a dict lookup, so the defaults are cached (bounded: cleared when full).
        state = self._healthy.get(entity)
        if state is None:
            if len(self._healthy) >= _HEALTHY_CACHE:
                self._healthy.clear()
            state = self._healthy[entity] = EntityState(entity)
        return state

    def snapshot(self) -> dict[str, EntityState]:
        return dict(self._entities)

    def backlogs_disabled(self, now: float) -> frozenset[str]:
        return frozenset(q for q, b in self._backlogs.items() if b.until > now)

    def backlog_states(self) -> dict[str, BacklogState]:
        """Every backlog disable held in memory, expired ones included (for the admin API)."""
        return dict(self._backlogs)

    # -- local changes ----------------------------------------------------------------------

    def _propose_local(
        self, current: EntityState, status: Status, reason: str, since: float | None
    ) -> EntityState | None:
        """CAS on the epoch in memory; apply and notify. None if `current` is stale."""
        held = self.get(current.entity)
        if held.epoch != current.epoch:
            return None
        new = EntityState(
            entity=current.entity,
            status=status,
            epoch=held.epoch + 1,
            since=self._clock() if since is None else since,
            by=self._replica_id,
            reason=reason,
        )
        self._entities[new.entity] = new
        self._notify_entity(new)
        return new

    def _disable_local(self, queue: str, until: float, reason: str) -> BacklogState | None:
        """Take `queue` out of rotation; None if it is already out for at least as long
        (the later `until` wins everywhere, so every replica converges on the same one), or
        if `until` is not a finite time (it would keep the queue out forever)."""
        if not math.isfinite(until):
            log.warning("state: refusing to disable backlog %r until %r", queue, until)
            return None
        held = self._backlogs.get(queue)
        if held is not None and held.until >= until:
            return None
        state = BacklogState(queue=queue, until=until, by=self._replica_id, reason=reason)
        self._backlogs[queue] = state
        self._notify_backlog(state)
        return state

    def _enable_local(self, queue: str) -> bool:
        """Put `queue` back into rotation; True if it was out (listeners were told)."""
        if self._backlogs.pop(queue, None) is None:
            return False
        # An enable is reported as a disable that ended at 0: "in rotation since forever".
        self._notify_backlog(BacklogState(queue=queue, until=0.0, by=self._replica_id))
        return True

    # -- changes from elsewhere (another replica, a resync) ---------------------------------

    def _adopt_entity(self, state: EntityState) -> None:
        """Replace memory with `state` (the caller decided it wins) and notify."""
        self._entities[state.entity] = state
        self.stats.events_applied += 1
        self._notify_entity(state)

    def _adopt_backlog(self, state: BacklogState) -> None:
        if state.until <= 0:
            if self._backlogs.pop(state.queue, None) is None:
                return
        else:
            self._backlogs[state.queue] = state
        self.stats.events_applied += 1
        self._notify_backlog(state)

    # -- listeners --------------------------------------------------------------------------

    def subscribe(
        self,
        on_entity: StateListener,
        on_backlog: BacklogListener,
        on_write: BacklogWriteListener | None = None,
    ) -> None:
        self._entity_listeners.append(on_entity)
        self._backlog_listeners.append(on_backlog)
        if on_write is not None:
            self._write_listeners.append(on_write)

    def _bind_loop(self) -> None:
        """Remember the running loop so sync callers can schedule listener calls on it."""
        self._loop = asyncio.get_running_loop()

    def _schedule(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                # No loop at all (a sync caller before start): call right away.
                fn()
                return
        if loop.is_closed():
            return
        loop.call_soon(fn)

    def _notify_entity(self, state: EntityState) -> None:
        for listener in self._entity_listeners:
            self._schedule(functools.partial(_call_listener, listener, state))

    def _notify_backlog(self, state: BacklogState) -> None:
        for listener in self._backlog_listeners:
            self._schedule(functools.partial(_call_listener, listener, state))

    def _notify_write(self, queue: str | None) -> None:
        for listener in self._write_listeners:
            self._schedule(functools.partial(_call_listener, listener, queue))


def _call_listener(fn: Callable[[_T], None], arg: _T) -> None:
    # A listener bug must never stop the store from delivering the next change.
    try:
        fn(arg)
    except Exception:
        log.exception("state listener %r failed on %r", fn, arg)


class MemoryStateStore(LocalState):
    """The `StateStore` for a single process: memory only, leases by `clock`.

    Instances share nothing: two `MemoryStateStore`s are two separate clusters of one.
    `start`/`close` own no tasks; every method is non-blocking and never raises.
    """

    def __init__(self, replica_id: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(replica_id, clock)
        self._leases: dict[str, tuple[str, float]] = {}  # name -> (holder, expires at)
        # Session fences live with the failover state: in process here.
        self.fences = MemoryFences(clock)

    @property
    def connected(self) -> bool:
        return True  # no backend to lose

    async def start(self) -> None:
        self._bind_loop()

    async def close(self) -> None:
        self._leases.clear()

    def propose(
        self, current: EntityState, status: Status, reason: str, since: float | None = None
    ) -> EntityState | None:
        return self._propose_local(current, status, reason, since)

    def disable_backlog(self, queue: str, until: float, reason: str) -> None:
        self._disable_local(queue, until, reason)

    def enable_backlog(self, queue: str) -> None:
        self._enable_local(queue)

    def announce_backlog_write(self, queue: str | None) -> None:
        self._notify_write(queue)

    async def acquire_lease(self, name: str, ttl: float) -> bool:
        # One replica only: it always holds its leases; the expiry keeps `lease_holder`
        # honest when the holder stops renewing.
        self._leases[name] = (self._replica_id, self._clock() + ttl)
        return True

    async def release_lease(self, name: str) -> None:
        self._leases.pop(name, None)

    async def lease_holder(self, name: str) -> str | None:
        held = self._leases.get(name)
        if held is None:
            return None
        holder, expires = held
        if expires <= self._clock():
            del self._leases[name]
            return None
        return holder


if TYPE_CHECKING:  # mypy proves the store satisfies the port

    def _conforms(store: MemoryStateStore) -> StateStore:
        return store
