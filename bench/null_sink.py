"""A namespace client that settles every send at once: the P1 benchmark's "null sink".

Also handy to exercise the HTTP edge and the dispatcher without a broker.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.message import OutboundMessage


class NullSender:
    def __init__(self, owner: NullNamespaceClient) -> None:
        self._owner = owner

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        self._owner.sent += len(messages)
        self._owner.operations += 1

    async def close(self) -> None:
        return None


class NullNamespaceClient:
    """Counts what it was given and stores nothing."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.sent = 0
        self.operations = 0

    @property
    def name(self) -> str:
        return self._name

    async def open_sender(self, path: str) -> NullSender:
        return NullSender(self)

    async def close(self) -> None:
        return None
