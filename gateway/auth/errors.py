"""Authorization errors. Each one says how to answer the client.

* `Unauthorized` (401): the caller did not prove who it is — the token is missing, malformed,
  signed with an unknown or wrong key, expired, or made for another resource or host.
* `Forbidden` (403): the token is genuine, but its rule does not grant the right, or does not
  apply to the entity.
* `AuthConfigError`: the rules configuration is invalid (raised at start-up, never per request).

Messages are safe to send to the client and to log: they never contain a key or a signature.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class ErrorCode(StrEnum):
    """Stable machine-readable codes carried in `AuthError.error`."""

    MISSING_TOKEN = "missing_token"  # noqa: S105  # nosec B105  # an error code, not a credential
    MALFORMED_TOKEN = "malformed_token"  # noqa: S105  # nosec B105  # an error code, not a credential
    UNKNOWN_KEY_NAME = "unknown_key_name"
    INVALID_SIGNATURE = "invalid_signature"
    TOKEN_EXPIRED = "token_expired"  # noqa: S105  # nosec B105  # an error code, not a credential
    TOKEN_LIFETIME_TOO_LONG = "token_lifetime_too_long"  # noqa: S105  # nosec B105  # an error code, not a credential
    INVALID_AUDIENCE = "invalid_audience"
    RESOURCE_MISMATCH = "resource_mismatch"
    MISSING_RIGHT = "missing_right"
    ENTITY_NOT_ALLOWED = "entity_not_allowed"


class AuthError(Exception):
    """Base of the per-request authorization failures; carries the HTTP status to answer."""

    status: ClassVar[int] = 401

    def __init__(self, error: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.error: str = str(error)
        self.message = message

    @property
    def code(self) -> str:
        """Alias of `error`, matching the gateway's other errors."""
        return self.error

    def body(self) -> dict[str, str]:
        """The JSON error body: ``{"error": code, "message": text}``."""
        return {"error": self.error, "message": self.message}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(error={self.error!r}, message={self.message!r})"


class Unauthorized(AuthError):
    """401: no valid credential for this resource; the client must present a (new) token."""

    status: ClassVar[int] = 401
    # RFC 9110 §11.6.1: a 401 answer carries a challenge naming the scheme.
    www_authenticate: ClassVar[str] = "SharedAccessSignature"


class Forbidden(AuthError):
    """403: the credential is valid but its rule lacks the right or does not cover the entity."""

    status: ClassVar[int] = 403


class AuthConfigError(ValueError):
    """The authorization rules are invalid; the message names the source and the bad field."""
