"""Authorization errors: request errors (`gateway.errors.RequestError`) that say how to answer.

* `Unauthorized` (401): the caller did not prove who it is — the token is missing, malformed,
  signed with an unknown or wrong key (one answer for both: `invalid_signature`), expired,
  or made for another resource or host.
* `Forbidden` (403): the token is genuine, but its rule does not grant the right, or does not
  apply to the entity.
* `AuthConfigError`: the rules configuration is invalid (raised at start-up, never per request).

Messages are safe to send to the client and to log: they never contain a key or a signature.
"""

from __future__ import annotations

from enum import StrEnum

from gateway.errors import UNAUTHORIZED_ACCESS, RequestError


class ErrorCode(StrEnum):
    """Stable machine-readable codes carried in `AuthError.code` (the body's ``error``)."""

    MISSING_TOKEN = "missing_token"  # noqa: S105  # an error code, not a credential
    MALFORMED_TOKEN = "malformed_token"  # noqa: S105  # an error code, not a credential
    INVALID_SIGNATURE = "invalid_signature"
    TOKEN_EXPIRED = "token_expired"  # noqa: S105  # an error code, not a credential
    TOKEN_LIFETIME_TOO_LONG = "token_lifetime_too_long"  # noqa: S105  # an error code, not a credential
    INVALID_AUDIENCE = "invalid_audience"
    RESOURCE_MISMATCH = "resource_mismatch"
    MISSING_RIGHT = "missing_right"
    ENTITY_NOT_ALLOWED = "entity_not_allowed"


class AuthError(RequestError):
    """A per-request authorization failure; its `code` is one of `ErrorCode`.

    `key_name` is the token's ``skn`` (as claimed, when the token parsed), for the log line
    only: no answer names a rule, so that nobody without a key can learn which names exist."""

    status = 401
    amqp_condition = UNAUTHORIZED_ACCESS  # 401 and 403 alike: ServiceBusAuthorizationError

    def __init__(self, code: ErrorCode, message: str, *, key_name: str | None = None) -> None:
        super().__init__(message)
        self.code = str(code)
        self.key_name = key_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class Unauthorized(AuthError):
    """401: no valid credential for this resource; the client must present a (new) token."""

    status = 401

    def headers(self) -> dict[str, str]:
        # RFC 9110 §11.6.1: a 401 answer carries a challenge naming the scheme.
        return {**super().headers(), "WWW-Authenticate": "SharedAccessSignature"}


class Forbidden(AuthError):
    """403: the credential is valid but its rule lacks the right or does not cover the entity."""

    status = 403


class AuthConfigError(ValueError):
    """The authorization rules are invalid; the message names the source and the bad field."""
