"""Entity descriptions shared by the broker's AMQP side and its management (ATOM) side.

These are the properties the real Service Bus exposes through its management API and that
`azure.servicebus.management.ServiceBusAdministrationClient` round-trips. The AMQP side
(`sblocal.broker`) owns the live entities; the management side (`sblocal.management`) only
talks to a namespace through the `EntityRegistry` protocol below, so the two can evolve
separately. Every `EntityRegistry` method is thread-safe: the AMQP reactor runs in its own
thread while the HTTP servers run on an asyncio loop.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Protocol

# TimeSpan.MaxValue as Service Bus reports it (ISO 8601: P10675199DT2H48M5.4775807S).
TIMESPAN_MAX = dt.timedelta(days=10675199, seconds=10085, microseconds=477580)
INT_MAX = 2147483647


@dataclass(frozen=True, slots=True)
class QueueProperties:
    """Queue settings (defaults are the Service Bus Standard-tier defaults)."""

    lock_duration: dt.timedelta = dt.timedelta(minutes=1)
    max_size_in_megabytes: int = 1024
    requires_duplicate_detection: bool = False
    requires_session: bool = False
    default_message_time_to_live: dt.timedelta = TIMESPAN_MAX
    dead_lettering_on_message_expiration: bool = False
    duplicate_detection_history_time_window: dt.timedelta = dt.timedelta(minutes=10)
    max_delivery_count: int = 10
    enable_batched_operations: bool = True
    auto_delete_on_idle: dt.timedelta = TIMESPAN_MAX
    enable_partitioning: bool = False
    max_message_size_in_kilobytes: int = 256
    status: str = "Active"


@dataclass(frozen=True, slots=True)
class TopicProperties:
    """Topic settings."""

    max_size_in_megabytes: int = 1024
    requires_duplicate_detection: bool = False
    default_message_time_to_live: dt.timedelta = TIMESPAN_MAX
    duplicate_detection_history_time_window: dt.timedelta = dt.timedelta(minutes=10)
    enable_batched_operations: bool = True
    auto_delete_on_idle: dt.timedelta = TIMESPAN_MAX
    enable_partitioning: bool = False
    max_message_size_in_kilobytes: int = 256
    status: str = "Active"


@dataclass(frozen=True, slots=True)
class SubscriptionProperties:
    """Subscription settings."""

    lock_duration: dt.timedelta = dt.timedelta(minutes=1)
    requires_session: bool = False
    default_message_time_to_live: dt.timedelta = TIMESPAN_MAX
    dead_lettering_on_message_expiration: bool = False
    max_delivery_count: int = 10
    enable_batched_operations: bool = True
    auto_delete_on_idle: dt.timedelta = TIMESPAN_MAX
    status: str = "Active"


@dataclass(frozen=True, slots=True)
class RuntimeCounts:
    """Live counters of one queue or subscription (the admin client's runtime properties)."""

    active_message_count: int = 0
    dead_letter_message_count: int = 0
    scheduled_message_count: int = 0
    size_in_bytes: int = 0
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    updated_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    accessed_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    @property
    def total_message_count(self) -> int:
        return (
            self.active_message_count
            + self.dead_letter_message_count
            + self.scheduled_message_count
        )


class EntityExistsError(Exception):
    """An entity with that path already exists (HTTP 409 on the management API)."""


class EntityNotFoundError(Exception):
    """No entity with that path (HTTP 404 on the management API)."""


class EntityRegistry(Protocol):
    """What the management API may do with one namespace. All methods are thread-safe."""

    @property
    def name(self) -> str:
        """The namespace name (e.g. ``primary``)."""
        ...

    def list_queues(self) -> list[tuple[str, QueueProperties]]: ...

    def get_queue(self, path: str) -> QueueProperties | None: ...

    def create_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        """Create a queue; raises EntityExistsError if a queue or topic has that path."""
        ...

    def delete_queue(self, path: str) -> None:
        """Raises EntityNotFoundError."""
        ...

    def queue_runtime(self, path: str) -> RuntimeCounts:
        """Raises EntityNotFoundError."""
        ...

    def list_topics(self) -> list[tuple[str, TopicProperties]]: ...

    def get_topic(self, path: str) -> TopicProperties | None: ...

    def create_topic(self, path: str, props: TopicProperties) -> TopicProperties: ...

    def delete_topic(self, path: str) -> None: ...

    def list_subscriptions(self, topic: str) -> list[tuple[str, SubscriptionProperties]]:
        """Raises EntityNotFoundError if the topic does not exist."""
        ...

    def get_subscription(self, topic: str, name: str) -> SubscriptionProperties | None: ...

    def create_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties: ...

    def delete_subscription(self, topic: str, name: str) -> None: ...

    def subscription_runtime(self, topic: str, name: str) -> RuntimeCounts: ...
