"""The state every part of a `Namespace` shares: its entities, lock, counters and hooks.

`Namespace` is assembled from this base and one mixin per concern — sending, receiving, the
entity registry — each in its own module; they share the state below and nothing else.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sblocal.config import NamespaceConfig
from sblocal.entities import QueueProperties, SubscriptionProperties, TopicProperties
from sblocal.store.entity import Entity, SendTarget, Topic
from sblocal.store.messages import Counters, StoredMessage

if TYPE_CHECKING:
    from sblocal.persistence import Persistence

DLQ_SUFFIX = "/$deadletterqueue"
SUBSCRIPTIONS_SEGMENT = "/subscriptions/"


class NamespaceBase:
    """Entities of one namespace and the lock every public method takes."""

    def __init__(self, config: NamespaceConfig, *, persistence: Persistence | None) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.counters = Counters()
        self._queues: dict[str, Entity] = {}
        self._topics: dict[str, Topic] = {}
        self._persistence = persistence
        # Called (from whatever thread changed the state) when messages may have become
        # deliverable; the AMQP layer hooks this to wake its reactor.
        self.on_change: Callable[[], None] | None = None
        # Owners whose lapsed session lock was taken over before housekeeping swept it;
        # `Sessions.expire_sessions` hands them to the AMQP layer to detach.
        self._lost_session_owners: list[uuid.UUID] = []

    @property
    def name(self) -> str:
        return self.config.name

    # -- lookup ------------------------------------------------------------------------

    @staticmethod
    def normalize(address: str) -> str:
        """Entity path from a link address (``amqps://host:port/path`` or ``path``)."""
        if "://" in address:
            address = address.split("://", 1)[1]
            address = address.split("/", 1)[1] if "/" in address else ""
        return address.strip("/")

    def send_target(self, address: str) -> SendTarget | None:
        key = self.normalize(address).lower()
        with self.lock:
            return self._queues.get(key) or self._topics.get(key)

    def receive_source(self, address: str) -> Entity | None:
        key = self.normalize(address).lower()
        with self.lock:
            dlq = key.endswith(DLQ_SUFFIX)
            if dlq:
                key = key[: -len(DLQ_SUFFIX)]
            entity = self._queues.get(key)
            if entity is None and SUBSCRIPTIONS_SEGMENT in key:
                topic_key, sub = key.rsplit(SUBSCRIPTIONS_SEGMENT, 1)
                topic = self._topics.get(topic_key)
                entity = topic.subscriptions.get(sub) if topic else None
            if entity is None:
                return None
            return entity.dlq if dlq else entity

    def entity(self, path: str) -> Entity | Topic | None:
        """Any entity: queue, topic, ``<topic>/Subscriptions/<name>``, ``.../$DeadLetterQueue``."""
        with self.lock:
            return self.send_target(path) or self.receive_source(path)

    def all_entities(self) -> list[Entity | Topic]:
        with self.lock:
            out: list[Entity | Topic] = list(self._queues.values())
            for t in self._topics.values():
                out.append(t)
                out.extend(t.subscriptions.values())
            return out

    def _receivables(self) -> Iterable[Entity]:
        for q in self._queues.values():
            yield q
            if q.dlq is not None:
                yield q.dlq
        for t in self._topics.values():
            for s in t.subscriptions.values():
                yield s
                if s.dlq is not None:
                    yield s.dlq

    # -- internals ---------------------------------------------------------------------

    def _add_queue(self, path: str, props: QueueProperties) -> Entity:
        q = Entity(path, "queue", props)
        self._queues[path.lower()] = q
        return q

    def _add_topic(self, path: str, props: TopicProperties) -> Topic:
        t = Topic(path, props)
        self._topics[path.lower()] = t
        return t

    def _add_subscription(self, topic: Topic, name: str, props: SubscriptionProperties) -> Entity:
        s = Entity(f"{topic.path}/Subscriptions/{name}", "subscription", props, topic=topic)
        topic.subscriptions[name.lower()] = s
        return s

    def _persist(self, entity: Entity, msg: StoredMessage) -> None:
        if self._persistence is not None:
            self._persistence.upsert(entity.path, msg)

    def _unpersist(self, entity: Entity, seq: int) -> None:
        if self._persistence is not None:
            self._persistence.delete(entity.path, seq)

    def _flush_persistence(self) -> None:
        if self._persistence is not None:
            self._persistence.commit(self.sequence_state)

    def sequence_state(self) -> dict[str, int]:
        with self.lock:
            out = {q.path: q.next_seq for q in self._queues.values()}
            out.update({t.path: t.next_seq for t in self._topics.values()})
            return out
