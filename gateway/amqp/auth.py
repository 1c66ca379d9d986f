"""Claims-based security (`$cbs`) for one AMQP connection, on the gateway's own `Authorizer`.

An SDK authenticates by putting a token for each audience it uses over the `$cbs` node
(``sb://host[:port]/orders``, and ``.../orders/$management`` before a management link). Each
put-token is checked as an HTTP request's ``Authorization`` header would be, against the
audience as presented; a granted token is kept until the next put-token for the same
audience replaces it. A transfer is checked again, every time, against the kept tokens:
a token that expired since, or that does not cover the entity, refuses it. The
`Authorizer` caches verified tokens, so the check costs a dictionary lookup.

A put-token is refused (status 401, never 403: one SDK, JS, reports a 403 at put-token as a
quota error) when the token is not genuine, expired, made for another host, or does not cover
the audience: the SDKs raise an authentication error. A genuine token whose rule lacks the
Send right on the entity is kept, and each transfer is refused `amqp:unauthorized-access`:
the SDKs raise an authorization error, as Service Bus makes them. Without rules (open mode)
every put-token is granted and every transfer allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.auth import AuthError, Authorizer, ErrorCode, Forbidden, Right, Unauthorized
from sbamqp.addresses import audience_path

SAS_SCHEME = "SharedAccessSignature"
# Tokens a connection may hold at once: one per audience (an SDK puts one or two per
# entity it sends to); more is a client minting tokens in a loop.
MAX_GRANTS = 64


@dataclass(frozen=True, slots=True)
class PutTokenAnswer:
    """The `$cbs` reply's ``status-code`` and ``status-description``."""

    status: int
    description: str
    key_name: str | None = None  # for the log line


@dataclass(slots=True)
class Grants:
    """The tokens one connection put, by audience path (lower case, as entity names)."""

    authorizer: Authorizer | None
    _tokens: dict[str, str] = field(default_factory=dict)

    def put_token(self, audience: object, token: object) -> PutTokenAnswer:
        """Check a put-token request (`audience`: its ``name``; `token`: its body)."""
        if not isinstance(audience, str) or not isinstance(token, str):
            return PutTokenAnswer(400, "put-token needs a string name and a string token")
        path = audience_path(audience)
        if self.authorizer is None:
            return PutTokenAnswer(200, "ok (open mode: no rules)")
        if not token.startswith(SAS_SCHEME + " "):
            return PutTokenAnswer(
                401,
                f"only SAS tokens ({SAS_SCHEME} sr=...) are accepted; this endpoint does not "
                "take Microsoft Entra ID tokens: use a connection string with a key",
            )
        key_name: str | None
        description = "ok"
        try:
            key_name = self.authorizer.authorize(
                token, entity_path=path or None, right=Right.SEND
            ).key_name
        except Forbidden as err:
            # Authentic, and made for this audience, but its rule may not send there: kept,
            # so that each transfer is refused `amqp:unauthorized-access`, which the SDKs
            # raise as an authorization error (a put-token refusal is an authentication one).
            key_name, description = err.key_name, f"ok, but sends will be refused: {err.message}"
        except AuthError as err:
            return PutTokenAnswer(401, f"{err.code}: {err.message}", err.key_name)
        key = path.lower()
        if key not in self._tokens and len(self._tokens) >= MAX_GRANTS:
            return PutTokenAnswer(401, f"too many tokens on one connection (at most {MAX_GRANTS})")
        self._tokens[key] = token
        return PutTokenAnswer(200, description, key_name)

    def authorize_send(self, entity_path: str) -> str | None:
        """The key name a kept token sends to `entity_path` with (None in open mode); raises
        the `AuthError` of the token meant for it (amqp:unauthorized-access) otherwise."""
        authorizer = self.authorizer
        if authorizer is None:
            return None
        tokens = self._tokens
        # The token put for this entity first, then any other (a namespace-wide one).
        own = tokens.get(entity_path.lower())
        candidates = [own] if own is not None else []
        candidates += [t for a, t in tokens.items() if t is not own]
        first_error: AuthError | None = None
        for token in candidates:
            try:
                return authorizer.authorize(
                    token, entity_path=entity_path, right=Right.SEND
                ).key_name
            except AuthError as err:
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        raise Unauthorized(
            ErrorCode.MISSING_TOKEN, f"no token was put (over $cbs) for {entity_path[:300]!r}"
        )
