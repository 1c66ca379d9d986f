"""Requests on an entity's management node (``<entity>/$management``): scheduling.

A sender uses two operations there, `schedule_messages` and `cancel_scheduled_messages`.
They go to the primary while the entity is healthy (`Scheduler`, gateway.servicebus.schedule)
and answer `server-busy` while it is not; every other operation (peek, lock renewal, session
state, rules...) is a receiver's or an administrator's, and is answered 501
`amqp:not-implemented`. Replies carry ``statusCode``, ``statusDescription`` and, on failure,
``errorCondition`` (the SDKs raise by it, as for a rejected delivery).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.amqp.messages import MalformedMessage, to_outbound
from gateway.auth import AuthError
from gateway.config import LimitSettings
from gateway.core.entities import EntityCatalog, EntityRef
from gateway.core.message import OutboundMessage
from gateway.errors import GatewayError, amqp_rejection
from gateway.ingest import Authorize, check_sizes
from sbamqp import conventions
from sbamqp.codec import Array, Long, Symbol
from sbamqp.conventions import Condition

SENDERS_ONLY = "this endpoint only accepts senders; receive from the namespace"
_MAX_SEQUENCE_NUMBERS = 10_000


class Scheduler(Protocol):
    """Scheduling at the primary (gateway.servicebus.schedule has the SDK's)."""

    async def schedule(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> list[int]:
        """The primary's sequence numbers; raises `GatewayError` (server-busy while the
        entity is not healthy)."""
        ...

    async def cancel(self, entity: EntityRef, sequence_numbers: Sequence[int]) -> None:
        """Cancel at the primary; raises `GatewayError`."""
        ...


@dataclass(frozen=True, slots=True)
class Answer:
    """A management reply: its status, description, condition (on failure) and body."""

    status: int
    description: str
    condition: str | None = None
    body: Any = None

    def application_properties(self) -> dict[str, Any]:
        props: dict[str, Any] = {
            conventions.MGMT_STATUS_CODE: self.status,
            conventions.MGMT_STATUS_DESCRIPTION: self.description,
        }
        if self.condition is not None:
            props[conventions.MGMT_ERROR_CONDITION] = Symbol(self.condition)
        return props


def is_scheduling(operation: str | None) -> bool:
    return operation in (conventions.OP_SCHEDULE_MESSAGE, conventions.OP_CANCEL_SCHEDULED_MESSAGE)


def not_implemented(operation: str | None) -> Answer:
    return Answer(
        501,
        f"{operation or 'this operation'} is not served: {SENDERS_ONLY}",
        Condition.NOT_IMPLEMENTED,
        {},
    )


async def answer(
    operation: str | None,
    body: Any,
    name: str,
    *,
    catalog: EntityCatalog,
    limits: LimitSettings,
    authorize: Authorize,
    scheduler: Scheduler | None,
) -> Answer:
    """The reply to a management request for entity `name` (see the module docstring)."""
    if scheduler is None or not is_scheduling(operation):
        return not_implemented(operation)
    entity = catalog.find(name, None)
    if entity is None:
        return Answer(
            404, f"The messaging entity '{name[:200]}' could not be found.", Condition.NOT_FOUND
        )
    try:
        authorize(entity.path)
        if operation == conventions.OP_SCHEDULE_MESSAGE:
            messages = _scheduled_messages(body)
            check_sizes(messages, limits)
            numbers = await scheduler.schedule(entity, messages)
            return Answer(200, "ok", None, {"sequence-numbers": Array(map(Long, numbers), 0x81)})
        await scheduler.cancel(entity, _sequence_numbers(body))
        return Answer(200, "ok", None, {})
    except AuthError as err:
        return Answer(401, f"{err.code}: {err.message}", Condition.UNAUTHORIZED_ACCESS)
    except GatewayError as err:
        return Answer(err.status, err.message, amqp_rejection(err))


def _field(value: Any, key: str) -> Any:
    """A map entry by name, whatever the client encoded the name as (string, symbol,
    binary: pyamqp sends its keys as it has them)."""
    if not isinstance(value, dict):
        return None
    for k, v in value.items():
        if k == key or (isinstance(k, bytes) and k == key.encode()):
            return v
    return None


def _scheduled_messages(body: Any) -> list[OutboundMessage]:
    items = _field(body, "messages")
    if not isinstance(items, list) or not items:
        raise MalformedMessage("a schedule-message request without messages")
    out = []
    for item in items:
        encoded = _field(item, "message")
        if not isinstance(encoded, bytes):
            raise MalformedMessage("a scheduled message is not an encoded message")
        out.append(to_outbound(encoded))
    return out


def _sequence_numbers(body: Any) -> list[int]:
    numbers = _field(body, "sequence-numbers")
    if (
        not isinstance(numbers, list)
        or not numbers
        or len(numbers) > _MAX_SEQUENCE_NUMBERS
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
    ):
        raise MalformedMessage("a cancel-scheduled-message request needs sequence numbers")
    return [int(n) for n in numbers]
