"""Shared Access Signature tokens, as Service Bus checks them: the one verifier of sblocal.

``SharedAccessSignature sr=<url-encoded resource>&sig=<base64 HMAC-SHA256>&se=<unix expiry>
&skn=<key name>`` where the signature covers ``"<url-encoded sr>\\n<se>"`` and the key is
used as its UTF-8 bytes (the base64 text itself, not its decoding), like every Azure SDK.

Both doors of the broker use `verify`: the AMQP ``$cbs`` put-token (the audience is the
request's ``name``) and the HTTPS management API (the audience is the request path). A token
is good for an audience when its ``sr`` path covers it on a segment boundary, as on Service
Bus; the host is ignored, since a client may call the broker ``localhost`` or ``127.0.0.1``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping
from urllib.parse import parse_qsl, quote_plus, urlencode, urlsplit

PREFIX = "SharedAccessSignature "


class SasError(Exception):
    """The token is malformed, expired, signed with an unknown key or a wrong signature, or
    it does not cover the audience it is used for. The text starts with the error code."""


def sign(resource: str, key_name: str, key: str, expiry: int) -> str:
    """Build a token (the same bytes the SDK builds); for tests and tools."""
    to_sign = f"{quote_plus(resource)}\n{expiry}".encode()
    sig = base64.b64encode(hmac.new(key.encode(), to_sign, hashlib.sha256).digest())
    return PREFIX + urlencode({"sr": resource, "sig": sig, "se": str(expiry), "skn": key_name})


def scope(resource: str) -> str:
    """The entity path a resource or audience URI names ('' for the whole namespace)."""
    parts = urlsplit(resource if "://" in resource else f"sb://{resource}")
    return parts.path.strip("/").lower()


def covers(granted: str, path: str) -> bool:
    """Whether a token scoped to entity path `granted` grants `path` (segment boundary)."""
    granted, path = granted.strip("/").lower(), path.strip("/").lower()
    return not granted or (path + "/").startswith(granted + "/")


def verify(
    token: str,
    keys: Mapping[str, str],
    *,
    audience: str | None = None,
    now: float | None = None,
) -> str:
    """Check a token against the namespace keys and, if given, the audience it is used for.

    Returns the (decoded) resource; raises SasError. The signature is accepted over the sr
    text exactly as sent (SDKs sign the encoded form they put in the token) or over its
    canonical encoding (clients that re-encode it).
    """
    scheme, _, body = token.strip().partition(" ")
    if scheme != PREFIX.strip():
        raise SasError("InvalidToken: Only SharedAccessSignature tokens are accepted.")
    raw = dict(part.split("=", 1) for part in body.split("&") if "=" in part)
    fields = dict(parse_qsl(body, keep_blank_values=True))
    try:
        resource, signature, expiry_text, key_name = (
            fields["sr"],
            fields["sig"],
            fields["se"],
            fields["skn"],
        )
    except KeyError:
        raise SasError("InvalidToken: The token is missing one of sr, sig, se, skn.") from None
    try:
        expiry = int(expiry_text)
    except ValueError:
        raise SasError("InvalidToken: The token expiry (se) is not an integer.") from None
    if expiry <= (time.time() if now is None else now):
        raise SasError(f"ExpiredToken: The token is expired. Expiry time: {expiry}.")
    key = keys.get(key_name)
    if key is None:
        raise SasError(f"InvalidSignature: Unknown shared access key name {key_name!r}.")
    try:
        given = base64.b64decode(signature, validate=True)
    except (ValueError, binascii.Error):
        raise SasError("InvalidSignature: The signature is not base64.") from None
    candidates = {raw.get("sr", ""), quote_plus(resource)}
    if not any(
        hmac.compare_digest(
            given,
            hmac.new(key.encode(), f"{sr}\n{expiry_text}".encode(), hashlib.sha256).digest(),
        )
        for sr in candidates
    ):
        raise SasError("InvalidSignature: The token has an invalid signature.")
    if audience is not None and not covers(scope(resource), scope(audience)):
        raise SasError(f"InvalidAudience: The token does not grant access to {scope(audience)!r}.")
    return resource
