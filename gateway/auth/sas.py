"""Shared Access Signature tokens, as Service Bus and its SDKs mint them, and their verification.

Wire format (fields in any order, each value URL-encoded with ``quote_plus``)::

    SharedAccessSignature sr=<resource uri>&sig=<base64 HMAC-SHA256>&se=<unix expiry>&skn=<rule>

The signature is ``HMAC-SHA256(key, "<url-encoded sr>\\n<se>")`` keyed with the UTF-8 bytes of the
key string itself (not its base64 decoding), exactly as the SDK's own AMQP layer computes it
(its ``generate_sas_token``); `mint_token` produces byte-identical output.

Everything here is pure: no I/O, the clock is injected. `Authorizer.authorize` is the only entry
point a request handler needs.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import dataclasses
import hashlib
import hmac
import math
import os
import re
import sys
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
_FIELD_SET = frozenset(_FIELDS)
_SCHEME_FOLDED = SCHEME.lower()
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
    return _token_from(*_split_header(header))


# What a token means, whatever its spelling: (decoded sr, se, skn, sig). The verified-token
# cache is keyed on it.
_Meaning = tuple[str, str, str, str]


def _split_header(header: str) -> tuple[str, _Meaning]:
    """The checks of `parse_token` that depend on the spelling (length, scheme, fields,
    characters, percent-encoding): ``sr`` as sent and the token's meaning, percent-decoded.
    Whether the decoded values are valid is `_token_from`'s part."""
    if len(header) > MAX_HEADER_LENGTH:
        raise _malformed(f"longer than {MAX_HEADER_LENGTH} characters")
    scheme, _, params = header.strip().partition(" ")
    if scheme.lower() != _SCHEME_FOLDED:
        raise _malformed(f"the scheme must be {SCHEME!r}")
    params = params.strip()
    if not params:
        raise _malformed("no fields")
    raw: dict[str, str] = {}
    for part in params.split("&"):
        name, eq, value = part.partition("=")
        if not eq:
            raise _malformed("every field must be name=value, separated by '&'")
        if name not in _FIELD_SET:
            raise _malformed(f"unknown field (expected {', '.join(_FIELDS)})")
        if name in raw:
            raise _malformed(f"duplicate field {name!r}")
        if not value or _RAW_VALUE.fullmatch(value) is None:
            raise _malformed(f"field {name!r} is empty or not URL-encoded ASCII")
        raw[name] = value
    if len(raw) != len(_FIELDS):
        missing = [name for name in _FIELDS if name not in raw]
        raise _malformed(f"missing field(s) {', '.join(missing)}")
    try:
        meaning = (
            _unquote(raw["sr"]),
            _unquote(raw["se"]),
            _unquote(raw["skn"]),
            _unquote(raw["sig"]),
        )
    except UnicodeDecodeError:
        raise _malformed("a field is not valid percent-encoded UTF-8") from None
    return raw["sr"], meaning


def _unquote(value: str) -> str:
    """``unquote_plus(value, errors="strict")`` for an ASCII *value* (`_RAW_VALUE`: no
    backslash), several times faster: it runs on every request, cache hits included. Each
    ``%XX`` becomes ``\\xXX`` for the C ``unicode_escape`` codec; a ``%`` that starts no
    valid escape makes that codec fail, and the standard library then decides. Raises
    UnicodeDecodeError like `unquote_plus`."""
    value = value.replace("+", " ")
    if "%" not in value:
        return value
    try:
        latin1 = codecs.decode(value.replace("%", "\\x"), "unicode_escape")
    except UnicodeDecodeError:
        return unquote_plus(value, errors="strict")
    return latin1.encode("latin-1").decode("utf-8")


def _token_from(resource_raw: str, meaning: _Meaning) -> SasToken:
    """The checks of `parse_token` on the decoded values."""
    resource, expiry, key_name, sig = meaning
    if not valid_key_name(key_name):
        raise _malformed("skn must be 1-256 letters, digits, '.', '-', '_'")
    if _EXPIRY.fullmatch(expiry) is None:
        raise _malformed("se must be a Unix time in decimal digits")
    signature = _decode_signature(sig)
    try:
        target = parse_resource(resource)
    except ValueError as exc:
        raise _malformed(f"sr {exc}") from None
    return SasToken(
        resource=resource,
        resource_raw=resource_raw,
        expiry_raw=expiry,
        key_name=key_name,
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


def parse_host_entry(entry: str) -> tuple[str, int | None]:
    """A ``public_hosts`` entry (or a ``Host`` header) as (case-folded host, port or None).
    Raises `AuthConfigError` when it is not ``host`` or ``host:port``."""
    match = _HOST_ENTRY.fullmatch(entry.strip()) if isinstance(entry, str) else None
    if match is None:
        raise AuthConfigError(f"public_hosts: {entry!r} is not host or host:port")
    try:
        return fold(match["host"]), _port(match["port"])
    except ValueError:
        raise AuthConfigError(f"public_hosts: {entry!r} has a port out of range") from None


@dataclass(frozen=True, slots=True)
class _Verified:
    """A token whose signature checked out, as the verified-token cache keeps it: what the
    access checks and the `Principal` need, and nothing of the header as sent (unless the
    signature covers only that spelling of ``sr``)."""

    target: Resource  # the parsed `sr` the access checks use
    rule: AuthRule
    slot: KeySlot
    expiry: int
    valid_until: float  # `se` + clock skew: the full check refuses it from then on
    sig: str  # the signature (base64), compared again in constant time on a hit
    # `sr` exactly as signed, when the signature verifies only over that spelling (a signer
    # whose encoding is not `quote_plus`'s): other spellings of it are then not a hit.
    signed_sr: str | None
    size: int  # estimated bytes of the cache entry (key and value), for the cache's bound


# Per cache entry, beyond what `sys.getsizeof` counts of its objects: the dict slot and the
# order link, the int and float the entry points to, the dict's spare room.
_ENTRY_OVERHEAD = 320


def _entry_size(meaning: _Meaning, verified: _Verified) -> int:
    """An upper estimate of what one cache entry holds in memory (tests/gateway/
    test_token_cache.py measures it with tracemalloc)."""
    target = verified.target
    size = _ENTRY_OVERHEAD + sys.getsizeof(meaning) + sum(map(sys.getsizeof, meaning))
    size += sys.getsizeof(verified) + sys.getsizeof(target) + sys.getsizeof(target.host)
    size += sys.getsizeof(target.path) + sum(map(sys.getsizeof, target.path))
    for part in (target.endpoint_of, target.route_of):
        if part is not None:
            size += sys.getsizeof(part)  # its segments are the path's
    if verified.signed_sr is not None:
        size += sys.getsizeof(verified.signed_sr)
    return size


class Authorizer:
    """Verifies SAS tokens against rules; one instance per gateway, shared by the requests of
    one event loop (not thread-safe: its token cache is a plain LRU).

    *public_hosts* lists the host names (``host`` matches any port, ``host:port`` only that
    port) a token's ``sr`` may name. A token is accepted up to *clock_skew* seconds after its
    expiry; with *max_token_lifetime*, tokens expiring further than that in the future are
    refused. Raises `AuthConfigError` for duplicate rule names, no public host, or a bad
    skew/lifetime.

    Verified tokens are cached, keyed on what the token means (decoded ``sr``, ``se``,
    ``skn``, ``sig``), so that every spelling of one token is one entry; an entry keeps only
    what the checks need. The cache holds at most *token_cache_size* entries and
    *token_cache_bytes* bytes (estimated), least recently used dropped first; a size of 0
    disables it. A client that reuses its token skips most of the parsing and the HMAC,
    never the access checks (`authorize` checks the entity and the right on every call). An
    entry is dropped once its ``se`` plus the clock skew has passed, and `replace_rules` (key
    rotation) empties the cache.

    A token whose ``skn`` names no rule is checked against a decoy rule's keys, and every
    check computes the HMAC of both key slots: an unknown key name and a wrong signature cost
    the same and get the same answer (401 ``invalid_signature``).
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
        token_cache_bytes: int = 16 << 20,
    ) -> None:
        self._rules = _rules_by_name(rules)
        if isinstance(public_hosts, str) or not public_hosts:
            raise AuthConfigError("public_hosts: must list at least one host name")
        self._hosts = frozenset(parse_host_entry(entry) for entry in public_hosts)
        if not math.isfinite(clock_skew) or clock_skew < 0:
            raise AuthConfigError("clock_skew: must be a non-negative number of seconds")
        if max_token_lifetime is not None and (
            not math.isfinite(max_token_lifetime) or max_token_lifetime <= 0
        ):
            raise AuthConfigError("max_token_lifetime: must be a positive number of seconds")
        if token_cache_size < 0:
            raise AuthConfigError("token_cache_size: must be 0 (no cache) or more")
        if token_cache_bytes < 0:
            raise AuthConfigError("token_cache_bytes: must be 0 (no cache) or more")
        self._skew = clock_skew
        self._clock = clock
        self._max_lifetime = max_token_lifetime
        self._cache_size = token_cache_size
        self._cache_bytes = token_cache_bytes
        self._cache: OrderedDict[_Meaning, _Verified] = OrderedDict()
        self._cached_bytes = 0
        # Checked when `skn` names no rule, so that an unknown name costs what a wrong key
        # does; its keys are random, nobody can sign with them, and it is never looked up.
        self._decoy = AuthRule(
            name="decoy",
            primary_key=Secret(base64.b64encode(os.urandom(32)).decode()),
            secondary_key=Secret(base64.b64encode(os.urandom(32)).decode()),
            rights=frozenset({Right.SEND}),
            entities=("*",),
        )

    def replace_rules(self, rules: Iterable[AuthRule]) -> None:
        """Verify with *rules* from now on (a key rotation), forgetting every cached token.
        Raises `AuthConfigError` for duplicate rule names, keeping the current rules."""
        self._rules = _rules_by_name(rules)
        self._cache.clear()
        self._cached_bytes = 0

    @property
    def cached_tokens(self) -> int:
        """How many verified tokens the cache holds."""
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        """The cache's estimated size in bytes (bounded by *token_cache_bytes*)."""
        return self._cached_bytes

    def __repr__(self) -> str:
        hosts = sorted(f"{h}:{p}" if p else h for h, p in self._hosts)
        return f"Authorizer(rules={sorted(self._rules)!r}, public_hosts={hosts!r})"

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
        ``skn`` names a rule and the signature was made with its primary or secondary key
        (one answer, ``invalid_signature``, whichever fails); not expired
        beyond the skew (nor, if configured, living too long); ``sr`` host is a public host;
        ``sr`` path covers the entity — all `Unauthorized` (401). Then the rule grants the
        right and applies to the entity — else `Forbidden` (403). Pure and synchronous.
        """
        verified, resource = self._authenticate(authorization_header)
        rule = verified.rule
        self._check_access(verified.target, rule, entity_path, right)
        return Principal(
            key_name=rule.name,
            key_slot=verified.slot,
            rights=rule.effective_rights,
            resource=resource,
            expires_at=verified.expiry,
            entity_path=entity_path,
        )

    def _authenticate(self, authorization_header: str | None) -> tuple[_Verified, str]:
        """The token's verification and its decoded ``sr``, if genuine and current (else
        401): from the cache when a token of the same meaning was verified and is current."""
        if authorization_header is None or not authorization_header.strip():
            raise Unauthorized(
                ErrorCode.MISSING_TOKEN,
                f"an Authorization header with a {SCHEME} token is required",
            )
        sr_raw, meaning = _split_header(authorization_header)
        cache = self._cache
        hit = cache.get(meaning)
        if hit is not None:
            # The dict matched the meaning (a keyed hash, then equality); compare the
            # signature again in constant time so that no comparison on it is timing-dependent.
            if (
                self._clock() <= hit.valid_until
                and (hit.signed_sr is None or hit.signed_sr == sr_raw)
                and hmac.compare_digest(hit.sig, meaning[3])
            ):
                cache.move_to_end(meaning)
                return hit, meaning[0]
            if self._clock() > hit.valid_until:
                self._evict(meaning)  # expired: verified again below, and refused
        verified = self._verify_header(sr_raw, meaning)
        if (
            self._cache_size
            and meaning not in cache
            and verified.size <= self._cache_bytes
            and authorization_header.isascii()
        ):
            cache[meaning] = verified
            self._cached_bytes += verified.size
            while len(cache) > self._cache_size or self._cached_bytes > self._cache_bytes:
                self._evict(next(iter(cache)))
        return verified, meaning[0]

    def _evict(self, meaning: _Meaning) -> None:
        self._cached_bytes -= self._cache.pop(meaning).size

    def _verify_header(self, sr_raw: str, meaning: _Meaning) -> _Verified:
        """`_authenticate` without the cache: parse, HMAC, expiry and lifetime checks."""
        token = _token_from(sr_raw, meaning)
        rule = self._rules.get(token.key_name)
        slot, signed_sr = _verify(rule or self._decoy, token, self._decoy)
        if rule is None or slot is None:
            # One answer whether the name exists or not: nobody without a key can tell.
            raise Unauthorized(
                ErrorCode.INVALID_SIGNATURE,
                "the token signature does not match (a wrong key, an altered token, or an "
                "skn that names no rule)",
                key_name=token.key_name,
            )
        now = self._clock()
        if now > token.expiry + self._skew:
            expired = datetime.fromtimestamp(token.expiry, UTC).isoformat()
            raise Unauthorized(
                ErrorCode.TOKEN_EXPIRED, f"the token expired at {expired}", key_name=rule.name
            )
        if self._max_lifetime is not None and token.expiry - now > self._max_lifetime:
            raise Unauthorized(
                ErrorCode.TOKEN_LIFETIME_TOO_LONG,
                f"the token expires more than {self._max_lifetime:g} s from now",
                key_name=rule.name,
            )
        verified = _Verified(
            target=token.target,
            rule=rule,
            slot=slot,
            expiry=token.expiry,
            valid_until=token.expiry + self._skew,
            sig=meaning[3],
            signed_sr=signed_sr,
            size=0,
        )
        return dataclasses.replace(verified, size=_entry_size(meaning, verified))

    def _check_access(
        self, resource: Resource, rule: AuthRule, entity_path: str | None, right: Right
    ) -> None:
        """The token was made for this gateway and entity (else 401), and its rule grants
        `right` on the entity (else 403). No message names the rule (the log line does)."""
        if not self._serves(resource):
            raise Unauthorized(
                ErrorCode.INVALID_AUDIENCE,
                "the token's resource (sr) names a host not in public_hosts",
                key_name=rule.name,
            )
        entity = None if entity_path is None else entity_segments(entity_path)
        target = "the namespace" if entity_path is None else f"entity {entity_path[:300]!r}"
        if (entity_path is not None and entity is None) or not _resource_covers(resource, entity):
            raise Unauthorized(
                ErrorCode.RESOURCE_MISMATCH,
                f"the token's resource (sr) does not cover {target}",
                key_name=rule.name,
            )
        if not rule.grants(right):
            raise Forbidden(
                ErrorCode.MISSING_RIGHT,
                f"the token's rule does not grant the {right.value} right",
                key_name=rule.name,
            )
        if not rule.applies_to(entity):
            raise Forbidden(
                ErrorCode.ENTITY_NOT_ALLOWED,
                f"the token's rule does not apply to {target}",
                key_name=rule.name,
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


def _verify(rule: AuthRule, token: SasToken, decoy: AuthRule) -> tuple[KeySlot | None, str | None]:
    """The slot of the key that made the signature (None: neither), and the ``sr`` spelling
    the signature covers when only that one works (None: any spelling of the resource).

    Signers URL-encode ``sr`` in their own way (quote_plus, .NET's WebUtility.UrlEncode, ...)
    and put the same encoded form in the token, so both the form as sent and the canonical
    ``quote_plus`` of the decoded resource are tried. Both name the same decoded resource,
    which is what gets authorized. The work does not depend on the rule: both slots are
    computed (the decoy's secondary key stands in for a missing one) and every HMAC is
    compared, so that an unknown key name, a one-key rule and a two-key rule cost the same.
    """
    canonical = quote_plus(token.resource)
    raw = token.resource_raw
    secondary = rule.secondary_key or decoy.secondary_key or decoy.primary_key
    slots: tuple[tuple[KeySlot | None, Secret], ...] = (
        ("primary", rule.primary_key),
        ("secondary" if rule.secondary_key is not None else None, secondary),
    )
    found: KeySlot | None = None
    raw_only = False
    for slot, key in slots:
        canonical_ok = hmac.compare_digest(
            _signature(key, f"{canonical}\n{token.expiry_raw}"), token.signature
        )
        raw_ok = canonical_ok
        if raw != canonical:
            raw_ok = hmac.compare_digest(
                _signature(key, f"{raw}\n{token.expiry_raw}"), token.signature
            )
        if slot is not None and found is None and (canonical_ok or raw_ok):
            found, raw_only = slot, not canonical_ok
    return found, (raw if raw_only else None)
