"""The one map from azure-servicebus exceptions to the gateway's classification rows.

Modelled on httpx's transport: one exception map (`SDK_EXCEPTIONS`) and one context manager
(`map_exceptions`) that every SDK call of the adapter runs inside. The rows themselves —
what each failure means for retries, failover and the client's answer — are defined once,
without the SDK, in `gateway.errors` (the engine raises some of them itself). docs/errors.md
is rendered from both.
"""

from __future__ import annotations

import contextlib
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
from gateway.errors import Classification, SendFailure

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


def classify(exc: BaseException) -> Classification:
    """The row of `exc`: its most specific mapped type, else `UNKNOWN`."""
    for cls in type(exc).__mro__:
        row = SDK_EXCEPTIONS.get(cls)
        if row is not None:
            return row
    return errors.UNKNOWN


def translate(exc: BaseException, where: str) -> SendFailure:
    """An SDK exception → the `SendFailure` the core acts on. Never leaks credentials:
    only the exception's class and its first line go into the message."""
    first_line = (str(exc).splitlines() or [""])[0][:200]
    return SendFailure(classify(exc), f"{where}: {type(exc).__name__}: {first_line}".rstrip(": "))


@contextlib.contextmanager
def map_exceptions(where: str) -> Iterator[None]:
    """Run SDK calls inside: any exception becomes the `SendFailure` of its row, chained to
    the original. A `SendFailure` passes through; cancellation (not an `Exception`) is never
    caught. `where` (namespace/entity) prefixes the failure's message."""
    try:
        yield
    except SendFailure:
        raise
    except Exception as exc:
        raise translate(exc, where) from exc
