"""The Service Bus adapter: the only module that drives the azure-servicebus SDK for sending.

One `ServiceBusClient` per namespace, opened at start-up and closed at shutdown. Every
sender's link goes over the namespace's small pool of shared AMQP connections
(`internals.ConnectionPool`), not over a connection of its own. The dispatcher opens senders
when an entity's load needs them and reuses them until they sit idle; it uses each one for
one send at a time (sharing a sender across concurrent sends is unreliable in the SDK, see
azure-sdk-for-python#36334) and asks for a new one when a failure makes the link suspect.
A batch is encoded below the SDK's public API (`internals.encode` and `internals.add`); one
message on a pooled sender is sent by `internals.send_one`, everything else by
`send_messages`. What this borrows from the SDK's insides is all behind that one seam,
`gateway.servicebus.internals`; this module uses the SDK's public API only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from azure.servicebus import ServiceBusMessageBatch
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageHeader, AmqpMessageProperties

from gateway.config import NamespaceSettings, TimeoutSettings
from gateway.core.message import OutboundMessage
from gateway.errors import INVALID_MESSAGE, SendFailure
from gateway.lifetimes import Closer, TaskObserver
from gateway.servicebus import internals
from gateway.servicebus.errors import map_exceptions, translate

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

log = logging.getLogger(__name__)

# Our deadline on closing a sender or a client: a link that is half open, or a namespace that
# went away, can leave the SDK's close waiting indefinitely. Enforced by `Closer`, which holds
# whether or not the SDK honours the cancellation (gateway/lifetimes/closing.py says why it
# may not).
CLOSE_TIMEOUT = 5.0
# Closing a namespace's pooled connections: each stops its reader after its current read
# (0.5 s) and closes its connection within its own deadline (5 s), in parallel.
POOL_CLOSE_TIMEOUT = 6.0

T = TypeVar("T")


def to_amqp(m: OutboundMessage) -> AmqpAnnotatedMessage:
    """An `OutboundMessage` as the AMQP message the SDK sends (what is on the wire).

    The same outgoing message as a `ServiceBusMessage` with the same properties gives
    (tests/gateway/test_sdk_mapping.py compares them field by field) at half the CPU:
    `ServiceBusMessage` runs a property setter per field, each re-checking and re-creating
    parts of the message. Raises ValueError where `ServiceBusMessage` would (ids over 128
    characters, PartitionKey != SessionId): a message from a backlog queue has not been
    through the REST parser's checks. Batches skip it: `internals.encode` goes straight to the
    encoded bytes."""
    internals.check(m)
    annotations: dict[str | bytes, Any] = {}
    # In ServiceBusMessage's order: the encoded map follows it.
    if m.scheduled_enqueue_time_utc is not None:
        annotations[internals.SCHEDULED_ENQUEUE_TIME] = m.scheduled_enqueue_time_utc
    if m.partition_key:
        annotations[internals.PARTITION_KEY] = m.partition_key
    # In ms; the SDK derives creation and absolute expiry times from it when it sends.
    header = AmqpMessageHeader(time_to_live=internals.ttl_ms(m))
    return AmqpAnnotatedMessage(
        data_body=m.body,
        header=header,
        properties=AmqpMessageProperties(
            message_id=m.message_id,
            to=m.to,
            subject=m.subject,
            reply_to=m.reply_to,
            correlation_id=m.correlation_id,
            content_type=m.content_type,
            group_id=m.session_id,
            reply_to_group_id=m.reply_to_session_id,
        ),
        application_properties={
            k: internals.amqp_value(v) for k, v in m.application_properties.items()
        }
        or None,
        # Typed dict[str, Any] in the SDK, which itself uses these bytes keys.
        annotations=cast(dict[str, Any], annotations),
    )


class SdkSender:
    """A `Sender` over one open `ServiceBusSender`. `closer` (its namespace client's, which
    owns what outlives a close; default: its own) bounds its close."""

    def __init__(
        self,
        namespace: str,
        path: str,
        sender: ServiceBusSender,
        closer: Closer | None = None,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        self._where = f"{namespace}/{path}"
        self._sender = sender
        self._closer = closer or Closer(f"sender {self._where}")
        self._release: Callable[[], None] | None = release

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        if len(messages) == 1 and internals.can_send_one(self._sender):
            try:  # encoded once, sent as it is (gateway/servicebus/internals/lean.py)
                payload = internals.encode(messages[0])
            except (ValueError, TypeError) as exc:
                raise self._invalid(exc) from exc
            with map_exceptions(self._where):
                await internals.send_one(self._sender, payload)
            return
        if len(messages) == 1 or not internals.applies():
            await self._send_via_sdk(messages)
            return
        try:  # each message encoded once (gateway/servicebus/internals/encoding.py)
            encoded = [(m, internals.encode(m)) for m in messages]
        except (ValueError, TypeError) as exc:
            raise self._invalid(exc) from exc
        with map_exceptions(self._where):
            await self._send_batches(encoded, lambda batch, item: internals.add(batch, *item))

    async def _send_via_sdk(self, messages: Sequence[OutboundMessage]) -> None:
        """The SDK's own path: one message, or a batch while `encoding` does not apply. Each
        message is encoded here first, as the SDK will: what cannot be encoded is the
        message's fault (400), found before any SDK call, and anything raised inside the
        SDK's send is the SDK's (gateway.servicebus.errors)."""
        try:
            for m in messages:
                internals.encode(m)
            sdk_messages = [to_amqp(m) for m in messages]
        except (ValueError, TypeError) as exc:
            raise self._invalid(exc) from exc
        with map_exceptions(self._where):
            if len(sdk_messages) == 1:
                await self._sender.send_messages(sdk_messages[0])
                return
            await self._send_batches(sdk_messages, ServiceBusMessageBatch.add_message)

    async def _send_batches(
        self, items: Sequence[T], add: Callable[[ServiceBusMessageBatch, T], None]
    ) -> None:
        """`add` every item to one batch of the link's size, then send it: one broker
        transfer, stored all or none. When the items do not fit the link together, `add`
        refuses one (`MessageSizeExceededError`, the batch unchanged) and this raises before
        anything was sent: the dispatcher then bisects the call between its requests, and a
        request that does not fit alone gets 413 (never part of a call stored, then the rest
        refused, which a bisection would have sent again)."""
        batch = await self._sender.create_message_batch()
        for item in items:
            add(batch, item)
        await self._sender.send_messages(batch)

    def _invalid(self, exc: Exception) -> SendFailure:
        return SendFailure(INVALID_MESSAGE, f"{self._where}: the message is invalid: {exc}")

    async def close(self) -> None:
        """Within `CLOSE_TIMEOUT` (+ `CANCEL_GRACE`); never raises but CancelledError. A broken
        link may fail to close, or hang: it is discarded either way, and its place on the
        pooled connection is given back once."""
        try:
            await self._closer.run(
                f"closing sender {self._where}", self._sender.close(), CLOSE_TIMEOUT
            )
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


@functools.cache
def tls_context(cafile: str | None = None) -> ssl.SSLContext:
    """The TLS context of every AMQP connection: the SDK's own choice (certificates checked
    against certifi's bundle, or `cafile`, the SDK's ``connection_verify``), built once.
    Left to the SDK, each connection attempt builds one and loads the whole bundle into it:
    while a namespace is away, the reconnects in flight held tens of MiB of OpenSSL memory
    at once, and the freed memory stayed in the process (docs/performance.md, outage)."""
    import certifi

    return ssl.create_default_context(cafile=cafile or certifi.where())


class SdkNamespaceClient:
    """A `NamespaceClient` over one `ServiceBusClient`.

    A namespace given by name authenticates with `credential`, the process's shared one
    (gateway.servicebus.identity), which its owner closes: `close` leaves it open.
    `sdk_kwargs` go to the `ServiceBusClient` (tests: ``use_tls=False`` for the local broker).
    Sender links share `connections` AMQP connections (`internals.ConnectionPool`);
    `observer` counts their readers' restarts.
    """

    def __init__(
        self,
        settings: NamespaceSettings,
        timeouts: TimeoutSettings,
        credential: AsyncTokenCredential | None = None,
        *,
        connections: int = 4,
        observer: TaskObserver | None = None,
        **sdk_kwargs: Any,
    ) -> None:
        self._settings = settings
        retry: dict[str, Any] = {
            "retry_total": timeouts.sdk_retry_total,
            "retry_backoff_factor": 0.2,
            "retry_backoff_max": 2.0,
            **sdk_kwargs,
        }
        if "ssl_context" not in retry:  # one per process, not one per connection attempt
            retry["ssl_context"] = tls_context(retry.pop("connection_verify", None))
        if settings.connection_string is not None:
            self._client = ServiceBusClient.from_connection_string(
                settings.connection_string.get(), **retry
            )
        else:
            if credential is None or settings.fully_qualified_namespace is None:
                raise ValueError(f"namespace {settings.name}: no connection string, no credential")
            self._client = ServiceBusClient(settings.fully_qualified_namespace, credential, **retry)
        self.credential = credential if settings.connection_string is None else None
        self._topics: set[str] = set()
        # Owns the closes of this namespace's senders that outlive CLOSE_TIMEOUT, and the
        # cleanups of cancelled opens, until `close`.
        self._closer = Closer(f"namespace {settings.name}")
        self.pool = internals.ConnectionPool(self._client, connections, settings.name, observer)

    @property
    def name(self) -> str:
        return self._settings.name

    @property
    def sdk_client(self) -> ServiceBusClient:
        """The SDK client, for the syphon's receivers (same connection, same credential)."""
        return self._client

    def mark_topic(self, path: str) -> None:
        """Topic senders are opened with `get_topic_sender` (queues otherwise)."""
        self._topics.add(path.lower())

    async def open_sender(self, path: str) -> SdkSender:
        """Open a sender on one of the pooled connections. The open runs in a task of its
        own: cancelled (our deadline, or a shutdown), this returns at once, and the open's end
        (the SDK's own cleanup close has no deadline) and our close of the half-open sender
        go on, bounded, in the closer."""
        # No keep-alive task per link (the SDK's default polls the connection every second
        # per link): the links of a pooled connection are polled by their sends.
        if path.lower() in self._topics:
            sender = self._client.get_topic_sender(path, keep_alive=None)
        else:
            sender = self._client.get_queue_sender(path, keep_alive=None)
        slot = self.pool.bind(sender)
        where = f"{self.name}/{path}"
        opening = asyncio.create_task(_enter(sender), name=f"opening sender {where}")
        opening.add_done_callback(_retrieve)
        try:
            await asyncio.wait({opening})
        except asyncio.CancelledError:
            opening.cancel()
            self._closer.spawn(
                f"abandoning the open of {where}",
                _abandon(opening, sender, lambda: self.pool.unbind(slot)),
            )
            raise
        exc = opening.exception()
        if exc is not None:
            # The half-open sender is discarded either way.
            try:
                await self._closer.run(
                    f"closing half-open sender {where}", sender.close(), CLOSE_TIMEOUT
                )
            finally:
                self.pool.unbind(slot)
            if isinstance(exc, Exception):
                raise translate(exc, where) from exc
            raise exc
        return SdkSender(self.name, path, sender, self._closer, lambda: self.pool.unbind(slot))

    async def close(self) -> None:
        """Within `CLOSE_TIMEOUT` + `POOL_CLOSE_TIMEOUT` + 2 * `CANCEL_GRACE`, whatever the SDK
        does; never raises but CancelledError. The pooled connections close after
        the handlers: they end their sessions on them."""
        await self._closer.run(f"closing client {self.name}", self._client.close(), CLOSE_TIMEOUT)
        await self._closer.run(
            f"closing the connections of {self.name}", self.pool.close(), POOL_CLOSE_TIMEOUT
        )
        await self._closer.aclose()


async def _enter(sender: ServiceBusSender) -> None:
    await sender.__aenter__()


def _retrieve(task: asyncio.Task[None]) -> None:
    """An abandoned open's failure is no news: mark it retrieved."""
    if not task.cancelled():
        task.exception()


async def _abandon(
    opening: asyncio.Task[None], sender: ServiceBusSender, release: Callable[[], None]
) -> None:
    """After a cancelled open: let it end (a cancel it lost may even have let it open), then
    close the sender, each within `CLOSE_TIMEOUT`; cancelled at the latest by its owner's
    `Closer.aclose`. Its place on the pooled connection is given back in every case."""
    try:
        try:
            await asyncio.wait({opening}, timeout=CLOSE_TIMEOUT)
        finally:
            opening.cancel()  # nothing when it ended; else its first cancel was lost
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await sender.close()
    finally:
        release()
