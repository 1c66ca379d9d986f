"""Drain entities through the SDK (receive-and-delete) and return what was delivered.

The checker's own small drain (the gateway's `gateway drain` tool can replace it once merged:
same record shape). Each record: ``{"message_id", "entity", "source", "queue",
"dead_letter_reason", "content_type"}`` where ``entity`` is the original entity (for a backlog
message: its ``x-ms-path``), ``source`` is ``primary`` or ``backlog`` and ``queue`` the path
that was drained (``.../$DeadLetterQueue`` for a dead-letter queue). Pings are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from azure.servicebus import ServiceBusReceiveMode, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver

from gateway.core.backlog import PATH, PING_CONTENT_TYPE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Source:
    """One entity to drain: a queue, or a topic subscription (``topic`` + ``subscription``)."""

    namespace: str  # "primary" or "backlog"
    path: str  # queue path, or the topic path
    subscription: str | None = None
    dead_letter: bool = False

    @property
    def label(self) -> str:
        base = (
            self.path
            if self.subscription is None
            else (f"{self.path}/Subscriptions/{self.subscription}")
        )
        return base + ("/$DeadLetterQueue" if self.dead_letter else "")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _open(client: ServiceBusClient, src: Source, prefetch: int) -> ServiceBusReceiver:
    kw: dict[str, Any] = {
        "receive_mode": ServiceBusReceiveMode.RECEIVE_AND_DELETE,
        "prefetch_count": prefetch,
    }
    if src.dead_letter:
        kw["sub_queue"] = ServiceBusSubQueue.DEAD_LETTER
    if src.subscription is not None:
        return client.get_subscription_receiver(src.path, src.subscription, **kw)
    return client.get_queue_receiver(src.path, **kw)


async def drain_source(
    client: ServiceBusClient,
    src: Source,
    *,
    idle_timeout: float = 1.0,
    batch: int = 250,
    deadline: float = 300.0,
) -> list[dict[str, Any]]:
    """Receive-and-delete everything from `src` until a receive comes back empty."""
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(deadline):
        receiver = _open(client, src, prefetch=batch)
        async with receiver:
            while True:
                msgs = await receiver.receive_messages(
                    max_message_count=batch, max_wait_time=idle_timeout
                )
                if not msgs:
                    break
                drained_at = datetime.now(UTC).isoformat()
                for m in msgs:
                    if m.content_type == PING_CONTENT_TYPE:
                        continue
                    props = m.application_properties or {}
                    entity = _text(props.get(PATH.encode()) or props.get(PATH))
                    out.append(
                        {
                            "message_id": _text(m.message_id),
                            "entity": entity or src.path,
                            "source": src.namespace,
                            "queue": src.label,
                            "dead_letter_reason": m.dead_letter_reason,
                            "content_type": m.content_type,
                            "enqueued_time": m.enqueued_time_utc.isoformat()
                            if m.enqueued_time_utc
                            else None,
                            "drained_at": drained_at,
                        }
                    )
    return out


async def drain(
    connection_string: str,
    sources: Sequence[Source],
    *,
    idle_timeout: float = 1.0,
    deadline: float = 300.0,
    parallel: int = 8,
) -> list[dict[str, Any]]:
    """Drain `sources` of one namespace, `parallel` at a time; every record in one list."""
    results: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(parallel)
    async with ServiceBusClient.from_connection_string(connection_string) as client:

        async def one(src: Source) -> None:
            async with sem:
                results.extend(
                    await drain_source(client, src, idle_timeout=idle_timeout, deadline=deadline)
                )

        async with asyncio.TaskGroup() as tg:
            for s in sources:
                tg.create_task(one(s))
    return results
