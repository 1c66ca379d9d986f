"""Failover state shared by every replica: the port the failover logic talks through.

The hot path never waits on the store: `get`/`snapshot`/`backlogs_disabled` read memory;
`propose`/`disable_backlog` apply to memory at once and persist cluster-wide in the
background. Two implementations: `MemoryStateStore` (one process, the embedded default) and
`RedisStateStore` (every replica; transitions are atomic Lua CAS on an epoch, published
over pub/sub, resynced on reconnect; if Redis is unreachable the replica fails open on its
own memory and merges back when Redis returns).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

Status = Literal["healthy", "failing", "failed_over"]
SEVERITY: Mapping[Status, int] = {"healthy": 0, "failing": 1, "failed_over": 2}

# Where a value read from the shared backend was found invalid (and skipped or repaired):
# a hash read by a resync, a pub/sub event, a script's reply, a lease key.
INVALID_VALUE_SOURCES = ("resync", "event", "reply", "lease")


@dataclass(frozen=True, slots=True)
class EntityState:
    """The failover state of one entity, as the cluster agreed on it.

    `epoch` grows by one on every transition; a change carrying an epoch not newer than the
    one held is stale and ignored, so a late report can never flip a newer state back.
    """

    entity: str  # the entity key: its path, lower-cased
    status: Status = "healthy"
    epoch: int = 0
    since: float = 0.0  # unix time the status began (for "failing": the failover timer t0)
    by: str = ""  # replica id that made the transition
    reason: str = ""  # e.g. "timeout", "connection", "ping", "operator"

    def newer_than(self, other: EntityState) -> bool:
        """True if `self` should replace `other` (higher epoch; on a tie, more severe)."""
        if self.epoch != other.epoch:
            return self.epoch > other.epoch
        return SEVERITY[self.status] > SEVERITY[other.status]


@dataclass(frozen=True, slots=True)
class BacklogState:
    """A backlog queue taken out of rotation for the whole cluster until `until` (unix time)."""

    queue: str
    until: float
    by: str = ""
    reason: str = ""


StateListener = Callable[[EntityState], None]
BacklogListener = Callable[[BacklogState], None]
# Told that a backlog queue holds messages the syphon may move now (`announce_backlog_write`),
# or, with None, that any queue may (announcements may have been missed: a reconnect).
BacklogWriteListener = Callable[[str | None], None]


class StateStore(Protocol):
    """See the module docstring. All sync methods are non-blocking and safe on the hot path."""

    @property
    def replica_id(self) -> str: ...

    @property
    def connected(self) -> bool:
        """False while the shared backend is unreachable (the store then works on memory)."""
        ...

    async def start(self) -> None:
        """Connect (bounded by our own deadline), resync, start the owned background tasks.
        Never fails because the backend is down: it keeps retrying in the background."""
        ...

    async def close(self) -> None:
        """Cancel and await the background tasks, flush what can be flushed quickly, close."""
        ...

    def get(self, entity: str) -> EntityState:
        """The current state of `entity` from memory (healthy, epoch 0, if never seen)."""
        ...

    def snapshot(self) -> dict[str, EntityState]:
        """Every entity state held in memory."""
        ...

    def propose(
        self, current: EntityState, status: Status, reason: str, since: float | None = None
    ) -> EntityState | None:
        """Transition from `current` to `status` if memory still holds `current`'s epoch.

        Applies the new state (epoch + 1, `by` = this replica, `since` = `since` or now) to
        memory at once, notifies listeners, and persists it cluster-wide in the background
        with a compare-and-set on the epoch. If the cluster already moved on, the cluster's
        newer state replaces ours when it arrives. Returns the new state, or None if
        `current` was stale.
        """
        ...

    def backlogs_disabled(self, now: float) -> frozenset[str]:
        """Backlog queues out of rotation at `now` (memory)."""
        ...

    def disable_backlog(self, queue: str, until: float, reason: str) -> None:
        """Take `queue` out of rotation cluster-wide until `until`: memory now, backend and
        other replicas in the background."""
        ...

    def enable_backlog(self, queue: str) -> None:
        """Put `queue` back into rotation cluster-wide (a re-probe succeeded)."""
        ...

    async def acquire_lease(self, name: str, ttl: float) -> bool:
        """Take or renew the lease `name` for `ttl` seconds; True if this replica holds it.
        With the backend unreachable: True (fail open — better two pingers than none).
        Bounded by our own deadline; never raises for backend errors."""
        ...

    async def release_lease(self, name: str) -> None:
        """Give the lease up if this replica holds it; never raises."""
        ...

    async def lease_holder(self, name: str) -> str | None:
        """Which replica holds `name` (None if nobody, or unknown). Not for the hot path."""
        ...

    def announce_backlog_write(self, queue: str | None) -> None:
        """Tell every replica's syphon that `queue` holds messages it may move now: written
        while their entity is healthy, or written during a failover that has since ended.
        None: any backlog queue may (a replica that starts cannot know what it wrote before
        it stopped). Local listeners hear it on the next loop turn, other replicas through
        the backend in the background; while the backend is unreachable it is kept (one per
        queue) and sent on reconnect. Never blocks, never raises."""
        ...

    def subscribe(
        self,
        on_entity: StateListener,
        on_backlog: BacklogListener,
        on_write: BacklogWriteListener | None = None,
    ) -> None:
        """Call the listeners (on the event loop) for every change applied to memory, local
        or from another replica, including those applied by a resync. `on_write` hears every
        announcement (this replica's or another's) and None after each (re)connection to the
        backend, when announcements may have been missed."""
        ...
