"""The gateway's error tree. Every error says what to do with it.

Two families:

* `RequestError` — the client's request is wrong or cannot be admitted. Raised by the HTTP
  edge and the engine's admission; carries the HTTP status and a stable `code`. The SAS
  authorization failures (`gateway.auth.errors`: 401 `Unauthorized`, 403 `Forbidden`) are
  request errors too, so one `except GatewayError` answers every refusal the same way.
* `SendFailure` — the broker did not store a message. It carries one row of the
  classification table below (`CLASSIFICATIONS`): whether a retry may help, whether it counts
  toward failover, and how to answer the client. The Service Bus adapter maps SDK exceptions
  onto these rows in exactly one place (`gateway.servicebus.errors`); the engine uses the
  rows for its own failures (its send deadline, shutdown) without importing the SDK.

Each row and each request error also names the AMQP condition the AMQP edge (gateway.amqp)
rejects a delivery with (`amqp_condition`): the one that makes every Service Bus SDK raise
the exception its users already handle for that case (docs/amqp.md, "Outcomes").

The table is rendered into docs/errors.md (tests/test_docs.py holds them equal); why each
row says what it says is in docs/design.md ("Errors").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

# AMQP error conditions (AMQP 1.0 section 2.8.15 and Service Bus's own) the AMQP edge settles
# a rejected delivery with. What each SDK raises for them: docs/amqp.md.
SERVER_BUSY_CONDITION = "com.microsoft:server-busy"
TIMEOUT_CONDITION = "com.microsoft:timeout"
NOT_FOUND = "amqp:not-found"
ENTITY_DISABLED_CONDITION = "com.microsoft:entity-disabled"
RESOURCE_LIMIT_EXCEEDED = "amqp:resource-limit-exceeded"
MESSAGE_SIZE_EXCEEDED = "amqp:link:message-size-exceeded"
UNAUTHORIZED_ACCESS = "amqp:unauthorized-access"
NOT_ALLOWED = "amqp:not-allowed"
NOT_IMPLEMENTED = "amqp:not-implemented"
INTERNAL_ERROR = "amqp:internal-error"


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""

    status: int = 500
    code: str = "internal_error"
    retry_after: float | None = None
    # The AMQP edge's rejection condition; None: by the status (`amqp_condition`).
    amqp_condition: str | None = None

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": code, "message": text, ...details}``."""
        return {"error": self.code, "message": self.message, **self.details}

    def headers(self) -> dict[str, str]:
        """The answer's own headers: ``Retry-After`` (whole seconds, at least 1) when set."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class RequestError(GatewayError):
    """The request is malformed (400 unless a subclass says otherwise)."""

    status = 400
    code = "bad_request"
    amqp_condition = NOT_ALLOWED


class InvalidEntityPath(RequestError):
    """The path is not a valid Service Bus entity path, or names a sub-queue or backlog."""

    code = "invalid_entity_path"
    amqp_condition = NOT_FOUND  # a sub-queue or a backlog path names nothing one may send to


class UnknownEntity(RequestError):
    """The entity is not declared in the gateway's configuration."""

    status = 404
    code = "entity_not_found"
    amqp_condition = NOT_FOUND


class PayloadTooLarge(RequestError):
    """A message or a batch exceeds a size or count limit."""

    status = 413
    code = "payload_too_large"
    amqp_condition = MESSAGE_SIZE_EXCEEDED


class NotCarried(RequestError):
    """An AMQP message the gateway cannot carry unchanged to the entity (a value type, a
    body or a section it would have to alter): refused, never altered (docs/amqp.md)."""

    code = "not_carried"
    amqp_condition = NOT_IMPLEMENTED


class UnsupportedMediaType(RequestError):
    """The Content-Type is not accepted for this kind of request."""

    status = 415
    code = "unsupported_media_type"


class Saturated(GatewayError):
    """No room was found within ``admission_timeout``: the client should back off."""

    status = 503
    code = "saturated"
    retry_after = 1.0
    amqp_condition = SERVER_BUSY_CONDITION


class Overloaded(GatewayError):
    """This replica is full (connections, requests in progress, or a loop that is behind):
    answered by the HTTP protocol before any work (gateway.web.overload)."""

    status = 503
    code = "overloaded"
    retry_after = 1.0


class Draining(GatewayError):
    """The gateway is shutting down and takes no new work."""

    status = 503
    code = "shutting_down"
    retry_after = 1.0


class NoBacklogAvailable(GatewayError):
    """The primary failed and no backlog queue could take the message."""

    status = 503
    code = "no_backlog_available"
    retry_after = 10.0


class FailureKind(Enum):
    """Why a send was not stored — the classification the rest of the gateway acts on."""

    TIMEOUT = "timeout"  # our deadline or the broker's: outcome unknown, counts
    SERVER_BUSY = "server_busy"  # throttled: back off, never fails over
    UNAUTHORIZED = "unauthorized"  # our credentials: operator problem, never fails over
    ENTITY_NOT_FOUND = "entity_not_found"
    ENTITY_DISABLED = "entity_disabled"
    QUOTA_EXCEEDED = "quota_exceeded"
    MESSAGE_TOO_LARGE = "message_too_large"
    INVALID_MESSAGE = "invalid_message"  # the gateway could not encode the message: client input
    MESSAGE_REFUSED = "message_refused"  # the broker refused the message itself
    CONNECTION = "connection"  # could not reach the namespace
    SERVICE = "service"  # the broker said internal error
    UNKNOWN = "unknown"
    SHUTDOWN = "shutdown"  # the gateway stopped before the broker answered


@dataclass(frozen=True, slots=True)
class Classification:
    """What a failure means: one row of the classification table."""

    kind: FailureKind
    transient: bool  # may a later retry of the same send succeed?
    counts_toward_failover: bool  # does it start/keep the failover timer?
    http_status: int
    retry_after: float | None  # seconds for the Retry-After header; None: no header
    recreate_sender: bool  # is the sender's link suspect afterwards?
    # Causes that are not SDK exceptions (the SDK's are in gateway.servicebus.errors), for
    # docs/errors.md's table.
    also_raised_for: str = ""
    # The message itself is the cause (too large, undecodable, invalid, against the entity's
    # rules): a 4xx for its own request only. It never counts toward failover, never goes to
    # a backlog queue, never takes one out of rotation; in a micro-batch the dispatcher
    # isolates it (bisects) so the other requests still get theirs; the syphon dead-letters
    # it in the backlog (docs/errors.md, "The message's fault").
    message_fault: bool = False
    # The AMQP edge's rejection: what the SDKs retry and raise as their users expect. Every
    # failure that is not the message's own fault nor a definite answer about the entity is
    # `server-busy` there: the SDKs back off and retry it, and it promises nothing was stored.
    amqp_condition: str = SERVER_BUSY_CONDITION


# Service Bus asks REST clients to back off at least 10 s after a 503. The operator's
# `retry_after` setting (same default) replaces it on every upstream answer: see Dispatcher.
BACK_OFF = 10.0


def _row(
    kind: FailureKind,
    *,
    transient: bool,
    counts: bool,
    status: int = 503,
    retry_after: float | None = BACK_OFF,
    recreate: bool = False,
    also: str = "",
    message_fault: bool = False,
    amqp: str = SERVER_BUSY_CONDITION,
) -> Classification:
    if message_fault:
        assert not counts and not transient, "a message's own fault says nothing of the entity"
    return Classification(
        kind, transient, counts, status, retry_after, recreate, also, message_fault, amqp
    )


# The classification table, one named row per way a send can fail, in docs/errors.md's order.
# `counts_toward_failover` follows the old SDK's paired-namespace rule: non-transient
# failures and timeouts count; server-busy and unauthorized never do, and neither does a
# message the broker refuses for its own sake (too large, invalid): the entity is fine.
SERVER_BUSY = _row(FailureKind.SERVER_BUSY, transient=True, counts=False)
UNAUTHORIZED = _row(FailureKind.UNAUTHORIZED, transient=False, counts=False)
UNAUTHENTICATED = _row(FailureKind.UNAUTHORIZED, transient=False, counts=False, recreate=True)
MESSAGE_TOO_LARGE = _row(
    FailureKind.MESSAGE_TOO_LARGE,
    transient=False,
    counts=False,
    status=413,
    retry_after=None,
    message_fault=True,
    amqp=MESSAGE_SIZE_EXCEEDED,
)
# One row for the broker's timeout and ours: the same condition (no answer in time, outcome
# unknown). Retry-After is the back-off, not 1 s: the client already waited `send_timeout`,
# and retrying sooner piles sends onto a namespace that is not answering.
TIMEOUT = _row(
    FailureKind.TIMEOUT,
    transient=True,
    counts=True,
    recreate=True,
    also="our `send_timeout`",
    amqp=TIMEOUT_CONDITION,
)
ENTITY_NOT_FOUND = _row(
    FailureKind.ENTITY_NOT_FOUND, transient=False, counts=True, recreate=True, amqp=NOT_FOUND
)
ENTITY_DISABLED = _row(
    FailureKind.ENTITY_DISABLED,
    transient=False,
    counts=True,
    recreate=True,
    amqp=ENTITY_DISABLED_CONDITION,
)
QUOTA_EXCEEDED = _row(
    FailureKind.QUOTA_EXCEEDED, transient=False, counts=True, amqp=RESOURCE_LIMIT_EXCEEDED
)
CONNECTION = _row(FailureKind.CONNECTION, transient=False, counts=True, recreate=True)
SERVICE = _row(FailureKind.SERVICE, transient=False, counts=True, recreate=True)
# Not transient: nothing says a retry would help, and the rule above then makes it count, so
# an entity failing in a way nobody foresaw still fails over to the backlog.
UNKNOWN = _row(
    FailureKind.UNKNOWN,
    transient=False,
    counts=True,
    recreate=True,
    also="anything else (no row matches, or a bug in an adapter)",
)
# A ValueError/TypeError while the gateway builds or encodes a message is the client's input
# (the send never started): a 400 that never counts. Only the gateway's own encoding raises
# it; the same errors from inside the SDK's send are the SDK's (`UNKNOWN` or `SERVICE`).
INVALID_MESSAGE = _row(
    FailureKind.INVALID_MESSAGE,
    transient=False,
    counts=False,
    status=400,
    retry_after=None,
    also="`ValueError`/`TypeError` while the gateway builds or encodes a message",
    message_fault=True,
    amqp=NOT_ALLOWED,
)
# The broker refused the message itself, not the entity: it could not decode it (a
# ContentType that is not an ASCII symbol, say), or the entity's rules forbid it (no
# SessionId for a session entity). The SDK raises a bare `ServiceBusError` for these: the
# AMQP condition says which (gateway.servicebus.errors, SDK_CONDITIONS).
MESSAGE_REFUSED = _row(
    FailureKind.MESSAGE_REFUSED,
    transient=False,
    counts=False,
    status=400,
    retry_after=None,
    message_fault=True,
    amqp=NOT_ALLOWED,  # the broker's own condition, when it gave one (`SendFailure.condition`)
)
# Pending or in flight when the gateway stopped: says nothing about the entity, so it never
# counts; another replica can take the retry at once.
SHUTDOWN = _row(
    FailureKind.SHUTDOWN,
    transient=True,
    counts=False,
    retry_after=1.0,
    also="the gateway shut down before the broker answered",
)

CLASSIFICATIONS: tuple[Classification, ...] = (
    SERVER_BUSY,
    UNAUTHORIZED,
    UNAUTHENTICATED,
    MESSAGE_TOO_LARGE,
    TIMEOUT,
    ENTITY_NOT_FOUND,
    ENTITY_DISABLED,
    QUOTA_EXCEEDED,
    CONNECTION,
    SERVICE,
    UNKNOWN,
    INVALID_MESSAGE,
    MESSAGE_REFUSED,
    SHUTDOWN,
)


class BrokerFailure(GatewayError):
    """A broker operation failed, classified by the one SDK map (gateway.servicebus.errors):
    a receive, a settlement, a lock renewal (the syphon's receivers raise these), or a send
    (`SendFailure`)."""

    # The broker's own AMQP condition, when it gave one (gateway.servicebus.errors): passed
    # on by the AMQP edge for a message's own fault.
    condition: str | None = None

    def __init__(self, classification: Classification, message: str) -> None:
        super().__init__(message)
        self.classification = classification
        self.status = classification.http_status
        self.code = f"upstream_{classification.kind.value}"
        self.retry_after = classification.retry_after

    @property
    def kind(self) -> FailureKind:
        return self.classification.kind


class SendFailure(BrokerFailure):
    """The broker did not store the message(s). Never reported to a client as accepted."""

    # When the broker operation that failed began, on the dispatcher's clock (None: not a
    # broker operation's outcome). Failover discounts reports older than what it knows.
    started: float | None = None


def amqp_rejection(err: GatewayError) -> str:
    """The AMQP condition a delivery that ended in `err` is rejected with (the AMQP edge's
    column of this module's tables): a message's own fault keeps the broker's condition; a
    send failure its row's; a request error its class's; anything else unavailable (a 5xx:
    `server-busy`, which every SDK backs off from and retries) or refused (`not-allowed`)."""
    if isinstance(err, SendFailure):
        row = err.classification
        if row.message_fault and err.condition:
            return err.condition
        return row.amqp_condition
    if err.amqp_condition is not None:
        return err.amqp_condition
    return SERVER_BUSY_CONDITION if err.status >= 500 else NOT_ALLOWED
