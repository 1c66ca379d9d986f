"""Session fences: while a session has acknowledged messages in the backlog, its new ones
go to the backlog too (docs/failover.md#sessions-keep-their-order).

A fence is kept per (entity key, SessionId). It records, exactly:

* the backlog queue of each *generation* (the queue the session's backlog writes go to; a
  new generation starts when that queue leaves rotation);
* the writes in flight (`pending`: write id -> (deadline, generation)), recorded before
  the write starts, so a lift can never race a write still in flight on any replica;
* the tokens of acknowledged messages not yet moved home (`tokens`: token -> (generation,
  sequence)), the sequence numbering acknowledgements in the order they were recorded;
* the tokens moved home before their write's acknowledgement was recorded (`early`), so a
  move and an acknowledgement may come in either order.

It lifts, in one step, when no token is outstanding and no write is pending (a pending
write past its deadline is one whose replica died: its messages were never acknowledged).
An *unknown* fence (its contents were lost: a shared store restarted empty) lifts only when
a depth check finds every backlog queue of its pair empty.

`FenceTable` is the logic, on plain dicts; `MemoryFences` keeps it in process (one
replica); the shared implementation runs the same steps as Lua scripts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class FenceUnavailable(Exception):
    """The shared fence store cannot be reached: a session message that must take the
    backlog path is refused (fail closed) rather than written unfenced."""


@dataclass(slots=True)
class Fence:
    """One session's fence (see the module docstring)."""

    since: float
    generation: int = 0
    queues: dict[int, str] = field(default_factory=dict)
    pending: dict[str, tuple[float, int]] = field(default_factory=dict)
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    early: set[str] = field(default_factory=set)
    unknown: bool = False
    sequence: int = 0  # acknowledged tokens so far

    def outstanding(self, now: float) -> bool:
        """Does anything still hold the fence at `now`?"""
        if self.unknown or self.tokens:
            return True
        return any(deadline > now for deadline, _ in self.pending.values())

    def movable(self, queue: str, held: Sequence[str | None], now: float) -> int:
        """How many of a syphon's messages of this session, received in stored order from
        `queue` (`held`: each one's token, None for one without), may move now: a prefix.
        None of them while the fence is unknown (its contents were lost: `rebuild` first). With
        acknowledged messages outstanding, only a receiver that holds the oldest one (the
        head), in its generation's queue, with no write to an older generation in flight,
        moves, and only up to its first message of a later generation (a queue may hold
        two generations: S's messages of the one between, in another queue, go first).
        With nothing acknowledged outstanding, only a write in flight to another queue's
        older generation holds them back."""
        if self.unknown:
            return 0
        pending = [g for deadline, g in self.pending.values() if deadline > now]
        if not self.tokens:
            return len(held) if not pending or self.queues.get(min(pending)) == queue else 0
        head, (generation, _) = min(self.tokens.items(), key=lambda kv: kv[1])
        if any(g < generation for g in pending):
            return 0
        if self.queues.get(generation) != queue or head not in held:
            return 0
        for i, token in enumerate(held):
            counted = self.tokens.get(token) if token is not None else None
            if counted is not None and counted[0] != generation:
                return i
        return len(held)

    def may_move(self, queue: str, tokens: Collection[str], now: float) -> bool:
        """May a syphon holding this session's messages `tokens`, received in stored order
        from `queue`, move them now? Only if the oldest acknowledged message outstanding is
        among them (so not held by another receiver) in that queue, and no write to an
        older generation is in flight; never while the fence is unknown."""
        return self.movable(queue, list(tokens), now) > 0 or (
            not tokens and not self.unknown and self.movable(queue, [None], now) > 0
        )


FenceKey = tuple[str, str]  # (entity key, session id)
# Told when a fence is set (True) or lifted (False), with its age at a lift.
FenceListener = Callable[[FenceKey, bool, float], None]


class FenceTable:
    """The fences of one process, and the steps every store applies (see the module
    docstring). Not thread-safe; every method is synchronous."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.fences: dict[FenceKey, Fence] = {}

    def begin(
        self,
        key: FenceKey,
        write_id: str,
        ranked: Sequence[str],
        disabled: Collection[str],
        deadline: float,
    ) -> tuple[str, int, bool] | None:
        """Record a backlog write of session `key` about to start: the queue it must go to,
        its generation, and whether this set the fence. None if no queue is usable."""
        fence = self.fences.get(key)
        created = fence is None
        current = fence.queues.get(fence.generation) if fence is not None else None
        if current is None or current in disabled:
            queue = next((q for q in ranked if q not in disabled), None)
            if queue is None:
                return None
            if fence is None:
                fence = self.fences[key] = Fence(since=self._clock())
            fence.generation += 1
            fence.queues[fence.generation] = queue
            current = queue
        assert fence is not None
        fence.pending[write_id] = (deadline, fence.generation)
        return current, fence.generation, created

    def end(self, key: FenceKey, write_id: str, tokens: Sequence[str], ok: bool) -> float | None:
        """A write recorded by `begin` ended: `ok` if it was acknowledged (its `tokens` are
        then outstanding until moved). Returns the fence's age if this lifted it."""
        fence = self.fences.get(key)
        if fence is None:
            return None
        began = fence.pending.pop(write_id, None)
        generation = began[1] if began is not None else fence.generation
        if ok and began is not None:  # no pending entry: ended already (idempotent)
            for t in tokens:
                if t in fence.early:
                    fence.early.discard(t)
                else:
                    fence.sequence += 1
                    fence.tokens[t] = (generation, fence.sequence)
        return self._lift_if_done(key, fence)

    def moved(self, key: FenceKey, tokens: Sequence[str]) -> float | None:
        """Messages of session `key` carrying `tokens` are stored at home. Returns the
        fence's age if this lifted it."""
        fence = self.fences.get(key)
        if fence is None:
            return None
        for t in tokens:
            if fence.tokens.pop(t, None) is None:
                fence.early.add(t)
        return self._lift_if_done(key, fence)

    def may_move(self, key: FenceKey, queue: str, tokens: Collection[str]) -> bool:
        """`Fence.may_move` (True for a session with no fence)."""
        fence = self.fences.get(key)
        return fence is None or fence.may_move(queue, tokens, self._clock())

    def movable(self, key: FenceKey, queue: str, held: Sequence[str | None]) -> int:
        """`Fence.movable` (all of them for a session with no fence)."""
        fence = self.fences.get(key)
        return len(held) if fence is None else fence.movable(queue, held, self._clock())

    def unknown(self, key: FenceKey) -> bool:
        fence = self.fences.get(key)
        return fence is not None and fence.unknown

    def rebuild(self, key: FenceKey, old: Sequence[tuple[str, str]]) -> float | None:
        """Make unknown fence `key` known again from what the backlog holds of its session
        (`old`: (token, queue) in the order `order_found` gives). Each run of one queue in
        `old` becomes a generation, numbered below every generation the fence has seen
        since it was written back (negative: -1 the newest), so S's older messages move
        first, in that order; a token the fence counts already, or that was moved home
        meanwhile, is skipped. Returns the fence's age if this lifted it."""
        fence = self.fences.get(key)
        if fence is None or not fence.unknown:
            return None
        for token, generation, sequence, queue in generations(old):
            fence.queues[generation] = queue
            if token in fence.early:
                fence.early.discard(token)
            elif token not in fence.tokens:
                fence.tokens[token] = (generation, sequence)
        fence.unknown = False
        return self._lift_if_done(key, fence)

    def backlog_empty(self, entities: Collection[str]) -> list[tuple[FenceKey, float]]:
        """Every backlog queue holding `entities`' messages was found empty: unknown fences
        of those entities with no write pending lift, and so do known ones that nothing
        holds (a write past its deadline — its replica died, or its end was lost — holds
        nothing, but no later step of the session may come to lift the fence). Returns
        what lifted, with ages."""
        lifted: list[tuple[FenceKey, float]] = []
        now = self._clock()
        for key, fence in list(self.fences.items()):
            if key[0] in entities:
                if fence.unknown:
                    fence.unknown = False
                    fence.tokens.clear()
                if not fence.outstanding(now):
                    del self.fences[key]
                    lifted.append((key, now - fence.since))
        return lifted

    def _lift_if_done(self, key: FenceKey, fence: Fence) -> float | None:
        now = self._clock()
        if fence.outstanding(now):
            return None
        del self.fences[key]
        return now - fence.since


def order_found(found: Mapping[str, Sequence[tuple[str, float]]]) -> list[tuple[str, str]]:
    """One session's messages found in the backlog queues, `found`: per queue, (token,
    acceptance time) in stored order. Returns (token, queue) in the order they were
    acknowledged: each queue's stored order kept, the queues merged by acceptance time
    (the earliest head first; ties by queue name)."""
    heads = {q: 0 for q, items in found.items() if items}
    out: list[tuple[str, str]] = []
    while heads:
        queue = min(heads, key=lambda q: (found[q][heads[q]][1], q))
        i = heads[queue]
        out.append((found[queue][i][0], queue))
        if i + 1 < len(found[queue]):
            heads[queue] = i + 1
        else:
            del heads[queue]
    return out


def generations(old: Sequence[tuple[str, str]]) -> list[tuple[str, int, int, str]]:
    """`old` as (token, generation, sequence, queue): a generation per run of one queue,
    the last run -1, the one before -2...; sequences negative and ascending."""
    runs = sum(1 for i, (_, q) in enumerate(old) if i == 0 or old[i - 1][1] != q)
    out: list[tuple[str, int, int, str]] = []
    generation = -runs - 1
    for i, (token, queue) in enumerate(old):
        if i == 0 or old[i - 1][1] != queue:
            generation += 1
        out.append((token, generation, i - len(old), queue))
    return out


class FenceStore(Protocol):
    """Where the fences live: `fenced` and `sessions` read memory (the hot path); the
    others may call the shared backend (the backlog path and the syphon)."""

    def fenced(self, entity: str, session: str) -> bool:
        """Is session `session` of entity key `entity` fenced (memory only)?"""
        ...

    def sessions(self, entity: str) -> list[str]:
        """The fenced sessions of entity key `entity` (memory only), sorted."""
        ...

    async def begin_write(
        self,
        entity: str,
        session: str,
        write_id: str,
        ranked: Sequence[str],
        disabled: Collection[str],
        deadline: float,
    ) -> tuple[str, int] | None:
        """`FenceTable.begin` (the queue and generation), cluster-wide. Raises
        `FenceUnavailable` if the shared backend cannot be reached."""
        ...

    async def end_write(
        self, entity: str, session: str, write_id: str, tokens: Sequence[str], ok: bool
    ) -> None:
        """`FenceTable.end`, cluster-wide. Never raises for backend errors (a write left
        pending holds the fence until its deadline: safe)."""
        ...

    async def movable(
        self, entity: str, session: str, queue: str, held: Sequence[str | None]
    ) -> int:
        """`FenceTable.movable`. 0 if the backend cannot be reached."""
        ...

    async def unknown(self, entity: str, session: str) -> bool:
        """Is the fence of (entity, session) unknown (`FenceTable.rebuild` wanted)? False
        if the backend cannot be reached."""
        ...

    async def rebuild(self, entity: str, session: str, old: Sequence[tuple[str, str]]) -> None:
        """`FenceTable.rebuild`, cluster-wide (once: a fence already rebuilt is left
        alone). Never raises for backend errors (the fence stays unknown: safe)."""
        ...

    async def moved(self, entity: str, session: str, tokens: Sequence[str]) -> None:
        """`FenceTable.moved`, cluster-wide. Never raises for backend errors (the fence
        then stays until the next move of the session: safe)."""
        ...

    async def backlog_empty(self, entities: Collection[str]) -> None:
        """`FenceTable.backlog_empty`, cluster-wide."""
        ...

    def subscribe_fences(self, listener: FenceListener) -> None:
        """Call `listener` for every fence set or lifted (this replica's or another's)."""
        ...


class MemoryFences:
    """`FenceStore` for one replica: the table in process (lost with the process, like the
    memory state store's failover state)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.table = FenceTable(clock)
        self._listeners: list[FenceListener] = []

    def fenced(self, entity: str, session: str) -> bool:
        return (entity, session) in self.table.fences

    def sessions(self, entity: str) -> list[str]:
        return sorted(s for e, s in self.table.fences if e == entity)

    async def begin_write(
        self,
        entity: str,
        session: str,
        write_id: str,
        ranked: Sequence[str],
        disabled: Collection[str],
        deadline: float,
    ) -> tuple[str, int] | None:
        got = self.table.begin((entity, session), write_id, ranked, disabled, deadline)
        if got is None:
            return None
        queue, generation, created = got
        if created:
            self._tell((entity, session), True, 0.0)
        return queue, generation

    async def end_write(
        self, entity: str, session: str, write_id: str, tokens: Sequence[str], ok: bool
    ) -> None:
        age = self.table.end((entity, session), write_id, tokens, ok)
        if age is not None:
            self._tell((entity, session), False, age)

    async def movable(
        self, entity: str, session: str, queue: str, held: Sequence[str | None]
    ) -> int:
        return self.table.movable((entity, session), queue, held)

    async def unknown(self, entity: str, session: str) -> bool:
        return self.table.unknown((entity, session))

    async def rebuild(self, entity: str, session: str, old: Sequence[tuple[str, str]]) -> None:
        age = self.table.rebuild((entity, session), old)
        if age is not None:
            self._tell((entity, session), False, age)

    async def moved(self, entity: str, session: str, tokens: Sequence[str]) -> None:
        age = self.table.moved((entity, session), tokens)
        if age is not None:
            self._tell((entity, session), False, age)

    async def backlog_empty(self, entities: Collection[str]) -> None:
        for key, age in self.table.backlog_empty(entities):
            self._tell(key, False, age)

    def subscribe_fences(self, listener: FenceListener) -> None:
        self._listeners.append(listener)

    def _tell(self, key: FenceKey, on: bool, age: float) -> None:
        for listener in self._listeners:
            listener(key, on, age)


def _conforms(store: MemoryFences) -> FenceStore:
    return store  # mypy checks MemoryFences against the protocol here
