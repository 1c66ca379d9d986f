"""Where a request's messages go: the entity's primary namespace (and, with failover, a
backlog queue in the secondary namespace — see `gateway.core.failover`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.entities import EntityRef
from gateway.core.message import OutboundMessage
from gateway.core.ports import NamespaceClient

Route = Literal["primary", "backlog"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a request's messages were stored."""

    route: Route
    destination: str  # the entity path, or the backlog queue path

    @property
    def status(self) -> int:
        """201 when stored at the primary entity, 202 when stored in a backlog queue."""
        return 201 if self.route == "primary" else 202


class Router(Protocol):
    async def submit(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> Delivery:
        """Store `messages` for `entity` and say where; raises `GatewayError` otherwise."""
        ...


class PrimaryRouter:
    """Always the primary namespace (no failover configured)."""

    def __init__(self, dispatcher: Dispatcher, primaries: Mapping[str, NamespaceClient]) -> None:
        self._dispatcher = dispatcher
        self._primaries = primaries

    def destination(self, entity: EntityRef) -> Destination:
        return Destination(self._primaries[entity.pair], entity.path)

    async def submit(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> Delivery:
        await self._dispatcher.send(self.destination(entity), messages)
        return Delivery("primary", entity.path)
