"""The SDK receivers of the syphon: its `BacklogPort`, peek-lock receivers on backlog queues.

(The backlog queues' paths and the message rewrite are engine logic: `gateway.core.backlog`.)
Receivers are opened once per backlog queue and reused (opening costs ~0.5 s); an open
receiver with no receive call in progress grants no credit, so it costs no broker operation
while idle. Every SDK error is translated by the one table in `gateway.servicebus.errors`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiveMode
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver

from gateway.config import NamespaceSettings
from gateway.core.message import AppValue, OutboundMessage
from gateway.core.ports import Received
from gateway.errors import BrokerFailure
from gateway.servicebus.admin import admin_client
from gateway.servicebus.errors import map_exceptions

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _text(value: Any) -> Any:
    # pyamqp hands AMQP strings back as bytes; REST clients can only send text properties,
    # so a value that decodes as UTF-8 is a string.
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    return value


def from_sdk(m: ServiceBusReceivedMessage) -> OutboundMessage:
    """A received message as an `OutboundMessage` (body, system and application properties)."""
    props: dict[str, AppValue] = {}
    for k, v in (m.application_properties or {}).items():
        props[str(_text(k))] = _text(v)
    body = m.body
    if isinstance(body, bytes | bytearray):
        data = bytes(body)
    else:
        data = b"".join(bytes(part) for part in body)
    return OutboundMessage(
        body=data,
        message_id=str(m.message_id) if m.message_id is not None else "",
        content_type=m.content_type,
        correlation_id=m.correlation_id,
        session_id=m.session_id,
        subject=m.subject,
        reply_to=m.reply_to,
        reply_to_session_id=m.reply_to_session_id,
        to=m.to,
        time_to_live=None,  # the backlog's own TTL; the original is in x-ms-timetolive
        scheduled_enqueue_time_utc=None,
        partition_key=None,
        application_properties=props,
    )


class SdkBacklogPort:
    """`BacklogPort` over one secondary namespace's `ServiceBusClient`.

    `credential`: the process's shared one, for the depth checks' admin client when the
    namespace is given by name (its owner closes it)."""

    def __init__(
        self,
        client: ServiceBusClient,
        settings: NamespaceSettings,
        credential: AsyncTokenCredential | None = None,
    ) -> None:
        self._client = client
        self._settings = settings
        self._credential = credential
        self._receivers: dict[str, ServiceBusReceiver] = {}
        # Peeks go through receivers of their own: never on a link with a receive waiting.
        self._peekers: dict[str, ServiceBusReceiver] = {}

    async def _receiver(self, path: str, peek: bool = False) -> ServiceBusReceiver:
        receivers = self._peekers if peek else self._receivers
        r = receivers.get(path)
        if r is None:
            r = self._client.get_queue_receiver(
                path, receive_mode=ServiceBusReceiveMode.PEEK_LOCK, prefetch_count=0
            )
            try:
                await r.__aenter__()
            except BaseException:
                with contextlib.suppress(Exception):
                    await r.close()
                raise
            receivers[path] = r
        return r

    async def _call(
        self,
        path: str,
        op: Callable[[ServiceBusReceiver], Awaitable[_T]],
        peek: bool = False,
    ) -> _T:
        try:
            with map_exceptions(f"{self._settings.name}/{path}", BrokerFailure):
                return await op(await self._receiver(path, peek))
        except BrokerFailure as failure:
            if failure.classification.recreate_sender:
                await self._drop(path)
            raise

    async def _drop(self, path: str) -> None:
        for receivers in (self._receivers, self._peekers):
            r = receivers.pop(path, None)
            if r is not None:
                with contextlib.suppress(Exception):
                    await r.close()

    async def receive(self, path: str, max_count: int, wait: float) -> list[Received]:
        async def op(r: ServiceBusReceiver) -> list[ServiceBusReceivedMessage]:
            return await r.receive_messages(max_message_count=max_count, max_wait_time=wait)

        out: list[Received] = []
        for m in await self._call(path, op):
            locked = m.locked_until_utc
            unreadable: str | None = None
            try:  # per message: one that cannot be read must not lose the others
                message = from_sdk(m)
            except Exception as exc:  # anyone with Send on the namespace can write anything
                unreadable = f"{type(exc).__name__}: {exc}"[:200]
                message = OutboundMessage(body=b"", message_id=str(m.message_id)[:128])
            out.append(
                Received(
                    message=message,
                    handle=m,
                    locked_until=locked.timestamp() if locked else None,
                    delivery_count=m.delivery_count or 0,
                    unreadable=unreadable,
                    sequence=m.sequence_number,
                )
            )
        return out

    async def complete(self, path: str, message: Received) -> None:
        await self._call(path, lambda r: r.complete_message(message.handle))

    async def abandon(self, path: str, message: Received) -> None:
        await self._call(path, lambda r: r.abandon_message(message.handle))

    async def dead_letter(
        self, path: str, message: Received, reason: str, description: str
    ) -> None:
        await self._call(
            path,
            lambda r: r.dead_letter_message(
                message.handle, reason=reason, error_description=description
            ),
        )

    async def renew(self, path: str, message: Received) -> float | None:
        new = await self._call(path, lambda r: r.renew_message_lock(message.handle))
        return new.timestamp() if new is not None else None

    async def peek(
        self, path: str, from_sequence: int, max_count: int
    ) -> list[tuple[int, OutboundMessage | None]]:
        async def op(r: ServiceBusReceiver) -> list[ServiceBusReceivedMessage]:
            # An explicit start: the SDK reads 0 as "after the last message received".
            return await r.peek_messages(
                max_message_count=max_count, sequence_number=max(from_sequence, 1)
            )

        out: list[tuple[int, OutboundMessage | None]] = []
        for m in await self._call(path, op, peek=True):
            try:
                message: OutboundMessage | None = from_sdk(m)
            except Exception:  # anyone with Send on the namespace can write anything
                message = None
            out.append((int(m.sequence_number or 0), message))
        return out

    async def depths(self, paths: Sequence[str]) -> dict[str, int] | None:
        wanted = {p.lower(): p for p in paths}
        found: dict[str, int] = {}
        try:
            client = admin_client(self._settings, self._credential)
            async with client:
                async for q in client.list_queues_runtime_properties():
                    key = q.name.lower()
                    if key in wanted:
                        found[wanted[key]] = int(q.active_message_count or 0)
        except Exception as exc:  # the safety check falls back to receiving
            log.warning("backlog depth check failed: %s", exc)
            return None
        return {p: found.get(p, 0) for p in paths}

    async def reset(self) -> None:
        for path in {*self._receivers, *self._peekers}:
            await self._drop(path)

    async def close(self) -> None:
        await self.reset()
