"""The AMQP edge's column of the error table: every outcome that is not stored settles
`rejected` with the condition that makes the SDKs raise what their users handle."""

from __future__ import annotations

import pytest

from gateway import errors
from gateway.auth import ErrorCode, Forbidden, Unauthorized
from gateway.core.failover import NoBacklogAvailable
from gateway.errors import (
    Draining,
    GatewayError,
    InvalidEntityPath,
    NotCarried,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    Saturated,
    SendFailure,
    UnknownEntity,
    amqp_rejection,
)

pytestmark = pytest.mark.unit

BUSY = "com.microsoft:server-busy"

# One line per row of the classification table: the condition, and the exception the
# Python SDK (7.15.0) raises for it (docs/amqp.md, "Outcomes").
ROWS = {
    errors.SERVER_BUSY: BUSY,  # ServiceBusServerBusyError, retried
    errors.UNAUTHORIZED: BUSY,  # the gateway's own credentials: not the client's problem
    errors.UNAUTHENTICATED: BUSY,
    errors.MESSAGE_TOO_LARGE: "amqp:link:message-size-exceeded",  # MessageSizeExceededError
    errors.TIMEOUT: "com.microsoft:timeout",  # OperationTimeoutError, retried
    errors.ENTITY_NOT_FOUND: "amqp:not-found",  # MessagingEntityNotFoundError
    errors.ENTITY_DISABLED: "com.microsoft:entity-disabled",  # MessagingEntityDisabledError
    errors.QUOTA_EXCEEDED: "amqp:resource-limit-exceeded",  # ServiceBusQuotaExceededError
    errors.CONNECTION: BUSY,
    errors.SERVICE: BUSY,
    errors.UNKNOWN: BUSY,
    errors.INVALID_MESSAGE: "amqp:not-allowed",  # ServiceBusError, not retried
    errors.MESSAGE_REFUSED: "amqp:not-allowed",
    errors.SHUTDOWN: BUSY,
}


def test_every_row_has_its_condition() -> None:
    assert set(ROWS) == set(errors.CLASSIFICATIONS)


@pytest.mark.parametrize("row", errors.CLASSIFICATIONS, ids=lambda r: r.kind.value)
def test_a_send_failure_is_rejected_with_its_rows_condition(row: errors.Classification) -> None:
    assert amqp_rejection(SendFailure(row, "x")) == ROWS[row]


@pytest.mark.parametrize("row", [r for r in errors.CLASSIFICATIONS if r.message_fault])
def test_a_message_fault_keeps_the_brokers_own_condition(row: errors.Classification) -> None:
    failure = SendFailure(row, "x")
    failure.condition = "com.microsoft:argument-error"
    assert amqp_rejection(failure) == "com.microsoft:argument-error"


def test_an_entity_failure_never_passes_the_brokers_condition_on() -> None:
    failure = SendFailure(errors.SERVICE, "x")
    failure.condition = "amqp:internal-error"
    assert amqp_rejection(failure) == BUSY


@pytest.mark.parametrize(
    ("error", "condition"),
    [
        (Saturated("x"), BUSY),
        (Overloaded("x"), BUSY),
        (Draining("x"), BUSY),
        (NoBacklogAvailable("x"), BUSY),
        (GatewayError("x"), BUSY),
        (UnknownEntity("x"), "amqp:not-found"),
        (InvalidEntityPath("x"), "amqp:not-found"),
        (PayloadTooLarge("x"), "amqp:link:message-size-exceeded"),
        (Unauthorized(ErrorCode.TOKEN_EXPIRED, "x"), "amqp:unauthorized-access"),
        (Forbidden(ErrorCode.MISSING_RIGHT, "x"), "amqp:unauthorized-access"),
        (NotCarried("x"), "amqp:not-implemented"),
        (RequestError("x"), "amqp:not-allowed"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v,
)
def test_a_request_error_is_rejected_with_its_classs_condition(
    error: GatewayError, condition: str
) -> None:
    assert amqp_rejection(error) == condition
