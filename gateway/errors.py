"""The gateway's error tree. Every error says what to do with it.

Two families:

* `RequestError` — the client's request is wrong or cannot be admitted. Raised by the HTTP
  edge and the engine's admission; carries the HTTP status and a stable `code`.
* `SendFailure` — the broker did not store a message. Raised by the Service Bus adapter
  (translated from SDK exceptions in exactly one table: `gateway.servicebus.errors`) and
  carries the classification the engine and the failover logic need: whether a retry
  may help, whether it counts toward failover, and how to answer the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""

    status: int = 500
    code: str = "internal_error"
    retry_after: float | None = None

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": code, "message": text, ...details}``."""
        return {"error": self.code, "message": self.message, **self.details}


class RequestError(GatewayError):
    """The request is malformed (400 unless a subclass says otherwise)."""

    status = 400
    code = "bad_request"


class InvalidEntityPath(RequestError):
    """The path is not a valid Service Bus entity path, or names a sub-queue or backlog."""

    code = "invalid_entity_path"


class UnknownEntity(RequestError):
    """The entity is not declared in the gateway's configuration."""

    status = 404
    code = "entity_not_found"


class PayloadTooLarge(RequestError):
    """A message or a batch exceeds a size or count limit."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(RequestError):
    """The Content-Type is not accepted for this kind of request."""

    status = 415
    code = "unsupported_media_type"


class Saturated(GatewayError):
    """No room was found within ``admission_timeout``: the client should back off."""

    status = 503
    code = "saturated"
    retry_after = 1.0


class Draining(GatewayError):
    """The gateway is shutting down and takes no new work."""

    status = 503
    code = "shutting_down"
    retry_after = 1.0


class FailureKind(Enum):
    """Why a send was not stored — the classification the rest of the gateway acts on."""

    TIMEOUT = "timeout"  # our deadline or the broker's: outcome unknown, counts
    SERVER_BUSY = "server_busy"  # throttled: back off, never fails over
    UNAUTHORIZED = "unauthorized"  # our credentials: operator problem, never fails over
    ENTITY_NOT_FOUND = "entity_not_found"
    ENTITY_DISABLED = "entity_disabled"
    QUOTA_EXCEEDED = "quota_exceeded"
    MESSAGE_TOO_LARGE = "message_too_large"
    INVALID_MESSAGE = "invalid_message"  # the SDK refused to build the message: client input
    CONNECTION = "connection"  # could not reach the namespace
    SERVICE = "service"  # the broker said internal error
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Classification:
    """What a failure means: one row of the translation table."""

    kind: FailureKind
    transient: bool  # may a later retry of the same send succeed?
    counts_toward_failover: bool  # does it start/keep the failover timer?
    http_status: int
    retry_after: float | None
    recreate_sender: bool  # is the sender's link suspect afterwards?


class SendFailure(GatewayError):
    """The broker did not store the message(s). Never reported to a client as accepted."""

    def __init__(self, classification: Classification, message: str) -> None:
        super().__init__(message)
        self.classification = classification
        self.status = classification.http_status
        self.code = f"upstream_{classification.kind.value}"
        self.retry_after = classification.retry_after

    @property
    def kind(self) -> FailureKind:
        return self.classification.kind
