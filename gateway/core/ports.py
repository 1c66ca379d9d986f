"""The ports the core talks through. Adapters implement them; tests may fake them here only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.core.message import OutboundMessage


class Sender(Protocol):
    """One open link to one entity. The dispatcher uses each sender for one send at a time."""

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        """Send `messages` as one settled operation (a batch when more than one).

        Returns only when the broker has stored every message; raises `SendFailure`
        otherwise. May hang: the caller owns the deadline.
        """
        ...

    async def close(self) -> None:
        """Close the link; never raises."""
        ...


class NamespaceClient(Protocol):
    """One Service Bus namespace: opens senders, closes everything at shutdown."""

    @property
    def name(self) -> str: ...

    async def open_sender(self, path: str) -> Sender:
        """Open a sender on `path`; raises `SendFailure`. The caller owns the deadline."""
        ...

    async def close(self) -> None:
        """Close the client and every sender it opened; never raises."""
        ...
