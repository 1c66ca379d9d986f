"""The one table that translates azure-servicebus exceptions into gateway classifications.

Read top to bottom; the first row whose exception type matches wins (subclasses first).
The README's "Errors" section renders this table. `counts_toward_failover` follows the old
SDK's paired-namespace rule (SPEC §1): non-transient messaging errors and timeouts count;
server-busy and unauthorized never do.
"""

from __future__ import annotations

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

from gateway.errors import Classification, FailureKind, SendFailure


def _row(
    kind: FailureKind,
    *,
    transient: bool,
    counts: bool,
    status: int = 503,
    retry_after: float | None = 10.0,
    recreate: bool = False,
) -> Classification:
    return Classification(
        kind=kind,
        transient=transient,
        counts_toward_failover=counts,
        http_status=status,
        retry_after=retry_after,
        recreate_sender=recreate,
    )


# (SDK exception type, classification). Order matters: most specific first.
TABLE: tuple[tuple[type[BaseException], Classification], ...] = (
    (ServiceBusServerBusyError, _row(FailureKind.SERVER_BUSY, transient=True, counts=False)),
    (ServiceBusAuthorizationError, _row(FailureKind.UNAUTHORIZED, transient=False, counts=False)),
    (
        ServiceBusAuthenticationError,
        _row(FailureKind.UNAUTHORIZED, transient=False, counts=False, recreate=True),
    ),
    (
        MessageSizeExceededError,
        _row(
            FailureKind.MESSAGE_TOO_LARGE,
            transient=False,
            counts=False,
            status=413,
            retry_after=None,
        ),
    ),
    (OperationTimeoutError, _row(FailureKind.TIMEOUT, transient=True, counts=True, recreate=True)),
    (
        MessagingEntityNotFoundError,
        _row(FailureKind.ENTITY_NOT_FOUND, transient=False, counts=True, recreate=True),
    ),
    (
        MessagingEntityDisabledError,
        _row(FailureKind.ENTITY_DISABLED, transient=False, counts=True, recreate=True),
    ),
    (
        ServiceBusQuotaExceededError,
        _row(FailureKind.QUOTA_EXCEEDED, transient=False, counts=True),
    ),
    (
        ServiceBusConnectionError,
        _row(FailureKind.CONNECTION, transient=False, counts=True, recreate=True),
    ),
    (
        ServiceBusCommunicationError,
        _row(FailureKind.CONNECTION, transient=False, counts=True, recreate=True),
    ),
    (ServiceBusError, _row(FailureKind.SERVICE, transient=False, counts=True, recreate=True)),
)

UNKNOWN = _row(FailureKind.UNKNOWN, transient=False, counts=True, recreate=True)
# Not an SDK exception row: a ValueError/TypeError raised while *building* a message is the
# client's input (the send never started), so it is a 400 and never counts toward failover.
INVALID_MESSAGE = _row(
    FailureKind.INVALID_MESSAGE, transient=False, counts=False, status=400, retry_after=None
)


def classify(exc: BaseException) -> Classification:
    """The classification of an SDK exception (`UNKNOWN` for anything not in the table)."""
    for exc_type, classification in TABLE:
        if isinstance(exc, exc_type):
            return classification
    return UNKNOWN


def translate(exc: BaseException, where: str) -> SendFailure:
    """An SDK exception → the `SendFailure` the core acts on. Never leaks credentials:
    only the exception's class and its first line go into the message."""
    c = classify(exc)
    first_line = (str(exc).splitlines() or [""])[0][:200]
    return SendFailure(c, f"{where}: {type(exc).__name__}: {first_line}".rstrip(": "))
