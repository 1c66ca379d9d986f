"""`Namespace`: all entities and messages of one namespace, with Service Bus semantics.

`Namespace` is the single owner of a namespace's state. Every public method takes the
namespace lock, so the AMQP reactor thread, the control API and the management API (asyncio
thread) can all call it. Methods never block on I/O except the optional SQLite write-through
of durable mode, which happens under the lock so that what a sender saw settled is on disk.

It is assembled from one module per concern: `sending` (store with Service Bus' checks),
`receiving` (locks, settlement, dead-lettering, expiry), `sessions` (session receivers'
locks and state, over `receiving`), `registry` (entity CRUD for the
management API), over the shared state of `base`. This module adds time (housekeeping),
inspection for the control API and tests, and the durable-mode restore.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from sblocal.config import NamespaceConfig
from sblocal.entities import TIMESPAN_MAX
from sblocal.store.entity import Entity, Topic
from sblocal.store.messages import Counters, MessageState, StoredMessage, now_ms
from sblocal.store.registry import Registry
from sblocal.store.sending import Sending
from sblocal.store.sessions import Sessions

if TYPE_CHECKING:
    from sblocal.persistence import Persistence

_log = logging.getLogger(__name__)


class Namespace(Registry, Sending, Sessions):
    """All entities of one namespace. Implements `sblocal.entities.EntityRegistry`."""

    def __init__(
        self,
        config: NamespaceConfig,
        *,
        persistence: Persistence | None = None,
    ) -> None:
        super().__init__(config, persistence=persistence)
        for q in config.queues:
            self._add_queue(q.path, q.properties)
        for t in config.topics:
            topic = self._add_topic(t.path, t.properties)
            for s in t.subscriptions:
                self._add_subscription(topic, s.name, s.properties)
        if persistence is not None:
            persistence.load(self)

    # -- time --------------------------------------------------------------------------

    def housekeeping(self, now: int | None = None) -> list[Entity]:
        """Expire locks and TTLs, activate scheduled messages; returns entities with news."""
        now = now_ms() if now is None else now
        touched: list[Entity] = []
        with self.lock:
            for entity in list(self._receivables()):
                changed = False
                for msg in entity.expired_locks(now):
                    self.counters.lock_expirations += 1
                    changed = self._unlock_and_requeue(entity, msg, now, count=True) or changed
                for msg in entity.due_scheduled(now):
                    msg.state = MessageState.ACTIVE
                    msg.enqueued_ms = max(now, msg.scheduled_ms or now)
                    entity.make_ready(msg)
                    self._persist(entity, msg)
                    changed = True
                for msg in entity.expired_messages(now):
                    self._expire(entity, msg, now)
                if changed:
                    touched.append(entity)
            self._flush_persistence()
        return touched

    # -- inspection and test support ---------------------------------------------------

    def reset(self) -> None:
        """Drop every message and counter; keep the entities."""
        with self.lock:
            for entity in self._receivables():
                entity.clear()
            for topic in self._topics.values():
                topic.dedup.clear()
                topic.sends = topic.pings = 0
                topic.last_ping_ms = None
            active = self.counters.active_connections
            self.counters = Counters(active_connections=active)
            if self._persistence is not None:
                self._persistence.clear_messages()

    def describe(self, entity: Entity | Topic) -> dict[str, Any]:
        with self.lock:
            if isinstance(entity, Topic):
                return {
                    "path": entity.path,
                    "kind": "topic",
                    "sends": entity.sends,
                    "pings": entity.pings,
                    "last_ping_ms": entity.last_ping_ms,
                    "subscriptions": sorted(s.path for s in entity.subscriptions.values()),
                    "properties": _props_json(entity.props),
                }
            info: dict[str, Any] = {"path": entity.path, "kind": entity.kind}
            info.update(entity.counts())
            if entity.kind != "subscription":
                info["sends"] = entity.sends
                info["pings"] = entity.pings
                info["last_ping_ms"] = entity.last_ping_ms
            info["properties"] = _props_json(entity.props)
            return info

    def notify(self) -> None:
        callback = self.on_change
        if callback is not None:
            callback()

    # -- durable mode ------------------------------------------------------------------

    def restore_message(self, path: str, msg: StoredMessage) -> None:
        """Durable mode: put a message loaded from disk back (before the broker serves)."""
        entity = self.receive_source(path)
        if entity is None:
            _log.warning("dropping stored message %s of unknown entity %s", msg.seq, path)
            return
        msg.lock_token = None
        entity.add(msg)
        owner: Entity | Topic = entity.parent or entity
        if isinstance(owner, Entity) and owner.topic is not None:
            owner = owner.topic
        owner.next_seq = max(owner.next_seq, msg.seq + 1)

    def restore_sequence(self, path: str, next_seq: int) -> None:
        target = self.send_target(path)
        if target is not None:
            target.next_seq = max(target.next_seq, next_seq)

    def close(self) -> None:
        if self._persistence is not None:
            self._persistence.close()


def _props_json(props: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(props):
        value = getattr(props, f.name)
        if isinstance(value, dt.timedelta):
            value = None if value >= TIMESPAN_MAX else value.total_seconds()
        out[f.name] = value
    return out
