"""One message, already encoded, sent over an open pooled sender: the SDK's send, leaner.

Why: spread over many entities, nearly every request is a broker operation of its own, and
the SDK's path for one message cost more CPU than the rest of the request
(docs/performance.md, "Many entities"): it builds an `AmqpAnnotatedMessage`, a
`ServiceBusMessage` and a pyamqp `Message` per send, encodes the message again, and then
polls the connection — each poll re-checking the CBS token and the link's pending
deliveries — until the disposition arrives.

What stays the SDK's: the two retry loops and their error translation, in the same nesting
(`ServiceBusSender._do_retryable_operation` → `_send`'s open → the transport's
`send_messages_async` exception mapping → the handler's `_do_retryable_operation_async`),
the link open (`_open`), the token check before each transfer (`client_ready_async`), the
delivery's bookkeeping and settlement (`send_transfer`, `update_pending_deliveries`,
`_on_send_complete_async`), and therefore every exception a failed send raises. What
differs: the payload is `encoding.encode`'s bytes (the same bytes the SDK encodes for the
same message: tests/gateway/test_sdk_mapping.py), handed to the link as they are
(`pyamqp_sharing.Encoded`); and the wait for the disposition is the pool's per-session
wake-up (`listen` of the handler's view), with the SDK's own iteration (`do_work_async`)
only when a wait ends without it. `usable` says when it applies: the pinned SDK, tracing
off, a sender opened on a pooled connection with its reader running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from azure.servicebus._common.utils import get_remaining_timeout
from azure.servicebus._pyamqp.constants import MESSAGE_DELIVERY_DONE_STATES, MessageDeliveryState
from azure.servicebus._pyamqp.error import ErrorCondition, MessageException
from azure.servicebus._pyamqp.message import _MessageDelivery
from azure.servicebus.aio import ServiceBusSender
from azure.servicebus.aio._transport._pyamqp_transport_async import PyamqpTransportAsync
from azure.servicebus.exceptions import OperationTimeoutError

from gateway.servicebus.internals import switch
from gateway.servicebus.internals.pyamqp_sharing import Encoded

# How long a send waits for its disposition before it runs one of the SDK's own iterations
# (token refresh, deliveries held back for credit) and waits again.
_WAIT = 1.0
# The SDK's own logger for what its transport logs on this path.
_sdk_log = logging.getLogger("azure.servicebus.aio._servicebus_sender_async")


def usable(sender: ServiceBusSender) -> bool:
    """Whether `send` may stand in for `send_messages` on `sender`: the encoding applies
    (pinned SDK, tracing off) and its handler polls a pooled connection whose reader runs."""
    if not switch.applies():
        return False
    if not getattr(sender, "_running", False):  # not open (or not the SDK's sender)
        return False
    view: Any = getattr(sender._handler, "_connection", None)
    return view is not None and getattr(view, "pooled_reading", False)


async def send(sender: ServiceBusSender, payload: bytearray) -> None:
    """`sender.send_messages(message)` for a message `encoding.encode` made `payload` of:
    the same retries, the same exceptions."""
    sender._check_live()  # type: ignore[no-untyped-call]
    await sender._do_retryable_operation(
        _send,
        sender=sender,
        payload=payload,
        timeout=None,
        operation_requires_timeout=True,
        apply_try_timeout=True,
        require_last_exception=True,
    )


async def _send(
    sender: ServiceBusSender,
    payload: bytearray,
    timeout: float | None = None,  # noqa: ASYNC109 (the SDK's retry loop passes it)
    last_exception: Exception | None = None,
) -> None:
    """`ServiceBusSender._send` and `PyamqpTransportAsync.send_messages_async`."""
    attempt_started = time.monotonic()
    await sender._open(timeout)
    remaining = get_remaining_timeout(timeout, attempt_started)
    await sender._open()
    handler: Any = sender._handler
    try:
        await handler._do_retryable_operation_async(
            _transfer, handler, Encoded(payload), timeout=remaining
        )
    except TimeoutError as exc:
        raise OperationTimeoutError(message="Send operation timed out") from exc
    except MessageException as e:
        raise PyamqpTransportAsync.create_servicebus_exception(_sdk_log, e) from None


async def _transfer(handler: Any, message: Encoded, *, timeout: float = 0) -> None:  # noqa: ASYNC109
    """`SendClientAsync._send_message_impl_async`, waiting on the pool's wake-ups."""
    expire_time = (time.time() + timeout) if timeout else None
    await handler.open_async()
    delivery: Any = _MessageDelivery(  # type: ignore[no-untyped-call]
        message, MessageDeliveryState.WaitingToBeSent, expire_time
    )
    while not await handler.client_ready_async():  # noqa: ASYNC110 (the SDK's loop)
        await asyncio.sleep(0.05)
    await handler._transfer_message_async(delivery, timeout)
    # The first iteration of the SDK's loop (`_client_run_async`) without its token check,
    # done just above: the transfer goes out now if the link has credit.
    await handler._link.update_pending_deliveries()
    running = True
    while delivery.state not in MESSAGE_DELIVERY_DONE_STATES:
        # Woken by a frame to this handler's session, or the connection's end: no need to
        # poll every `socket_timeout` (0.2 s) as the SDK does, which under load made a send
        # cost several polls, each re-checking the token and the link.
        await handler._connection.listen(wait=max(handler._socket_timeout, _WAIT))
        if delivery.state in MESSAGE_DELIVERY_DONE_STATES:
            break
        running = await handler.do_work_async()
        if not running:
            break
    if delivery.state not in MESSAGE_DELIVERY_DONE_STATES:
        raise MessageException(
            condition=ErrorCondition.ClientError,
            description="Send failed - connection not running.",
        )
    if delivery.state in (
        MessageDeliveryState.Error,
        MessageDeliveryState.Cancelled,
        MessageDeliveryState.Timeout,
    ):
        try:
            raise delivery.error
        except TypeError:
            raise MessageException(
                condition=ErrorCondition.UnknownError, description="Send failed."
            ) from None
