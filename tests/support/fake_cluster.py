"""Shared failover state for several replicas at the `StateStore` port, on virtual time.

`FakeRedis` plays the backend and `ClusterStore` one replica's store, with the contract
`RedisStateStore` keeps (and `tests/gateway/test_state_redis.py` proves over real
redis-server processes): memory first; transitions written in the background with a
compare-and-set on the epoch, the loser adopting the winner; every applied change and every
backlog-write announcement published to the other replicas after `latency`; while the
backend is down, each replica works on its own memory (fail open: leases granted) and keeps
what it must write; on reconnect it resyncs (adopts what is newer, writes back what the
backend lacks), flushes, and tells its write listeners None. A backend restarted empty
loses everything it held.

What it leaves out of the real store: coalescing limits and the redis-py session machinery,
which have their own tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.state.base import BacklogState, EntityState, Status
from gateway.state.memory import LocalState


@dataclass
class FakeRedis:
    latency: float = 0.01  # pub/sub delivery and write round trip
    reconnect_delay: float = 0.5
    up: bool = True
    entities: dict[str, EntityState] = field(default_factory=dict)
    backlogs: dict[str, BacklogState] = field(default_factory=dict)
    leases: dict[str, tuple[str, float]] = field(default_factory=dict)
    nodes: list[ClusterStore] = field(default_factory=list)

    def stop(self) -> None:
        self.up = False
        for node in self.nodes:
            node.disconnected()

    def start(self, *, empty: bool = False) -> None:
        if empty:
            self.entities.clear()
            self.backlogs.clear()
            self.leases.clear()
        self.up = True
        for node in self.nodes:
            node.reconnect_soon()

    def publish(self, event: tuple[str, object], sender: ClusterStore) -> None:
        loop = asyncio.get_running_loop()
        for node in self.nodes:
            if node is not sender and node.online:
                loop.call_later(self.latency, node.deliver, node.session, event)


class ClusterStore(LocalState):
    """One replica's store (see the module docstring)."""

    def __init__(self, redis: FakeRedis, replica_id: str) -> None:
        super().__init__(replica_id, clock=lambda: asyncio.get_running_loop().time())
        self._redis = redis
        self.online = False
        self.session = 0  # a delivery for an older session is lost, as on a dropped link
        self._pending_entities: dict[str, int] = {}  # entity -> CAS base epoch
        self._pending_backlogs: set[str] = set()
        self._pending_writes: set[str | None] = set()
        self._reconnect: asyncio.TimerHandle | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.online

    async def start(self) -> None:
        self._bind_loop()
        self._redis.nodes.append(self)
        if self._redis.up:
            self._connect()

    async def close(self) -> None:
        self._closed = True
        self.online = False
        if self._reconnect is not None:
            self._reconnect.cancel()
        if self in self._redis.nodes:
            self._redis.nodes.remove(self)

    def disconnected(self) -> None:
        self.online = False
        self.session += 1

    def reconnect_soon(self) -> None:
        if self._closed or self.online:
            return
        if self._reconnect is not None:
            self._reconnect.cancel()
        loop = asyncio.get_running_loop()
        self._reconnect = loop.call_later(self._redis.reconnect_delay, self._connect)

    def _connect(self) -> None:
        self._reconnect = None
        if self._closed or not self._redis.up:
            return
        self.session += 1
        self._resync()
        self.online = True
        self._flush()
        self._notify_write(None)

    # -- hot path (memory) ------------------------------------------------------------------

    def propose(
        self, current: EntityState, status: Status, reason: str, since: float | None = None
    ) -> EntityState | None:
        base = self.get(current.entity).epoch
        new = self._propose_local(current, status, reason, since)
        if new is not None:
            self._pending_entities.setdefault(new.entity, base)
            self._flush_soon()
        return new

    def disable_backlog(self, queue: str, until: float, reason: str) -> None:
        if self._disable_local(queue, until, reason) is not None:
            self._pending_backlogs.add(queue)
            self._flush_soon()

    def enable_backlog(self, queue: str) -> None:
        self._enable_local(queue)
        self._pending_backlogs.add(queue)
        self._flush_soon()

    def announce_backlog_write(self, queue: str | None) -> None:
        self._notify_write(queue)
        self._pending_writes.add(queue)
        self._flush_soon()

    # -- leases -----------------------------------------------------------------------------

    async def acquire_lease(self, name: str, ttl: float) -> bool:
        if not self.online:
            return True  # fail open
        now = self._clock()
        holder = self._redis.leases.get(name)
        if holder is None or holder[1] <= now or holder[0] == self.replica_id:
            self._redis.leases[name] = (self.replica_id, now + ttl)
            return True
        return False

    async def release_lease(self, name: str) -> None:
        held = self._redis.leases.get(name)
        if self.online and held is not None and held[0] == self.replica_id:
            del self._redis.leases[name]

    async def lease_holder(self, name: str) -> str | None:
        held = self._redis.leases.get(name)
        if not self.online or held is None or held[1] <= self._clock():
            return None
        return held[0]

    # -- writing to the backend -------------------------------------------------------------

    def _flush_soon(self) -> None:
        if self.online:
            asyncio.get_running_loop().call_later(self._redis.latency, self._flush_if, self.session)

    def _flush_if(self, session: int) -> None:
        if self.online and session == self.session:
            self._flush()

    def _flush(self) -> None:
        redis = self._redis
        for entity, base in list(self._pending_entities.items()):
            del self._pending_entities[entity]
            mine = self._entities.get(entity)
            if mine is None:
                continue
            stored = redis.entities.get(entity)
            if (stored.epoch if stored else 0) == base:
                redis.entities[entity] = mine
                redis.publish(("entity", mine), self)
            elif stored is None or stored.epoch < base:
                self._restore(mine)  # the backend lost what our chain was built on
            elif stored != mine:
                self._adopt_entity(stored)  # the CAS loser adopts the winner
        for queue in sorted(self._pending_backlogs):
            self._pending_backlogs.discard(queue)
            held = self._backlogs.get(queue)
            change = held or BacklogState(queue, 0.0, self.replica_id, "enabled")
            current = redis.backlogs.get(queue)
            if held is None:
                redis.backlogs.pop(queue, None)
            elif current is None or held.until > current.until:
                redis.backlogs[queue] = held
            else:
                continue
            redis.publish(("backlog", change), self)
        for written in list(self._pending_writes):
            self._pending_writes.discard(written)
            redis.publish(("written", written), self)

    def _restore(self, mine: EntityState) -> None:
        stored = self._redis.entities.get(mine.entity)
        if stored is None or mine.newer_than(stored):
            self._redis.entities[mine.entity] = mine
            self._redis.publish(("entity", mine), self)
        elif stored != mine:
            self._adopt_entity(stored)

    def _resync(self) -> None:
        redis = self._redis
        for entity in set(redis.entities) | set(self._entities):
            stored = redis.entities.get(entity)
            held = self._entities.get(entity)
            if held is None:
                if stored is not None:
                    self._adopt_entity(stored)
            elif stored is None or held.newer_than(stored):
                self._pending_entities.pop(entity, None)
                self._restore(held)
            elif stored != held:
                self._pending_entities.pop(entity, None)
                self._adopt_entity(stored)
        now = self._clock()
        for queue, b in redis.backlogs.items():
            held_b = self._backlogs.get(queue)
            if b.until > now and (held_b is None or b.until > held_b.until):
                self._adopt_backlog(b)

    # -- events from other replicas ---------------------------------------------------------

    def deliver(self, session: int, event: tuple[str, object]) -> None:
        if not self.online or session != self.session:
            return  # published while this replica was not listening: lost
        kind, payload = event
        if kind == "entity":
            assert isinstance(payload, EntityState)
            held = self._entities.get(payload.entity)
            if held is None or payload.newer_than(held):
                self._pending_entities.pop(payload.entity, None)
                self._adopt_entity(payload)
        elif kind == "backlog":
            assert isinstance(payload, BacklogState)
            if payload.queue not in self._pending_backlogs:
                self._adopt_backlog(payload)
        else:
            assert payload is None or isinstance(payload, str)
            self._notify_write(payload)
