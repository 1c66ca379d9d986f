"""Optional registry capabilities behind the admin client's ``update_*`` calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sblocal.entities import QueueProperties, SubscriptionProperties, TopicProperties


@runtime_checkable
class SupportsQueueUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_queue``."""

    def update_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        """Replace the queue's properties in place, keeping its messages.

        Raises EntityNotFoundError when the queue does not exist.
        """
        ...


@runtime_checkable
class SupportsTopicUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_topic``."""

    def update_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        """As `SupportsQueueUpdate.update_queue`, for a topic."""
        ...


@runtime_checkable
class SupportsSubscriptionUpdate(Protocol):
    """Optional registry capability behind the admin client's ``update_subscription``."""

    def update_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        """As `SupportsQueueUpdate.update_queue`, for a subscription."""
        ...


@runtime_checkable
class SupportsEntityUpdate(
    SupportsQueueUpdate, SupportsTopicUpdate, SupportsSubscriptionUpdate, Protocol
):
    """All three update capabilities.

    `EntityRegistry` has no update methods. A registry that also has some of these serves
    the matching updates (``PUT`` with ``If-Match: *``) in place; for the others an update
    answers 501 (the admin client raises HttpResponseError).
    """
