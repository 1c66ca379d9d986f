"""Shared Access Signature tokens, as Service Bus checks them.

``SharedAccessSignature sr=<url-encoded resource>&sig=<base64 HMAC-SHA256>&se=<unix expiry>
&skn=<key name>`` where the signature covers ``"<url-encoded sr>\\n<se>"`` and the key is
used as its UTF-8 bytes (the base64 text itself, not its decoding), like every Azure SDK.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from urllib.parse import parse_qs, quote_plus, urlencode

PREFIX = "SharedAccessSignature "


class SasError(Exception):
    """The token is malformed, expired, signed with an unknown key or a wrong signature."""


def sign(resource: str, key_name: str, key: str, expiry: int) -> str:
    """Build a token (the same bytes the SDK builds); for tests and tools."""
    to_sign = f"{quote_plus(resource)}\n{expiry}".encode()
    sig = base64.b64encode(hmac.new(key.encode(), to_sign, hashlib.sha256).digest())
    return PREFIX + urlencode({"sr": resource, "sig": sig, "se": str(expiry), "skn": key_name})


def verify(token: str, keys: dict[str, str], *, now: float | None = None) -> str:
    """Check a token against the namespace keys; returns the resource, raises SasError."""
    if not token.startswith(PREFIX):
        raise SasError("The token is not a SharedAccessSignature token.")
    fields = parse_qs(token[len(PREFIX) :], keep_blank_values=True)
    try:
        resource = fields["sr"][0]
        signature = fields["sig"][0]
        expiry_text = fields["se"][0]
        key_name = fields["skn"][0]
    except (KeyError, IndexError):
        raise SasError("The token is missing one of sr, sig, se, skn.") from None
    try:
        expiry = int(expiry_text)
    except ValueError:
        raise SasError("The token expiry (se) is not an integer.") from None
    if expiry <= (time.time() if now is None else now):
        raise SasError(f"ExpiredToken: The token is expired. Expiry time: {expiry}.")
    key = keys.get(key_name)
    if key is None:
        raise SasError(f"InvalidSignature: Unknown shared access key name '{key_name}'.")
    to_sign = f"{quote_plus(resource)}\n{expiry_text}".encode()
    expected = base64.b64encode(hmac.new(key.encode(), to_sign, hashlib.sha256).digest()).decode()
    if not hmac.compare_digest(expected, signature):
        raise SasError("InvalidSignature: The token has an invalid signature.")
    return resource
