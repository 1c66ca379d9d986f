"""The one map from azure-servicebus exceptions to the gateway's classification rows.

Modelled on httpx's transport: one exception map (`SDK_EXCEPTIONS`) and one context manager
(`map_exceptions`) that every SDK call of the adapter runs inside. The rows themselves —
what each failure means for retries, failover and the client's answer — are defined once,
without the SDK, in `gateway.errors` (the engine raises some of them itself). docs/errors.md
is rendered from both.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Iterator, Mapping

from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from gateway import errors
from gateway.errors import BrokerFailure, Classification, SendFailure

log = logging.getLogger(__name__)

# SDK exception type → its row. The most specific type in the exception's MRO wins (every
# SDK error is a `ServiceBusError`), so the order here does not matter; it follows the table.
SDK_EXCEPTIONS: Mapping[type[Exception], Classification] = {
    ServiceBusServerBusyError: errors.SERVER_BUSY,
    ServiceBusAuthorizationError: errors.UNAUTHORIZED,
    ServiceBusAuthenticationError: errors.UNAUTHENTICATED,
    MessageSizeExceededError: errors.MESSAGE_TOO_LARGE,
    OperationTimeoutError: errors.TIMEOUT,
    MessagingEntityNotFoundError: errors.ENTITY_NOT_FOUND,
    MessagingEntityDisabledError: errors.ENTITY_DISABLED,
    ServiceBusQuotaExceededError: errors.QUOTA_EXCEEDED,
    ServiceBusConnectionError: errors.CONNECTION,
    ServiceBusCommunicationError: errors.CONNECTION,
    ServiceBusError: errors.SERVICE,
}


# AMQP conditions that say more than the SDK exception carrying them: the SDK raises a bare
# `ServiceBusError` for a message the broker cannot decode or will not take, which by type
# alone would count toward failover. The condition wins over the type.
SDK_CONDITIONS: Mapping[str, Classification] = {
    "amqp:link:message-size-exceeded": errors.MESSAGE_TOO_LARGE,
    "amqp:decode-error": errors.MESSAGE_REFUSED,
    "amqp:not-allowed": errors.MESSAGE_REFUSED,
}
# Python errors the SDK raises from inside its send, or wraps in a bare `ServiceBusError`
# ("Handler failed"). They are never the message's fault: the gateway encodes every message
# itself before the SDK sees it (gateway.servicebus.client), so one raised inside the SDK
# comes from its own bookkeeping (a link's delivery count at 2**32 - 1 raised struct.error
# for a good message) and stays on the rows that count toward failover; it is logged with its
# traceback, as it may be a bug.
_PYTHON_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, struct.error)


def condition(exc: BaseException) -> str | None:
    """The AMQP error condition an SDK exception carries (``amqp:decode-error``), if any."""
    value = getattr(exc, "_condition", None)
    value = getattr(value, "value", value)  # pyamqp's ErrorCondition enum, or raw bytes
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None


def classify(exc: BaseException) -> Classification:
    """The row of `exc`: its AMQP condition's row, else its most specific mapped type, else
    `UNKNOWN`. Never `INVALID_MESSAGE`: that is only raised where the gateway encodes."""
    cond = condition(exc)
    if cond is not None and cond in SDK_CONDITIONS:
        return SDK_CONDITIONS[cond]
    for cls in type(exc).__mro__:
        row = SDK_EXCEPTIONS.get(cls)
        if row is not None:
            return row
    return errors.UNKNOWN


def translate(
    exc: BaseException, where: str, failure: type[BrokerFailure] = SendFailure
) -> BrokerFailure:
    """An SDK exception → the `SendFailure` the core acts on (or `failure`: a receiver's
    `BrokerFailure`). Never leaks credentials: only the exception's class and its first line
    go into the message."""
    first_line = (str(exc).splitlines() or [""])[0][:200]
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, _PYTHON_ERRORS) or (
        isinstance(exc, _PYTHON_ERRORS) and not isinstance(exc, ServiceBusError)
    ):
        log.warning(
            "%s: the SDK raised %s inside its send", where, type(exc).__name__, exc_info=exc
        )
    result = failure(classify(exc), f"{where}: {type(exc).__name__}: {first_line}".rstrip(": "))
    result.condition = condition(exc)  # the AMQP edge passes a message fault's on
    return result


@contextlib.contextmanager
def map_exceptions(where: str, failure: type[BrokerFailure] = SendFailure) -> Iterator[None]:
    """Run SDK calls inside: any exception becomes the `failure` (a sender's `SendFailure`, a
    receiver's `BrokerFailure`) of its row, chained to the original. A `BrokerFailure`
    passes through; cancellation (not an `Exception`) is never caught. `where`
    (namespace/entity) prefixes the failure's message."""
    try:
        yield
    except BrokerFailure:
        raise
    except Exception as exc:
        raise translate(exc, where, failure) from exc
