"""Scheduling at the primary, for the AMQP edge's `schedule_messages` and
`cancel_scheduled_messages` (docs/amqp.md, "Scheduling").

A scheduled message's sequence number is the primary entity's: it exists only once the
primary stored the message, and a later cancel names it. So both operations go to the
primary, through the SDK's own management requests, and only while the entity is healthy:
while it is failing or failed over there is no honest sequence number to give (a message
moved home by the syphon gets a new one), and the answer is `server-busy`, which the SDKs
back off from and retry. Sending with a scheduled enqueue time stays failover-capable.

One sender per operation, closed after it: scheduling is rare, and it keeps these links
apart from the dispatcher's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from azure.servicebus.aio import ServiceBusSender

from gateway.config import TimeoutSettings
from gateway.core.entities import EntityRef
from gateway.core.message import OutboundMessage
from gateway.errors import SERVER_BUSY, TIMEOUT, SendFailure
from gateway.lifetimes import Closer
from gateway.servicebus.client import CLOSE_TIMEOUT, SdkNamespaceClient, to_amqp
from gateway.servicebus.errors import map_exceptions

log = logging.getLogger(__name__)


class SdkScheduler:
    """Schedule and cancel at each pair's primary namespace (see the module docstring).

    `healthy(entity)`: whether failover has the entity on its primary (always, without
    failover)."""

    def __init__(
        self,
        primaries: Mapping[str, SdkNamespaceClient],
        timeouts: TimeoutSettings,
        healthy: Callable[[EntityRef], bool] = lambda _entity: True,
    ) -> None:
        self._primaries = primaries
        self._timeout = timeouts.send_timeout + timeouts.connect_timeout
        self._healthy = healthy
        self._closer = Closer("scheduler")

    async def schedule(self, entity: EntityRef, messages: Sequence[OutboundMessage]) -> list[int]:
        """The sequence numbers of `messages`, scheduled at the primary at their own
        scheduled enqueue times; raises `SendFailure` (server-busy while not healthy)."""
        sdk = [(m.scheduled_enqueue_time_utc, to_amqp(m)) for m in messages]
        numbers: list[int] = []

        async def run(sender: ServiceBusSender) -> None:
            for when, message in sdk:
                at = when or dt.datetime.now(dt.UTC)
                numbers.extend(await sender.schedule_messages(message, at))

        await self._with_sender(entity, run)
        return numbers

    async def cancel(self, entity: EntityRef, sequence_numbers: Sequence[int]) -> None:
        """Cancel scheduled messages at the primary; raises `SendFailure`."""

        async def run(sender: ServiceBusSender) -> None:
            await sender.cancel_scheduled_messages(list(sequence_numbers))

        await self._with_sender(entity, run)

    async def _with_sender(
        self, entity: EntityRef, run: Callable[[ServiceBusSender], Awaitable[None]]
    ) -> None:
        if not self._healthy(entity):
            raise SendFailure(
                SERVER_BUSY,
                f"entity {entity.path} is not on its primary namespace now: scheduled messages "
                "need its sequence numbers (send with a scheduled enqueue time instead)",
            )
        client = self._primaries[entity.pair]
        sb = client.sdk_client
        where = f"{client.name}/{entity.path}"
        sender = (
            sb.get_topic_sender(entity.path)
            if entity.kind == "topic"
            else sb.get_queue_sender(entity.path)
        )
        try:
            async with asyncio.timeout(self._timeout):
                with map_exceptions(where):
                    await sender.__aenter__()
                    await run(sender)
        except TimeoutError:
            raise SendFailure(
                TIMEOUT, f"{where}: scheduling took over {self._timeout:g}s"
            ) from None
        finally:
            await self._closer.run(
                f"closing scheduler sender {where}", sender.close(), CLOSE_TIMEOUT
            )

    async def close(self) -> None:
        await self._closer.aclose()
