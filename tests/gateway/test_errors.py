"""The one error table: SDK exceptions → classification rows, and the rows themselves."""

from __future__ import annotations

import asyncio
import inspect
import logging
import struct

import azure.servicebus.exceptions as sdk_exceptions
import pytest
from azure.servicebus._pyamqp.error import ErrorCondition
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    OperationTimeoutError,
    ServiceBusCommunicationError,
    ServiceBusError,
)

from gateway import errors
from gateway.errors import CLASSIFICATIONS, FailureKind, SendFailure
from gateway.servicebus.errors import SDK_EXCEPTIONS, classify, map_exceptions, translate

SDK_TYPES = [
    cls
    for cls in vars(sdk_exceptions).values()
    if inspect.isclass(cls)
    and issubclass(cls, Exception)
    and cls.__module__.startswith("azure.servicebus")
]


def test_every_sdk_exception_has_a_row_of_the_table() -> None:
    """As httpx checks that every httpcore exception is mapped: a new SDK exception type
    cannot fall through to UNKNOWN unnoticed."""
    unknown = sorted(
        cls.__name__ for cls in SDK_TYPES if classify(cls.__new__(cls)) is errors.UNKNOWN
    )
    # Not a ServiceBusError: raised by our own misuse of a settled message, never by a send.
    assert unknown == [MessageAlreadySettled.__name__]
    assert set(SDK_EXCEPTIONS.values()) <= set(CLASSIFICATIONS)


def test_the_most_specific_type_wins() -> None:
    assert classify(ServiceBusCommunicationError(message="x")) is errors.CONNECTION
    assert classify(MessageLockLostError(message="x")) is errors.SERVICE  # via ServiceBusError
    assert classify(ServiceBusError(message="x")) is errors.SERVICE
    assert classify(KeyError("x")) is errors.UNKNOWN


def test_rows_follow_the_paired_namespace_rule() -> None:
    """Non-transient failures and timeouts count toward failover; server-busy, unauthorized
    and a message refused for its own sake never do."""
    never = {
        FailureKind.SERVER_BUSY,
        FailureKind.UNAUTHORIZED,
        FailureKind.MESSAGE_TOO_LARGE,
        FailureKind.INVALID_MESSAGE,
        FailureKind.MESSAGE_REFUSED,
    }
    for row in CLASSIFICATIONS:
        expected = (not row.transient or row.kind is FailureKind.TIMEOUT) and row.kind not in never
        assert row.counts_toward_failover is expected, row
        assert (row.retry_after is None) is (row.http_status != 503), row


def test_the_messages_own_faults_are_named_by_their_amqp_condition() -> None:
    """The SDK raises a bare ServiceBusError (which counts) for these: the condition decides."""
    for cond, row in [
        (ErrorCondition.DecodeError, errors.MESSAGE_REFUSED),
        (ErrorCondition.NotAllowed, errors.MESSAGE_REFUSED),
        (b"amqp:decode-error", errors.MESSAGE_REFUSED),
        (ErrorCondition.LinkMessageSizeExceeded, errors.MESSAGE_TOO_LARGE),
        (ErrorCondition.InternalError, errors.SERVICE),
    ]:
        assert classify(ServiceBusError(message="x", condition=cond)) is row, cond
    message_rows = {r.kind for r in CLASSIFICATIONS if r.message_fault}
    assert message_rows == {
        FailureKind.MESSAGE_TOO_LARGE,
        FailureKind.INVALID_MESSAGE,
        FailureKind.MESSAGE_REFUSED,
    }
    assert all(r.http_status in {400, 413} for r in CLASSIFICATIONS if r.message_fault)


@pytest.mark.parametrize(
    "inner",
    [
        TypeError("bad"),
        ValueError("bad"),
        struct.error("'I' format requires 0 <= number <= 4294967295"),
    ],
)
def test_a_python_error_inside_the_sdk_is_never_the_messages_fault(inner, caplog) -> None:
    """Issue 33: pyamqp raises these from its own bookkeeping too (a link's delivery count
    at 2**32 - 1: struct.error for a good message, which was answered 400 and not stored).
    Only the gateway's own encoding blames the message; inside the SDK it counts, and is
    logged with its traceback."""
    wrapped = ServiceBusError(message="Handler failed: bad", error=inner)
    assert classify(wrapped) is errors.SERVICE
    with caplog.at_level(logging.WARNING, logger="gateway.servicebus.errors"):
        failure = translate(wrapped, "p/orders")
    assert not failure.classification.message_fault
    assert failure.classification.counts_toward_failover
    assert classify(inner) is errors.UNKNOWN
    assert [r.exc_info is not None for r in caplog.records] == [True]


def test_each_row_is_named_once() -> None:
    assert len(set(CLASSIFICATIONS)) == len(CLASSIFICATIONS)
    assert {r.kind for r in CLASSIFICATIONS} == set(FailureKind)


def test_a_failure_says_its_row_and_never_more_than_the_first_line() -> None:
    failure = translate(
        OperationTimeoutError(message="no answer\nSharedAccessKey=secret"), "p/orders"
    )
    assert failure.classification is errors.TIMEOUT
    assert failure.code == "upstream_timeout" and failure.status == 503
    assert failure.message == "p/orders: OperationTimeoutError: no answer"


def test_map_exceptions_translates_and_chains() -> None:
    with pytest.raises(SendFailure) as info, map_exceptions("p/orders"):
        raise OperationTimeoutError(message="slow")
    assert info.value.classification is errors.TIMEOUT
    assert isinstance(info.value.__cause__, OperationTimeoutError)


def test_map_exceptions_lets_send_failures_and_cancellation_through() -> None:
    own = SendFailure(errors.INVALID_MESSAGE, "bad")
    with pytest.raises(SendFailure) as info, map_exceptions("p/orders"):
        raise own
    assert info.value is own
    with pytest.raises(asyncio.CancelledError), map_exceptions("p/orders"):
        raise asyncio.CancelledError
