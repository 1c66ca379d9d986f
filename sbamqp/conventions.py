"""Service Bus conventions on top of AMQP 1.0: node names, request/reply fields, formats.

These are the names and shapes the Service Bus SDKs use, collected in one place so that
the gateway edge and the local broker agree on them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BATCH_MESSAGE_FORMAT",
    "CBS_NODE",
    "CBS_OPERATION_PUT_TOKEN",
    "CBS_STATUS_CODE",
    "CBS_STATUS_DESCRIPTION",
    "DEAD_LETTER_QUEUE",
    "MANAGEMENT_NODE",
    "MGMT_ERROR_CONDITION",
    "MGMT_STATUS_CODE",
    "MGMT_STATUS_DESCRIPTION",
    "SASL_ANONYMOUS",
    "SASL_MSSBCBS",
    "VENDOR_MAX_MESSAGE_BATCH_SIZE",
    "Condition",
]

# Claims-based security: the node a client sends its token to (`put-token`), with the
# application properties `operation`, `type` (ignored: Python says "jwt" for a SAS token)
# and `name` (the audience), and the token as an AMQP-value body.
CBS_NODE: Final = "$cbs"
CBS_OPERATION_PUT_TOKEN: Final = "put-token"  # noqa: S105 (an operation name)
# The $cbs reply's status fields are hyphenated; an int code, 200-299 means accepted.
CBS_STATUS_CODE: Final = "status-code"
CBS_STATUS_DESCRIPTION: Final = "status-description"

# Each entity's management node, `<entity>/$management`; its replies use camel case.
MANAGEMENT_NODE: Final = "$management"
MGMT_STATUS_CODE: Final = "statusCode"
MGMT_STATUS_DESCRIPTION: Final = "statusDescription"
MGMT_ERROR_CONDITION: Final = "errorCondition"
MGMT_OPERATION: Final = "operation"
OP_SCHEDULE_MESSAGE: Final = "com.microsoft:schedule-message"
OP_CANCEL_SCHEDULED_MESSAGE: Final = "com.microsoft:cancel-scheduled-message"

DEAD_LETTER_QUEUE: Final = "$DeadLetterQueue"

# A batch: the transfer's message format is this value, and its body is one data section
# per encoded message. A message with format 0 whose body happens to be an encoded message
# is a single message, never a batch.
BATCH_MESSAGE_FORMAT: Final = 0x80013700

# Attach properties a sender reads from the server's attach.
VENDOR_MAX_MESSAGE_BATCH_SIZE: Final = "com.microsoft:max-message-batch-size"
# .NET puts it on its attach (an operation timeout in ms); accepted and ignored.
VENDOR_TIMEOUT: Final = "com.microsoft:timeout"
VENDOR_TRACKING_ID: Final = "com.microsoft:tracking-id"

# SASL: .NET names its anonymous handler MSSBCBS and offers nothing else; Python and Node
# pick ANONYMOUS. Both mean "no credentials here; the token comes over $cbs".
SASL_MSSBCBS: Final = "MSSBCBS"
SASL_ANONYMOUS: Final = "ANONYMOUS"


class Condition:
    """AMQP error conditions, each with the exception the SDKs raise for it.

    (Python SDK 7.15: the exception, and whether it retries.)
    """

    #: ServiceBusServerBusyError, retried.
    SERVER_BUSY: Final = "com.microsoft:server-busy"
    #: OperationTimeoutError, retried.
    TIMEOUT: Final = "com.microsoft:timeout"
    #: MessagingEntityNotFoundError, not retried.
    NOT_FOUND: Final = "amqp:not-found"
    #: MessagingEntityDisabledError, retried.
    ENTITY_DISABLED: Final = "com.microsoft:entity-disabled"
    #: ServiceBusQuotaExceededError, not retried.
    RESOURCE_LIMIT_EXCEEDED: Final = "amqp:resource-limit-exceeded"
    #: MessageSizeExceededError, not retried.
    MESSAGE_SIZE_EXCEEDED: Final = "amqp:link:message-size-exceeded"
    #: ServiceBusAuthorizationError, not retried.
    UNAUTHORIZED_ACCESS: Final = "amqp:unauthorized-access"
    #: ServiceBusError, not retried.
    NOT_IMPLEMENTED: Final = "amqp:not-implemented"
    NOT_ALLOWED: Final = "amqp:not-allowed"
    DECODE_ERROR: Final = "amqp:decode-error"
    ARGUMENT_ERROR: Final = "com.microsoft:argument-error"
    INTERNAL_ERROR: Final = "amqp:internal-error"
    INVALID_FIELD: Final = "amqp:invalid-field"
    PRECONDITION_FAILED: Final = "amqp:precondition-failed"
    # Connection, session and link errors the engine itself sends.
    CONNECTION_FORCED: Final = "amqp:connection:forced"
    FRAMING_ERROR: Final = "amqp:connection:framing-error"
    HANDLE_IN_USE: Final = "amqp:session:handle-in-use"
    UNATTACHED_HANDLE: Final = "amqp:session:unattached-handle"
    WINDOW_VIOLATION: Final = "amqp:session:window-violation"
    DETACH_FORCED: Final = "amqp:link:detach-forced"
