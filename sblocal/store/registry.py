"""The entity registry: create, read, update and delete queues, topics and subscriptions.

What the HTTPS management API (`sblocal.management`) drives, through the
`sblocal.entities.EntityRegistry` protocol; durable mode writes every change through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sblocal.entities import (
    EntityExistsError,
    EntityNotFoundError,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.store.base import NamespaceBase

_P = TypeVar("_P", QueueProperties, TopicProperties)


class Registry(NamespaceBase):
    """`sblocal.entities.EntityRegistry` over a namespace's entities."""

    def list_queues(self) -> list[tuple[str, QueueProperties]]:
        with self.lock:
            return [
                (q.path, q.props)
                for q in self._queues.values()
                if isinstance(q.props, QueueProperties)
            ]

    def get_queue(self, path: str) -> QueueProperties | None:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            return q.props if q is not None and isinstance(q.props, QueueProperties) else None

    def create_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        self._create("queue", path, props, self._add_queue)
        return props

    def update_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            if q is None:
                raise EntityNotFoundError(path)
            q.props = props
            if q.dlq is not None:
                q.dlq.props = props
            if self._persistence is not None:
                self._persistence.save_entity("queue", q.path, props)
            return props

    def delete_queue(self, path: str) -> None:
        with self.lock:
            q = self._queues.pop(path.strip("/").lower(), None)
            if q is None:
                raise EntityNotFoundError(path)
            if self._persistence is not None:
                self._persistence.delete_entity("queue", q.path)

    def queue_runtime(self, path: str) -> RuntimeCounts:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            if q is None:
                raise EntityNotFoundError(path)
            return q.runtime()

    def list_topics(self) -> list[tuple[str, TopicProperties]]:
        with self.lock:
            return [(t.path, t.props) for t in self._topics.values()]

    def get_topic(self, path: str) -> TopicProperties | None:
        with self.lock:
            t = self._topics.get(path.strip("/").lower())
            return t.props if t is not None else None

    def create_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        self._create("topic", path, props, self._add_topic)
        return props

    def _create(self, kind: str, path: str, props: _P, add: Callable[[str, _P], object]) -> None:
        """Queues and topics share one namespace of names (case-insensitive)."""
        name = path.strip("/")
        with self.lock:
            if name.lower() in self._queues or name.lower() in self._topics:
                raise EntityExistsError(path)
            add(name, props)
            if self._persistence is not None:
                self._persistence.save_entity(kind, name, props)

    def update_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        with self.lock:
            t = self._topics.get(path.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(path)
            t.props = props
            if self._persistence is not None:
                self._persistence.save_entity("topic", t.path, props)
            return props

    def update_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            if t is None or s is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            s.props = props
            if s.dlq is not None:
                s.dlq.props = props
            if self._persistence is not None:
                self._persistence.save_entity("subscription", s.path, props)
            return props

    def delete_topic(self, path: str) -> None:
        with self.lock:
            t = self._topics.pop(path.strip("/").lower(), None)
            if t is None:
                raise EntityNotFoundError(path)
            if self._persistence is not None:
                self._persistence.delete_entity("topic", t.path)

    def list_subscriptions(self, topic: str) -> list[tuple[str, SubscriptionProperties]]:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(topic)
            return [
                (s.path.rsplit("/", 1)[1], s.props)
                for s in t.subscriptions.values()
                if isinstance(s.props, SubscriptionProperties)
            ]

    def get_subscription(self, topic: str, name: str) -> SubscriptionProperties | None:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            return (
                s.props if s is not None and isinstance(s.props, SubscriptionProperties) else None
            )

    def create_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(topic)
            if name.lower() in t.subscriptions:
                raise EntityExistsError(f"{topic}/Subscriptions/{name}")
            self._add_subscription(t, name, props)
            if self._persistence is not None:
                self._persistence.save_entity(
                    "subscription", f"{t.path}/Subscriptions/{name}", props
                )
            return props

    def delete_subscription(self, topic: str, name: str) -> None:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None or t.subscriptions.pop(name.lower(), None) is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            if self._persistence is not None:
                self._persistence.delete_entity("subscription", f"{t.path}/Subscriptions/{name}")

    def subscription_runtime(self, topic: str, name: str) -> RuntimeCounts:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            if s is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            return s.runtime()
