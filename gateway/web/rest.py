"""The Service Bus REST message format → `OutboundMessage`s. Pure functions (fuzzed).

Single message: body = message body, ``Content-Type`` = its content type, header
``BrokerProperties`` = JSON, every other non-standard header = an application property.
Batch: ``Content-Type: application/vnd.microsoft.servicebus.json``, body = JSON array of
``{"Body": str, "IsBodyBase64": bool, "BrokerProperties": {...}, "UserProperties": {...}}``;
custom request headers are not applied to batch items (as in Service Bus).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import email.utils
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from gateway.core.backlog import REWRITE_KEYS
from gateway.core.message import AppValue, OutboundMessage, random_id
from gateway.errors import PayloadTooLarge, RequestError

log = logging.getLogger(__name__)

BATCH_CONTENT_TYPE = "application/vnd.microsoft.servicebus.json"
MAX_ID_LENGTH = 128
MAX_PROPERTY_BYTES = 32 * 1024  # one property (docs/design.md#the-rest-format)
MAX_ALL_PROPERTIES_BYTES = 64 * 1024  # all properties of a message
# TimeSpan.MaxValue in seconds; Service Bus caps TTL at the entity's default anyway.
MAX_TTL_SECONDS = 10675199 * 86400.0

# Headers never copied into application properties: hop-by-hop and transport headers,
# credentials, the ones this format gives a meaning of their own, and what proxies, ingress
# controllers, load balancers, CDNs and meshes add on the way (docs/security.md lists each
# one's set): the client did not send those, and they would count against the 64 KB limit.
NEVER_COPIED = frozenset(
    h.lower()
    for h in (
        "Accept",
        "Accept-Charset",
        "Accept-Encoding",
        "Accept-Language",
        "Authorization",
        "B3",
        "BrokerProperties",
        "Cache-Control",
        "Connection",
        "Content-Encoding",
        "Content-Length",
        "Content-MD5",
        "Content-Type",
        "Cookie",
        "Date",
        "DNT",
        "Expect",
        "Forwarded",
        "From",
        "Host",
        "Idempotency-Key",
        "If-Match",
        "If-Modified-Since",
        "If-None-Match",
        "If-Range",
        "If-Unmodified-Since",
        "Keep-Alive",
        "Max-Forwards",
        "Pragma",
        "Proxy",  # ingress-nginx sends it empty (httpoxy mitigation)
        "Range",
        "Referer",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "True-Client-IP",
        "Upgrade",
        "User-Agent",
        "Via",
        "Warning",
        "X-Client-IP",
        "X-Cloud-Trace-Context",
        "X-Cluster-Client-IP",
        "X-Ot-Span-Context",
        "X-Real-IP",
        "X-Request-Id",
        "X-Request-Start",
        "X-Scheme",
        "x-ms-retrypolicy",
        # Not copied as they are: a valid pair becomes the message's trace context
        # (Diagnostic-Id, traceparent, tracestate; gateway.tracing).
        "traceparent",
        "tracestate",
    )
)
_NEVER_COPIED_PREFIXES = (
    "proxy-",
    "sec-",
    "ssl-client-",  # ingress-nginx with client certificates
    "cf-",
    "x-amzn-",
    "x-appgw-",  # Azure Application Gateway
    "x-arr-",  # Azure Application Request Routing (App Gateway, App Service)
    "x-azure-",  # Azure Front Door
    "x-b3-",
    "x-datadog-",
    "x-envoy-",  # Envoy, Istio
    "x-fd-",  # Azure Front Door
    "x-forwarded-",  # every proxy: -For, -Host, -Port, -Proto, -Scheme, -Prefix, -Server, ...
    "x-original-",  # ingress-nginx, Application Gateway: -URI, -URL, -Host, -Forwarded-For
)

_INT = re.compile(r"-?\d{1,18}\Z")
_FLOAT = re.compile(r"-?\d+\.\d+([eE][-+]?\d+)?\Z")
# A number written as a JSON string, as the legacy Python client writes every broker property.
_NUMERIC_STRING = re.compile(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?\Z")

# BrokerProperties that carry meaning here; others are ignored, as Service Bus does.
_STRING_PROPS = {
    "MessageId": "message_id",
    "CorrelationId": "correlation_id",
    "SessionId": "session_id",
    "Label": "subject",
    "ReplyTo": "reply_to",
    "ReplyToSessionId": "reply_to_session_id",
    "To": "to",
    "PartitionKey": "partition_key",
    "ContentType": "content_type",
}

# Every BrokerProperties name read here, by its lower case: a name that matches one only in
# another letter case (`messageId`) is ignored, as Service Bus ignores it — and a mistyped
# MessageId silently defeats duplicate detection, so it is said once (`_unread_names`).
_READ_NAMES = {n.lower(): n for n in (*_STRING_PROPS, "TimeToLive", "ScheduledEnqueueTimeUtc")}
_SAID_NAMES: set[str] = set()
_SAID_MAX = 100  # a bound on what is remembered, whatever clients send

# The backlog rewrite's property names (gateway.core.backlog), in any letter case: a client's
# value would be read back by the syphon as the gateway's own (its destination, its TTL), so
# no client may set them, as a header or as a batch item's UserProperties.
RESERVED_PROPERTIES = frozenset(REWRITE_KEYS)

# One batch item as the format allows it, matched on the raw body (`_prescan`): a JSON object
# whose values are scalars or objects of scalars (BrokerProperties, UserProperties), or a
# scalar (which the parser then refuses by name). Possessive and atomic throughout, and the
# alternatives start with different bytes: a body that does not match fails in linear time.
_STR = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_PLAIN = rb"(?:" + _STR + rb'|[^"{}\[\]]++)*+'
_ITEM = re.compile(
    rb"[ \t\r\n]*+(?>\{(?:" + _STR + rb'|[^"{}\[\]]++|\{' + _PLAIN + rb"\})*+\}"
    rb"|" + _STR + rb'|[^"{}\[\],]++)'
)
_SPACE = re.compile(rb"[ \t\r\n]*+")
# Below this many commas per allowed item, a body with no nested array and few objects
# cannot make the parser build much (`_prescan`).
_VALUES_PER_ITEM = 16


# The first pass over a single-message request's raw header fields (`copied_headers`): the
# names every request carries (Host, Content-Length, Authorization, what proxies add) are
# dropped on their bytes, before anything is decoded. It drops only what `parse_single` would
# drop anyway (never a reserved name, which it refuses): an ASCII name matches here exactly
# when its decoded, lower-cased form matches there, and a name that is not ASCII never does.
_NEVER_COPIED_RAW = frozenset(n.encode("ascii") for n in NEVER_COPIED - RESERVED_PROPERTIES)
_NEVER_COPIED_RAW_PREFIXES = tuple(p.encode("ascii") for p in _NEVER_COPIED_PREFIXES)

# At most MAX_ID_LENGTH characters (the SDK refuses longer ones with a ValueError).
_ID_PROPS = frozenset({"MessageId", "SessionId", "PartitionKey", "ReplyToSessionId"})


def _is_copied(name: str, value: str) -> bool:
    low = name.lower()
    if low == "origin":
        # A browser's CORS Origin is never quoted; a quoted "origin" is a client's string
        # property (the legacy Node.js client sends origin: "node"): copy only that one.
        return len(value) >= 2 and value[0] == value[-1] == '"'
    return low not in NEVER_COPIED and not low.startswith(_NEVER_COPIED_PREFIXES)


def copied_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The header fields `parse_single` may copy or refuse, decoded, with their names as the
    client wrote them (aiohttp's parsed headers capitalise well-known names: ``origin``
    would become an ``Origin`` property); the rest are dropped undecoded."""
    out: list[tuple[str, str]] = []
    for name, value in raw_headers:
        low = name.lower()
        if low in _NEVER_COPIED_RAW or low.startswith(_NEVER_COPIED_RAW_PREFIXES):
            continue
        out.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )
    return out


def header_value(raw: str) -> AppValue:
    """A custom-property header value: ``"quoted"`` → string; a number → int/float;
    ``true``/``false`` → bool; anything else → the string as sent."""
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        return raw[1:-1]
    if _INT.match(raw):
        return int(raw)
    if _FLOAT.match(raw):
        f = float(raw)
        if math.isfinite(f):
            return f
    if raw in {"true", "false"}:
        return raw == "true"
    return raw


def _parse_json(raw: bytes | str, what: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"{what} is not valid JSON: {exc.msg}") from None


def parse_broker_properties(raw: str | None) -> dict[str, Any]:
    """The ``BrokerProperties`` header → a JSON object (400 if it is not one)."""
    if raw is None or not raw.strip():
        return {}
    value = _parse_json(raw, "BrokerProperties")
    if not isinstance(value, dict):
        raise RequestError("BrokerProperties must be a JSON object")
    return value


def _ttl(value: Any) -> dt.timedelta:
    # Service Bus takes numeric broker properties as JSON numbers or as numeric strings
    # ({"TimeToLive": "60"} from the legacy Python client).
    if isinstance(value, str) and _NUMERIC_STRING.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError("BrokerProperties.TimeToLive must be a number of seconds")
    if not math.isfinite(value) or value <= 0 or value > MAX_TTL_SECONDS:
        raise RequestError(
            f"BrokerProperties.TimeToLive must be > 0 and <= {MAX_TTL_SECONDS:.0f} seconds"
        )
    # Never under the broker's unit, a millisecond (the wire sends at least one): a smaller
    # value would be timedelta(0) below a microsecond, a falsy "no TTL".
    return max(dt.timedelta(seconds=float(value)), _MIN_TTL)


_MIN_TTL = dt.timedelta(milliseconds=1)


def _schedule(value: Any) -> dt.datetime:
    if not isinstance(value, str):
        raise RequestError("BrokerProperties.ScheduledEnqueueTimeUtc must be an RFC 1123 date")
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        when = None
    if when is None or when.tzinfo is None:
        raise RequestError(
            "BrokerProperties.ScheduledEnqueueTimeUtc must be an RFC 1123 date such as "
            "'Sun, 06 Nov 1994 08:49:37 GMT'"
        )
    when = when.astimezone(dt.UTC)
    if not 2000 <= when.year <= 9999:
        raise RequestError("BrokerProperties.ScheduledEnqueueTimeUtc is out of range")
    return when


def _check_text(name: str, value: Any, limit: int | None = None) -> str:
    if not isinstance(value, str):
        raise RequestError(f"BrokerProperties.{name} must be a string")
    if limit is not None and len(value) > limit:
        raise RequestError(f"BrokerProperties.{name} is longer than {limit} characters")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_PROPERTY_BYTES:
        raise RequestError(f"BrokerProperties.{name} is larger than 32 KB")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise RequestError(f"BrokerProperties.{name} is not valid UTF-8 text")
    return value


def _check_app_properties(props: Mapping[str, AppValue], where: str) -> None:
    total = 0
    for key, value in props.items():
        if not key or len(key) > 256:
            raise RequestError(f"{where}: property names must be 1 to 256 characters")
        size = len(key.encode("utf-8", "surrogatepass"))
        if _has_surrogates(key) or (isinstance(value, str) and _has_surrogates(value)):
            raise RequestError(f"{where}: property {key!r} is not valid UTF-8 text")
        if isinstance(value, str):
            size += len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, bytes):
            size += len(value)
        if size > MAX_PROPERTY_BYTES:
            raise PayloadTooLarge(
                f"{where}: property {key!r} is larger than 32 KB",
                size=size,
                limit=MAX_PROPERTY_BYTES,
            )
        total += size
    if total > MAX_ALL_PROPERTIES_BYTES:
        raise PayloadTooLarge(
            f"{where}: properties together are larger than 64 KB",
            size=total,
            limit=MAX_ALL_PROPERTIES_BYTES,
        )


def build_message(
    body: bytes,
    content_type: str | None,
    props: Mapping[str, Any],
    app_properties: dict[str, AppValue],
    *,
    default_message_id: str | None,
    where: str = "BrokerProperties",
    context: Mapping[str, str] | None = None,
) -> OutboundMessage:
    """One message from its parts. Raises `RequestError` (400/413) with a clear message.

    `context`: the request's trace-context properties (gateway.tracing), added to
    `app_properties` where the client did not set the same name itself."""
    fields: dict[str, Any] = {}
    if props:  # most requests set no broker property at all
        _unread_names(props)
        for rest_name, attr in _STRING_PROPS.items():
            if rest_name in props and props[rest_name] is not None:
                limit = MAX_ID_LENGTH if rest_name in _ID_PROPS else None
                fields[attr] = _check_text(rest_name, props[rest_name], limit)
        if props.get("TimeToLive") is not None:
            fields["time_to_live"] = _ttl(props["TimeToLive"])
        if props.get("ScheduledEnqueueTimeUtc") is not None:
            fields["scheduled_enqueue_time_utc"] = _schedule(props["ScheduledEnqueueTimeUtc"])
        sid, pkey = fields.get("session_id"), fields.get("partition_key")
        if sid is not None and pkey is not None and sid != pkey:
            raise RequestError(f"{where}: PartitionKey must equal SessionId when both are set")
    if not fields.get("message_id"):
        fields["message_id"] = default_message_id or random_id()
    # The Content-Type header wins over a ContentType broker property.
    ct = content_type if content_type else fields.pop("content_type", None)
    fields.pop("content_type", None)
    if ct is not None and _has_surrogates(ct):
        raise RequestError("Content-Type is not valid UTF-8 text")
    if ct is not None and not ct.isascii():
        # An AMQP symbol: Service Bus refuses anything else (amqp:decode-error).
        prefix = "" if where == "BrokerProperties" else f"{where}: "
        raise RequestError(f"{prefix}the content type must be ASCII text (an AMQP symbol)")
    if context:
        for name, value in context.items():
            app_properties.setdefault(name, value)
    if app_properties:
        _check_app_properties(app_properties, where)
    return OutboundMessage(
        body=body, content_type=ct, application_properties=app_properties, **fields
    )


def _unread_names(props: Mapping[str, Any]) -> None:
    """One WARNING line per BrokerProperties name that is a known one in the wrong letter
    case (per process, for the first `_SAID_MAX` such names): Service Bus ignores it too,
    so the message goes on, without it."""
    for name in props:
        known = _READ_NAMES.get(name.lower())
        if known is None or known == name or name in _SAID_NAMES:
            continue
        if len(_SAID_NAMES) < _SAID_MAX:
            _SAID_NAMES.add(name)
            log.warning(
                "BrokerProperties %r is ignored: names are case-sensitive, as in Service Bus; "
                "did you mean %r?",
                name,
                known,
                extra={"property": name},
            )


def parse_single(
    body: bytes,
    content_type: str | None,
    headers: Iterable[tuple[str, str]],
    broker_properties: str | None,
    idempotency_key: str | None,
    context: Mapping[str, str] | None = None,
) -> OutboundMessage:
    """A single-message request → one message (with the trace `context`, if any)."""
    app: dict[str, AppValue] = {}
    for name, value in headers:
        if name.lower() in RESERVED_PROPERTIES:
            raise _reserved(f"header {name!r}", name)
        if _is_copied(name, value):
            app[name] = header_value(value)
    key = _idempotency(idempotency_key)
    return build_message(
        body,
        content_type,
        parse_broker_properties(broker_properties),
        app,
        default_message_id=key,
        context=context,
    )


def _reserved(what: str, name: str) -> RequestError:
    return RequestError(
        f"{what} is reserved: the gateway uses it to carry a message through a backlog queue "
        "(docs/security.md#reserved-property-names); use another name",
        property=name,
    )


def _idempotency(key: str | None) -> str | None:
    if key is None:
        return None
    key = key.strip()
    if not key or len(key) > MAX_ID_LENGTH:
        raise RequestError(f"Idempotency-Key must be 1 to {MAX_ID_LENGTH} characters")
    if _has_surrogates(key):
        raise RequestError("Idempotency-Key is not valid UTF-8 text")
    return key


def _has_surrogates(text: str) -> bool:
    """aiohttp decodes invalid UTF-8 in headers to lone surrogates; Service Bus refuses them."""
    if text.isascii():
        return False
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def parse_batch(
    raw: bytes,
    idempotency_key: str | None,
    max_messages: int,
    context: Mapping[str, str] | None = None,
) -> list[OutboundMessage]:
    """A batch request body → messages (each with the trace `context`, if any). The whole
    batch is rejected if any item is bad. The item count and nesting are checked on the
    body's shape first (`_prescan`), before any item is built."""
    _prescan(raw, max_messages)
    items = _parse_json(raw, "the batch body")
    if _LONG_DIGITS.search(raw):
        # orjson reads an integer beyond 64 bits as a float, which would be sent as a double;
        # the standard parser keeps it exact, so that `_user_properties` refuses it. Only for
        # a body with a run of 19 digits somewhere (orjson has already checked the syntax).
        items = json.loads(raw)
    if not isinstance(items, list):
        raise RequestError("a batch body must be a JSON array of messages")
    if not items:
        raise RequestError("a batch must contain at least one message")
    if len(items) > max_messages:
        raise PayloadTooLarge(
            f"a batch may contain at most {max_messages} messages; this one has {len(items)}",
            size=len(items),
            limit=max_messages,
        )
    key = _idempotency(idempotency_key)
    if key is not None and len(f"{key}:{len(items) - 1}") > MAX_ID_LENGTH:
        raise RequestError(
            f"Idempotency-Key is too long for a batch of {len(items)}: the MessageIds "
            f"'<key>:<index>' it gives must be at most {MAX_ID_LENGTH} characters"
        )
    out: list[OutboundMessage] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        where = f"batch[{i}]"
        msg = _batch_item(item, where, f"{key}:{i}" if key else None, context)
        if msg.message_id in seen:
            raise RequestError(f"{where}: MessageId {msg.message_id!r} repeats within the batch")
        seen.add(msg.message_id)
        out.append(msg)
    return out


def _prescan(raw: bytes, max_messages: int) -> None:
    """Refuse a batch body with too many items (413) or an item nested deeper than the
    format (400) before anything is built: one regex match per item, at most
    `max_messages` + 1 of them, in the regex engine (1 MiB of ``{},`` would otherwise be
    ~350k dicts, ~37 MB, before the 413). A body that is not an array, or not well-formed
    between items, is left to the parser, which says why (it builds at most
    `max_messages` items before it fails).

    Most bodies skip the scan: one ``[`` (no nested array), at most three ``{`` per allowed
    item and fewer than `_VALUES_PER_ITEM` commas per allowed item bound what the parser can
    build, whatever the rest says (brackets and commas inside strings only count against
    the body); `bytes.count` checks that at memory speed, where the scan costs ~4 ns a byte.
    """
    if (
        raw.count(b"[") <= 1
        and raw.count(b"{") <= 3 * max_messages
        and raw.count(b",") < _VALUES_PER_ITEM * max_messages
    ):
        return
    pos = _space(raw, 0)
    first = raw[pos : pos + 1]
    if first == b"{":
        raise RequestError("a batch body must be a JSON array of messages")
    if first != b"[" or raw[_space(raw, pos + 1) : _space(raw, pos + 1) + 1] == b"]":
        return
    pos, count = pos + 1, 0
    while True:
        m = _ITEM.match(raw, pos)
        if m is None:
            raise RequestError(
                f"batch[{count}] is not a message: a JSON object whose BrokerProperties and "
                "UserProperties values are each a string, number or boolean"
            )
        count += 1
        if count > max_messages:
            raise PayloadTooLarge(
                f"a batch may contain at most {max_messages} messages; this one has more",
                limit=max_messages,
            )
        pos = _space(raw, m.end())
        if raw[pos : pos + 1] != b",":
            return
        pos += 1


def _space(raw: bytes, pos: int) -> int:
    """The index of the first byte from `pos` on that is not JSON whitespace."""
    m = _SPACE.match(raw, pos)
    return pos if m is None else m.end()


_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_BATCH_ITEM_FIELDS = frozenset({"Body", "IsBodyBase64", "BrokerProperties", "UserProperties"})


def _batch_item(
    item: Any,
    where: str,
    default_message_id: str | None,
    context: Mapping[str, str] | None = None,
) -> OutboundMessage:
    """One batch item → a message (`default_message_id` when it names none)."""
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be a JSON object")
    unknown = set(item) - _BATCH_ITEM_FIELDS
    if unknown:
        raise RequestError(f"{where} has unknown field(s) {sorted(unknown)}")
    body = _batch_body(item, where)
    props = item.get("BrokerProperties") or {}
    if not isinstance(props, dict):
        raise RequestError(f"{where}.BrokerProperties must be a JSON object")
    user = item.get("UserProperties") or {}
    if not isinstance(user, dict):
        raise RequestError(f"{where}.UserProperties must be a JSON object")
    ct = props.get("ContentType")
    return build_message(
        body,
        ct if isinstance(ct, str) else None,
        props,
        _user_properties(user, where),
        default_message_id=default_message_id,
        where=where,
        context=context,
    )


def _batch_body(item: dict[str, Any], where: str) -> bytes:
    """A batch item's ``Body``: UTF-8 text, or base64 when ``IsBodyBase64`` is true."""
    body_value = item.get("Body", "")
    if not isinstance(body_value, str):
        raise RequestError(f"{where}.Body must be a string (set IsBodyBase64 for binary)")
    is_b64 = item.get("IsBodyBase64", False)
    if not isinstance(is_b64, bool):
        raise RequestError(f"{where}.IsBodyBase64 must be true or false")
    if is_b64:
        try:
            return base64.b64decode(body_value, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}.Body is not valid base64") from None
    if _has_surrogates(body_value):
        raise RequestError(f"{where}.Body is not valid UTF-8 text")
    return body_value.encode("utf-8")


def _user_properties(user: dict[str, Any], where: str) -> dict[str, AppValue]:
    """A batch item's ``UserProperties``: strings, finite numbers (64-bit integers), booleans."""
    app: dict[str, AppValue] = {}
    for k, v in user.items():
        if k.lower() in RESERVED_PROPERTIES:
            raise _reserved(f"{where}.UserProperties.{k}", k)
        if not isinstance(v, bool | str | int | float) or (
            isinstance(v, float) and not math.isfinite(v)
        ):
            raise RequestError(f"{where}.UserProperties.{k} must be a string, number or boolean")
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
            raise RequestError(f"{where}.UserProperties.{k} is out of the 64-bit range")
        app[k] = v
    return app
