"""Shared Access Signature tokens, as Service Bus and its SDKs mint them, and their verification.

Wire format (fields in any order, each value URL-encoded with ``quote_plus``)::

    SharedAccessSignature sr=<resource uri>&sig=<base64 HMAC-SHA256>&se=<unix expiry>&skn=<rule>

The signature is ``HMAC-SHA256(key, "<url-encoded sr>\\n<se>")`` keyed with the UTF-8 bytes of the
key string itself (not its base64 decoding), exactly as ``azure.servicebus._pyamqp.utils.
generate_sas_token`` computes it; `mint_token` produces byte-identical output.

Everything here is pure: no I/O, the clock is injected. `Authorizer.authorize` is the only entry
point a request handler needs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote, quote_plus, unquote, unquote_plus

from gateway.auth._paths import Segments, covers, entity_segments, fold, valid_segment
from gateway.auth.errors import AuthConfigError, ErrorCode, Forbidden, Unauthorized
from gateway.auth.rules import AuthRule, KeySlot, Right, Secret, valid_key_name

SCHEME = "SharedAccessSignature"
MAX_HEADER_LENGTH = 4096
_FIELDS = ("sr", "sig", "se", "skn")
_SIGNATURE_BYTES = hashlib.sha256().digest_size
# Characters a URL-encoded field value may contain (unreserved, '%', and '+' for space).
_RAW_VALUE = re.compile(r"[A-Za-z0-9._~%+\-/:=$!*'(),;@]+")
_EXPIRY = re.compile(r"[0-9]{1,12}")
# A resource URI: scheme, host[:port], optional path, optional query (ignored: the legacy
# Node.js client signs the request URL, ``?api-version=...`` included). No userinfo, fragment.
_RESOURCE = re.compile(
    r"(?P<scheme>[A-Za-z]+)://"
    r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
    r"(?::(?P<port>[0-9]{1,5}))?"
    r"(?P<path>/[^?#\\]*)?"
    r"(?:\?[^#]*)?"
)
_HOST_ENTRY = re.compile(
    r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
    r"(?::(?P<port>[0-9]{1,5}))?"
)
RESOURCE_SCHEMES = frozenset({"https", "http", "sb"})
# A port equal to its scheme's default is the same as no port (the legacy Python client writes
# ":443" out). sb:// has no default here: its AMQP ports are not the gateway's.
_DEFAULT_PORTS = {"https": 443, "http": 80}
# The REST operation suffix a token signed over the request URL ends with.
_MESSAGES = "messages"
# The gateway's own routes: /queues/<e>/messages, /topics/<e>/messages.
_ROUTES = frozenset({"queues", "topics"})


@dataclass(frozen=True, slots=True)
class Resource:
    """A parsed `sr`: canonical host, port (None: not given, or its scheme's default),
    canonical path segments (() = root) and, when the path ends with an entity's REST
    endpoint ``/messages`` or ``/messages/head`` (a token signed over the request URL), the
    entity it names."""

    host: str
    port: int | None
    path: Segments
    endpoint_of: Segments | None = None
    # The same endpoint under the gateway's own routes: `/queues/<e>/messages` or
    # `/topics/<e>/messages` (the URL `make run`'s banner signs) names <e>.
    route_of: Segments | None = None
    default_port: int | None = None  # the scheme's: a ``host:443`` public host matches https


@dataclass(frozen=True, slots=True)
class SasToken:
    """A syntactically valid token, not yet verified. Its repr hides the signature."""

    resource: str  # the decoded `sr`: the URI the signer meant
    resource_raw: str  # `sr` exactly as sent, the form most signers put under the HMAC
    expiry_raw: str  # `se` as sent (digits only), the form under the HMAC
    key_name: str
    target: Resource  # `resource` parsed
    signature: bytes = field(repr=False)

    @property
    def expiry(self) -> int:
        """Unix time after which the token is expired (before clock skew)."""
        return int(self.expiry_raw)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request was authorized as. Safe to log: holds no key and no signature."""

    key_name: str
    key_slot: KeySlot
    rights: frozenset[Right]
    resource: str
    expires_at: int
    entity_path: str | None


def _malformed(reason: str) -> Unauthorized:
    return Unauthorized(ErrorCode.MALFORMED_TOKEN, f"malformed SharedAccessSignature: {reason}")


def parse_token(header: str) -> SasToken:
    """Parse an ``Authorization`` header value into a `SasToken`.

    Strict: the scheme (case-insensitive) and exactly the four fields ``sr``, ``sig``, ``se``,
    ``skn``, each once and non-empty; ``se`` decimal digits; ``sig`` canonical base64 of a
    32-byte digest; ``sr`` a resource URI `parse_resource` accepts. Raises `Unauthorized`
    (``malformed_token``) otherwise; the message never repeats the signature.
    """
    if len(header) > MAX_HEADER_LENGTH:
        raise _malformed(f"longer than {MAX_HEADER_LENGTH} characters")
    scheme, _, params = header.strip().partition(" ")
    if scheme.lower() != SCHEME.lower():
        raise _malformed(f"the scheme must be {SCHEME!r}")
    params = params.strip()
    if not params:
        raise _malformed("no fields")
    raw: dict[str, str] = {}
    for part in params.split("&"):
        name, eq, value = part.partition("=")
        if not eq:
            raise _malformed("every field must be name=value, separated by '&'")
        if name not in _FIELDS:
            raise _malformed(f"unknown field (expected {', '.join(_FIELDS)})")
        if name in raw:
            raise _malformed(f"duplicate field {name!r}")
        if not value or _RAW_VALUE.fullmatch(value) is None:
            raise _malformed(f"field {name!r} is empty or not URL-encoded ASCII")
        raw[name] = value
    missing = [name for name in _FIELDS if name not in raw]
    if missing:
        raise _malformed(f"missing field(s) {', '.join(missing)}")
    try:
        decoded = {name: unquote_plus(value, errors="strict") for name, value in raw.items()}
    except UnicodeDecodeError:
        raise _malformed("a field is not valid percent-encoded UTF-8") from None
    if not valid_key_name(decoded["skn"]):
        raise _malformed("skn must be 1-256 letters, digits, '.', '-', '_'")
    if _EXPIRY.fullmatch(decoded["se"]) is None:
        raise _malformed("se must be a Unix time in decimal digits")
    signature = _decode_signature(decoded["sig"])
    try:
        target = parse_resource(decoded["sr"])
    except ValueError as exc:
        raise _malformed(f"sr {exc}") from None
    return SasToken(
        resource=decoded["sr"],
        resource_raw=raw["sr"],
        expiry_raw=decoded["se"],
        key_name=decoded["skn"],
        target=target,
        signature=signature,
    )


def _decode_signature(text: str) -> bytes:
    try:
        signature = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed("sig is not base64") from None
    # Only the canonical encoding: otherwise flipping unused padding bits would leave the
    # signature valid, and "any changed byte is rejected" would not hold.
    if len(signature) != _SIGNATURE_BYTES or base64.b64encode(signature).decode() != text:
        raise _malformed("sig is not a base64 HMAC-SHA256 digest")
    return signature


def parse_resource(uri: str) -> Resource:
    """Parse a decoded ``sr``: ``https|http|sb://host[:port][/entity/path][?query]``.

    Normalised as Service Bus does: scheme and host ASCII case-folded, the scheme's default port
    dropped, the query dropped; a path ending with ``/messages`` or ``/messages/head`` (the
    REST endpoint, when a client signed the request URL) also names the entity before it
    (`Resource.endpoint_of`). Each path segment is percent-decoded once and must be a valid entity
    segment (so ``%2F`` cannot smuggle a separator, nor ``%2e%2e`` a dot segment). One trailing
    ``/`` is allowed. Raises ValueError with a reason for anything else (userinfo, fragment,
    ``..``, double encoding, non-ASCII, ...).
    """
    if not uri.isascii() or not uri.isprintable() or " " in uri:
        raise ValueError("must be printable ASCII without spaces")
    match = _RESOURCE.fullmatch(uri)
    if match is None:
        raise ValueError("must be scheme://host[:port]/path without userinfo or fragment")
    scheme = fold(match["scheme"])
    if scheme not in RESOURCE_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(sorted(RESOURCE_SCHEMES))}")
    port = _port(match["port"])
    if port is not None and port == _DEFAULT_PORTS.get(scheme):
        port = None
    path = (match["path"] or "/")[1:]
    if path.endswith("/"):
        path = path[:-1]
    segments: list[str] = []
    if path:
        for part in path.split("/"):
            try:
                segment = unquote(part, errors="strict")
            except UnicodeDecodeError:
                raise ValueError("path is not valid percent-encoded UTF-8") from None
            if not valid_segment(segment):
                raise ValueError("path is not an entity path")
            segments.append(fold(segment))
    endpoint_of = None
    if len(segments) > 2 and segments[-2:] == [_MESSAGES, "head"]:
        endpoint_of = tuple(segments[:-2])
    elif len(segments) > 1 and segments[-1] == _MESSAGES:
        endpoint_of = tuple(segments[:-1])
    route_of = None
    if endpoint_of is not None and len(endpoint_of) > 1 and endpoint_of[0] in _ROUTES:
        route_of = endpoint_of[1:]
    return Resource(
        host=fold(match["host"]),
        port=port,
        path=tuple(segments),
        endpoint_of=endpoint_of,
        route_of=route_of,
        default_port=_DEFAULT_PORTS.get(scheme),
    )


def _port(text: str | None) -> int | None:
    if text is None:
        return None
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError("port out of range")
    return port


def resource_uri(host: str, entity_path: str | None, *, scheme: str = "https") -> str:
    """The resource URI for *entity_path* (None: the namespace root) on *host*.

    Raises ValueError if *entity_path* is not a valid entity path or the result would not parse.
    """
    if entity_path is None:
        uri = f"{scheme}://{host}/"
    else:
        if entity_segments(entity_path) is None:
            raise ValueError(f"not a valid entity path: {entity_path!r}")
        uri = f"{scheme}://{host}/{quote(entity_path.strip('/'), safe='/$')}"
    try:
        parse_resource(uri)
    except ValueError as exc:
        raise ValueError(f"resource URI {uri!r} {exc}") from None
    return uri


def _signature(key: Secret | str, string_to_sign: str) -> bytes:
    secret = key.get() if isinstance(key, Secret) else key
    return hmac.new(secret.encode("utf-8"), string_to_sign.encode("utf-8"), hashlib.sha256).digest()


def sign_token(resource_uri: str, key_name: str, key: Secret | str, expiry: int) -> str:
    """The ``Authorization`` header value for an absolute *expiry* (Unix seconds).

    Byte-identical to the azure-servicebus SDK's ``generate_sas_token`` (fields in the order
    ``sr``, ``sig``, ``se``, ``skn``). Raises ValueError for an invalid URI, key name or expiry.
    """
    try:
        parse_resource(resource_uri)
    except ValueError as exc:
        raise ValueError(f"resource_uri {exc}") from None
    if not valid_key_name(key_name):
        raise ValueError("key_name must be 1-256 letters, digits, '.', '-', '_'")
    if _EXPIRY.fullmatch(str(expiry)) is None:
        raise ValueError("expiry must be a non-negative Unix time")
    encoded_uri = quote_plus(resource_uri)
    signature = base64.b64encode(_signature(key, f"{encoded_uri}\n{expiry}")).decode()
    return (
        f"{SCHEME} sr={encoded_uri}&sig={quote_plus(signature)}"
        f"&se={expiry}&skn={quote_plus(key_name)}"
    )


def mint_token(
    resource_uri: str,
    key_name: str,
    key: str | Secret,
    ttl: float,
    *,
    now: float | None = None,
) -> str:
    """A token for *resource_uri* valid *ttl* seconds from *now* (default: ``time.time()``).

    The expiry is ``int(now + ttl)``. Raises ValueError for a non-positive or non-finite
    *ttl* and whatever `sign_token` rejects.
    """
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError("ttl must be a positive number of seconds")
    start = time.time() if now is None else now
    return sign_token(resource_uri, key_name, key, int(start + ttl))


def _parse_host_entry(entry: str) -> tuple[str, int | None]:
    match = _HOST_ENTRY.fullmatch(entry.strip()) if isinstance(entry, str) else None
    if match is None:
        raise AuthConfigError(f"public_hosts: {entry!r} is not host or host:port")
    try:
        return fold(match["host"]), _port(match["port"])
    except ValueError:
        raise AuthConfigError(f"public_hosts: {entry!r} has a port out of range") from None


@dataclass(frozen=True, slots=True)
class _Verified:
    """A token whose signature checked out, as the verified-token cache keeps it."""

    header: str  # the exact Authorization value, compared again in constant time on a hit
    token: SasToken
    rule: AuthRule
    slot: KeySlot
    rights: frozenset[Right]
    valid_until: float  # `se` + clock skew: the full check refuses it from then on


class Authorizer:
    """Verifies SAS tokens against rules; one instance per gateway, shared by the requests of
    one event loop (not thread-safe: its token cache is a plain LRU).

    *public_hosts* lists the host names (``host`` matches any port, ``host:port`` only that
    port) a token's ``sr`` may name. A token is accepted up to *clock_skew* seconds after its
    expiry; with *max_token_lifetime*, tokens expiring further than that in the future are
    refused. Raises `AuthConfigError` for duplicate rule names, no public host, or a bad
    skew/lifetime.

    Verified tokens are cached (*token_cache_size* entries, least recently used dropped
    first; 0 disables the cache), keyed on the exact ``Authorization`` value: a client that
    reuses its token skips parsing and the HMAC, never the access checks (`authorize` checks
    the entity and the right on every call). An entry is dropped once its ``se`` plus the
    clock skew has passed, and `replace_rules` (key rotation) empties the cache.
    """

    def __init__(
        self,
        rules: Iterable[AuthRule],
        public_hosts: Sequence[str],
        clock_skew: float = 300,
        clock: Callable[[], float] = time.time,
        *,
        max_token_lifetime: float | None = None,
        token_cache_size: int = 10_000,
    ) -> None:
        self._rules = _rules_by_name(rules)
        if isinstance(public_hosts, str) or not public_hosts:
            raise AuthConfigError("public_hosts: must list at least one host name")
        self._hosts = frozenset(_parse_host_entry(entry) for entry in public_hosts)
        if not math.isfinite(clock_skew) or clock_skew < 0:
            raise AuthConfigError("clock_skew: must be a non-negative number of seconds")
        if max_token_lifetime is not None and (
            not math.isfinite(max_token_lifetime) or max_token_lifetime <= 0
        ):
            raise AuthConfigError("max_token_lifetime: must be a positive number of seconds")
        if token_cache_size < 0:
            raise AuthConfigError("token_cache_size: must be 0 (no cache) or more")
        self._skew = clock_skew
        self._clock = clock
        self._max_lifetime = max_token_lifetime
        self._cache_size = token_cache_size
        self._cache: OrderedDict[str, _Verified] = OrderedDict()

    def replace_rules(self, rules: Iterable[AuthRule]) -> None:
        """Verify with *rules* from now on (a key rotation), forgetting every cached token.
        Raises `AuthConfigError` for duplicate rule names, keeping the current rules."""
        self._rules = _rules_by_name(rules)
        self._cache.clear()

    @property
    def cached_tokens(self) -> int:
        """How many verified tokens the cache holds."""
        return len(self._cache)

    def __repr__(self) -> str:
        hosts = sorted(f"{h}:{p}" if p else h for h, p in self._hosts)
        return f"Authorizer(rules={sorted(self._rules)!r}, public_hosts={hosts!r})"

    @property
    def rule_names(self) -> tuple[str, ...]:
        """The configured rule names, sorted."""
        return tuple(sorted(self._rules))

    def _serves(self, resource: Resource) -> bool:
        hosts = self._hosts
        port = resource.port if resource.port is not None else resource.default_port
        return (resource.host, None) in hosts or (resource.host, port) in hosts

    def authorize(
        self,
        authorization_header: str | None,
        *,
        entity_path: str | None,
        right: Right,
    ) -> Principal:
        """Check that *authorization_header* grants *right* on *entity_path*.

        *entity_path* is the entity the request addresses (``orders``, ``topic/subscriptions/
        s``, ``orders/$DeadLetterQueue``), validated by the caller; None means the namespace as
        a whole (namespace-wide ``/admin`` endpoints, with ``Right.MANAGE``), which only a
        token whose ``sr`` is the namespace root and a rule with the ``*`` pattern satisfy.
        An invalid *entity_path* is covered by nothing (401 ``resource_mismatch``).

        Checks, in order, raising on the first failure: header present; token well-formed;
        ``skn`` names a rule; signature made with its primary or secondary key; not expired
        beyond the skew (nor, if configured, living too long); ``sr`` host is a public host;
        ``sr`` path covers the entity — all `Unauthorized` (401). Then the rule grants the
        right and applies to the entity — else `Forbidden` (403). Pure and synchronous.
        """
        verified = self._authenticate(authorization_header)
        token = verified.token
        self._check_access(token, verified.rule, entity_path, right)
        return Principal(
            key_name=verified.rule.name,
            key_slot=verified.slot,
            rights=verified.rights,
            resource=token.resource,
            expires_at=token.expiry,
            entity_path=entity_path,
        )

    def _authenticate(self, authorization_header: str | None) -> _Verified:
        """The token, its rule and the key that signed it, if genuine and current (else 401):
        from the cache when this exact header was verified before and is still current."""
        if authorization_header is None or not authorization_header.strip():
            raise Unauthorized(
                ErrorCode.MISSING_TOKEN,
                f"an Authorization header with a {SCHEME} token is required",
            )
        cache = self._cache
        hit = cache.get(authorization_header)
        if hit is not None:
            # The dict matched the whole value (a keyed hash, then equality); compare again
            # in constant time so that no comparison on the secret part is timing-dependent.
            if self._clock() <= hit.valid_until and hmac.compare_digest(
                hit.header, authorization_header
            ):
                cache.move_to_end(authorization_header)
                return hit
            del cache[authorization_header]  # expired: verified again below, and refused
        verified = self._verify_header(authorization_header)
        if self._cache_size and authorization_header.isascii():
            cache[authorization_header] = verified
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        return verified

    def _verify_header(self, authorization_header: str) -> _Verified:
        """`_authenticate` without the cache: parse, HMAC, expiry and lifetime checks."""
        token = parse_token(authorization_header)
        rule = self._rules.get(token.key_name)
        if rule is None:
            raise Unauthorized(
                ErrorCode.UNKNOWN_KEY_NAME,
                "the token's skn names no authorization rule",
            )
        slot = _verify(rule, token)
        if slot is None:
            raise Unauthorized(
                ErrorCode.INVALID_SIGNATURE,
                f"the token signature does not match the keys of rule {rule.name!r}",
            )
        now = self._clock()
        if now > token.expiry + self._skew:
            expired = datetime.fromtimestamp(token.expiry, UTC).isoformat()
            raise Unauthorized(ErrorCode.TOKEN_EXPIRED, f"the token expired at {expired}")
        if self._max_lifetime is not None and token.expiry - now > self._max_lifetime:
            raise Unauthorized(
                ErrorCode.TOKEN_LIFETIME_TOO_LONG,
                f"the token expires more than {self._max_lifetime:g} s from now",
            )
        return _Verified(
            header=authorization_header,
            token=token,
            rule=rule,
            slot=slot,
            rights=rule.effective_rights,
            valid_until=token.expiry + self._skew,
        )

    def _check_access(
        self, token: SasToken, rule: AuthRule, entity_path: str | None, right: Right
    ) -> None:
        """The token was made for this gateway and entity (else 401), and its rule grants
        `right` on the entity (else 403)."""
        resource = token.target
        if not self._serves(resource):
            raise Unauthorized(
                ErrorCode.INVALID_AUDIENCE,
                "the token's resource (sr) names a host not in public_hosts",
            )
        entity = None if entity_path is None else entity_segments(entity_path)
        target = "the namespace" if entity_path is None else f"entity {entity_path[:300]!r}"
        if (entity_path is not None and entity is None) or not _resource_covers(resource, entity):
            raise Unauthorized(
                ErrorCode.RESOURCE_MISMATCH,
                f"the token's resource (sr) does not cover {target}",
            )
        if not rule.grants(right):
            raise Forbidden(
                ErrorCode.MISSING_RIGHT,
                f"rule {rule.name!r} does not grant the {right.value} right",
            )
        if not rule.applies_to(entity):
            raise Forbidden(
                ErrorCode.ENTITY_NOT_ALLOWED,
                f"rule {rule.name!r} does not apply to {target}",
            )


def _rules_by_name(rules: Iterable[AuthRule]) -> dict[str, AuthRule]:
    by_name: dict[str, AuthRule] = {}
    for rule in rules:
        if rule.name in by_name:
            raise AuthConfigError(f"rules: duplicate rule name {rule.name!r}")
        by_name[rule.name] = rule
    return by_name


def _resource_covers(resource: Resource, entity: Segments | None) -> bool:
    """The namespace root covers everything, the namespace itself included. A path covers the
    entity it names and, on whole segments, every path below it. A token signed over an
    entity's ``/messages`` URL also covers exactly that entity, and nothing more:
    ``orders/messages`` covers ``orders`` but not ``orders/messagesx`` nor ``orders/sub``;
    ``queues/orders/messages`` (and ``topics/...``, the gateway's routes) covers ``orders`` too."""
    path = resource.path
    if not path:
        return True
    if entity is None:
        return False
    return covers(path, entity) or entity in (resource.endpoint_of, resource.route_of)


def _verify(rule: AuthRule, token: SasToken) -> KeySlot | None:
    """The slot of the key that made the signature, or None.

    Signers URL-encode ``sr`` in their own way (quote_plus, .NET's WebUtility.UrlEncode, ...)
    and put the same encoded form in the token, so the form as sent is tried first, then the
    canonical ``quote_plus`` of the decoded resource. Both name the same decoded resource,
    which is what gets authorized.
    """
    candidates = [token.resource_raw]
    canonical = quote_plus(token.resource)
    if canonical != token.resource_raw:
        candidates.append(canonical)
    for slot, key in rule.keys():
        for encoded in candidates:
            expected = _signature(key, f"{encoded}\n{token.expiry_raw}")
            if hmac.compare_digest(expected, token.signature):
                return slot
    return None
