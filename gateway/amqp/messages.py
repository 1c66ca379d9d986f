"""An AMQP transfer's payload → the `OutboundMessage`s of one send request, or a refusal.

The gateway carries a message as an `OutboundMessage`: the fields Service Bus acts on and
the application property types its whole path (the primary, a backlog queue, the syphon's
receive and the send home) keeps as they were. Whatever a client's message holds beyond
that is refused here with `NotCarried` (the delivery is rejected `amqp:not-implemented`,
and the SDK raises it at once, unretried), never changed silently: a change would only show
during an outage, when a message went through a backlog queue. docs/amqp.md lists what is
refused; tests/gateway/test_amqp_messages.py holds it for generated messages.

Carried unchanged: one data section as the body; message-id, correlation-id (strings), to,
subject, reply-to, content-type, group-id (SessionId), reply-to-group-id; the header's TTL;
the annotations ``x-opt-partition-key`` and ``x-opt-scheduled-enqueue-time``; application
properties of type string, boolean, every integer type, float, double, timestamp, uuid and
binary (those beyond the REST format's as `Typed` values, which keep their type through a
backlog queue: gateway.core.backlog). Hop-by-hop parts are not messages' content and are
dropped: the header's durable, first-acquirer and delivery-count (Service Bus keeps every
message durably and counts deliveries itself) and delivery annotations. The creation and
absolute-expiry times the SDKs stamp from the TTL are not read: a message encoded from its
fields gets the gateway's own stamps, a message passed through keeps the client's.

Raw passthrough: the fields are still read from every message, for the checks above, the
size limits, the routing and the record; but a message encoded as the SDKs encode it is then
sent to the primary in the client's own bytes (`OutboundMessage.encoded`), less its delivery
annotations and with a header that says more than a TTL cut down to the TTL, so the sink
does not build and encode it again (`_passthrough` says when a message keeps its bytes:
only when they mean exactly what the fields say; the stamps, when a client sends them, are
then the client's). A message sent through a backlog queue is encoded from its fields.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Final

from gateway.core.backlog import REWRITE_KEYS
from gateway.core.message import AppValue, OutboundMessage, Typed, TypedKind, random_id
from gateway.errors import NotCarried, RequestError
from sbamqp import codec
from sbamqp.codec import (
    Byte,
    DecodeError,
    Described,
    Double,
    Float,
    Int,
    Long,
    Short,
    Symbol,
    Timestamp,
    Ubyte,
    Uint,
    Ulong,
    Ushort,
    decode,
)
from sbamqp.sections import section, split

HEADER: Final = 0x70
DELIVERY_ANNOTATIONS: Final = 0x71
MESSAGE_ANNOTATIONS: Final = 0x72
PROPERTIES: Final = 0x73
APPLICATION_PROPERTIES: Final = 0x74
DATA: Final = 0x75
SEQUENCE: Final = 0x76
VALUE: Final = 0x77
FOOTER: Final = 0x78
_SYMBOLIC: Final = {
    "amqp:header:list": HEADER,
    "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    "amqp:properties:list": PROPERTIES,
    "amqp:application-properties:map": APPLICATION_PROPERTIES,
    "amqp:data:binary": DATA,
    "amqp:amqp-sequence:list": SEQUENCE,
    "amqp:amqp-value:*": VALUE,
    "amqp:footer:map": FOOTER,
}
PARTITION_KEY: Final = "x-opt-partition-key"
SCHEDULED_ENQUEUE_TIME: Final = "x-opt-scheduled-enqueue-time"
_DEFAULT_PRIORITY: Final = 4
_RESERVED = frozenset(k.lower() for k in REWRITE_KEYS)
# The properties list's fields, in order (AMQP 1.0, 3.2.4).
_PROPERTY_FIELDS: Final = (
    "message-id",
    "user-id",
    "to",
    "subject",
    "reply-to",
    "correlation-id",
    "content-type",
    "content-encoding",
    "absolute-expiry-time",
    "creation-time",
    "group-id",
    "group-sequence",
    "reply-to-group-id",
)


class MalformedMessage(RequestError):
    """A payload that is not an AMQP message (the delivery is rejected `amqp:decode-error`)."""

    code = "malformed_message"
    amqp_condition = "amqp:decode-error"


def batch_messages(payload: bytes) -> list[bytes]:
    """A batch transfer's (message format 0x80013700) encoded messages: one per data section
    of its envelope. The envelope's other sections (Node sends a header and properties
    there) describe the batch, not a message, and are dropped. Each message is checked by
    `to_outbound`, which reads it anyway (not a second time here, as `split_batch` would)."""
    try:
        envelope = split(payload)
        if envelope.body_code != DATA or not envelope.body:
            raise DecodeError("a batch body must be data sections")
        return [_binary(raw) for raw in envelope.body]
    except DecodeError as exc:
        raise MalformedMessage(f"the batch does not decode: {exc}") from None


def _binary(raw: bytes) -> bytes:
    """The binary of one data section (`split` checked its bounds)."""
    if raw[:3] == b"\x00\x53\x75" and raw[3] in (0xA0, 0xB0):
        return raw[5:] if raw[3] == 0xA0 else raw[8:]
    value = decode(raw)[0]
    if not isinstance(value, Described) or not isinstance(value.value, bytes):
        raise DecodeError("a batch data section is not binary")
    return value.value


def to_outbound(payload: bytes) -> OutboundMessage:
    """One encoded AMQP message as the gateway carries it; raises `NotCarried` for what it
    cannot carry unchanged and `MalformedMessage` for what is not a message. When the
    client's encoding can go to the primary as it is (`_passthrough`), the message keeps it
    (`OutboundMessage.encoded`) and the sink sends those bytes instead of encoding it again."""
    fields: dict[str, Any] = {}
    body: bytes | None = None
    spans = _sections(payload)
    for code, value, _start, _end in spans:
        if code == HEADER:
            fields.update(_header(value))
        elif code == MESSAGE_ANNOTATIONS:
            fields.update(_annotations(value))
        elif code == PROPERTIES:
            fields.update(_properties(value))
        elif code == APPLICATION_PROPERTIES:
            fields["application_properties"] = _application_properties(value)
        elif code == DATA:
            if body is not None:
                raise NotCarried("a body of several data sections cannot be carried; send one")
            body = bytes(value)
        elif code in (SEQUENCE, VALUE):
            raise NotCarried(
                "an amqp-value or amqp-sequence body cannot be carried; send the body as bytes "
                "(one data section)"
            )
        elif code == FOOTER:
            raise NotCarried("a message footer cannot be carried")
        # DELIVERY_ANNOTATIONS: for this hop only
    if body is None:
        raise NotCarried("a message without a data body cannot be carried")
    message_id = fields.pop("message_id", None)
    encoded = None
    if not message_id:
        message_id = random_id()  # as the REST edge; the client's bytes lack it
    else:
        encoded = _passthrough(payload, spans)
    return OutboundMessage(body=body, message_id=message_id, encoded=encoded, **fields)


# A section: (code, value, start, end), its bytes payload[start:end]; start is -1 when the
# message was decoded generically (then nothing is passed through).
_Span = tuple[int, Any, int, int]


def _sections(payload: bytes) -> list[_Span]:
    try:
        fast = _sections_fast(payload)
        if fast is not None:
            return fast
        values = codec.decode_all(payload)
    except DecodeError as exc:
        raise MalformedMessage(f"the message does not decode: {exc}") from None
    out: list[_Span] = []
    for value in values:
        if not isinstance(value, Described):
            raise MalformedMessage("a message section is not a described value")
        code = value.descriptor
        if isinstance(code, str):
            code = _SYMBOLIC.get(code, -1)
        if not isinstance(code, int) or not HEADER <= code <= FOOTER:
            raise MalformedMessage(f"unknown message section {value.descriptor!r}")
        if out and code <= out[-1][0] and code != DATA:
            raise MalformedMessage(f"section {code:#x} repeated or out of order")
        out.append((int(code), value.value, -1, -1))
    return out


def _sections_fast(payload: bytes) -> list[_Span] | None:
    """The sections of a message as the SDKs encode it (each descriptor a small ulong, the
    body one binary), without building a `Described` per section or decoding the body
    (its bytes are taken as they are); None for any other encoding, which `_sections`
    then decodes generically."""
    out: list[_Span] = []
    off, size = 0, len(payload)
    last = 0
    while off < size:
        if payload[off] != 0x00 or off + 3 > size or payload[off + 1] != 0x53:
            return None
        code = payload[off + 2]
        if not HEADER <= code <= FOOTER:
            return None
        if code <= last and code != DATA:
            raise DecodeError(f"section {code:#x} repeated or out of order")
        last = code
        begin = off
        off += 3
        if code == DATA and off < size and payload[off] in (0xA0, 0xB0):
            width = 1 if payload[off] == 0xA0 else 4
            if off + 1 + width > size:
                raise DecodeError("truncated data section")
            length = int.from_bytes(payload[off + 1 : off + 1 + width], "big")
            start = off + 1 + width
            off = start + length
            if off > size:
                raise DecodeError("data section overruns the message")
            out.append((code, payload[start:off], begin, off))
            continue
        value, off = codec.decode(payload, off)
        out.append((code, value, begin, off))
    return out


def _passthrough(payload: bytes, spans: list[_Span]) -> bytes | None:
    """The client's encoding of a message `to_outbound` accepted, as the primary is sent it:
    its sections as received, less the delivery annotations (for this hop only), and with a
    header that says more than the TTL rebuilt to say only that. None (the message is then
    encoded from its fields, as before) wherever sending the bytes as they are would not
    give exactly the message the fields describe: a section decoded generically (a symbolic
    descriptor), an annotation key or a content-type that is not a symbol, send-time stamps
    that are not timestamps, a properties list longer than the standard's, a TTL of 0 (sent
    as 1 ms) or beyond a uint (sent as none)."""
    changes: list[tuple[int, int, bytes]] = []  # (start, end, what replaces the bytes)
    for code, value, start, end in spans:
        if start < 0:
            return None
        if code == PROPERTIES:
            if not _plain_properties(value):
                return None
        elif code == DELIVERY_ANNOTATIONS:
            changes.append((start, end, b""))
        elif code == HEADER:
            header = _plain_header(value)
            if header is None:
                return None
            if header is not _KEEP:
                changes.append((start, end, header))
        elif code == MESSAGE_ANNOTATIONS and any(type(k) is not Symbol for k in value):
            return None  # (a map with a repeated key does not decode: sbamqp.codec)
    if not changes:
        return payload  # the common case: the client's bytes, not even copied
    parts: list[bytes] = []
    last = 0
    for start, end, replacement in changes:
        parts += (payload[last:start], replacement)
        last = end
    parts.append(payload[last:])
    return b"".join(parts)


_KEEP: Final = b"keep"  # `_plain_header`: the section as it is


def _plain_header(value: list[Any]) -> bytes | None:
    """`_KEEP` for a header holding at most a TTL (as a uint) and defaults; else the header
    that holds only its TTL (b"" for none), or None when the TTL is not a uint above 0."""
    fields = (list(value) + [None] * 5)[:5]
    durable, _priority, ttl, first_acquirer, delivery_count = fields  # priority: checked
    if ttl is not None and (type(ttl) is not Uint or ttl == 0):
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 0 < ttl < 2**32:
            return None
        return section(HEADER, [None, None, Uint(ttl)])
    if len(value) <= 5 and not durable and not first_acquirer and not delivery_count:
        return _KEEP
    return b"" if ttl is None else section(HEADER, [None, None, ttl])


def _plain_properties(value: list[Any]) -> bool:
    """Whether a properties list (already checked by `_properties`) is what the fields say:
    at most the standard's 13 fields, a symbol content-type, timestamp stamps."""
    n = len(value)
    if n <= 6:
        return True
    if n > 13:
        return False
    content_type = value[6]
    if content_type is not None and type(content_type) is not Symbol:
        return False
    return all(v is None or type(v) is Timestamp for v in value[8:10])


def _header(value: Any) -> dict[str, Any]:
    fields = list(value) + [None] * 5 if isinstance(value, list) else None
    if fields is None:
        raise MalformedMessage("the header is not a list")
    _durable, priority, ttl, _first_acquirer, _delivery_count = fields[:5]
    if priority is not None and priority != _DEFAULT_PRIORITY:
        raise NotCarried("a message priority cannot be carried (Service Bus ignores it)")
    if ttl is None:
        return {}
    if not isinstance(ttl, int) or isinstance(ttl, bool):
        raise MalformedMessage("the header's ttl is not a number")
    if ttl < 0:
        raise MalformedMessage("the header's ttl is negative")
    if ttl >= 2**32:
        # The standard's ttl is a uint: beyond one is sent as none (the entity's default
        # applies, never shorter than asked), and a timedelta could not even hold a ulong.
        return {}
    # Never under the broker's unit: 0 would be timedelta(0), a falsy "no TTL" (the wire
    # sends 1 ms for it).
    return {"time_to_live": dt.timedelta(milliseconds=max(int(ttl), 1))}


def _annotations(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedMessage("the message annotations are not a map")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == PARTITION_KEY and isinstance(v, str) and not isinstance(v, Symbol):
            out["partition_key"] = str(v)
        elif key == SCHEDULED_ENQUEUE_TIME and isinstance(v, Timestamp):
            try:
                out["scheduled_enqueue_time_utc"] = v.to_datetime()
            except DecodeError as exc:  # beyond the calendar: the client's, not a bug
                raise MalformedMessage(f"the scheduled enqueue time: {exc}") from None
        else:
            raise NotCarried(f"the message annotation {str(key)[:100]!r} cannot be carried")
    return out


# The properties the gateway cannot carry, and those it carries as strings (with the
# `OutboundMessage` field each goes to), by their index in the list, in the order checked.
_REFUSED_PROPERTIES: Final = tuple(
    (_PROPERTY_FIELDS.index(name), name)
    for name in ("user-id", "content-encoding", "group-sequence")
)
_STRING_PROPERTIES: Final = tuple(
    (_PROPERTY_FIELDS.index(name), name, field)
    for name, field in (
        ("message-id", "message_id"),
        ("correlation-id", "correlation_id"),
        ("to", "to"),
        ("subject", "subject"),
        ("reply-to", "reply_to"),
        ("group-id", "session_id"),
        ("reply-to-group-id", "reply_to_session_id"),
    )
)
_CONTENT_TYPE: Final = _PROPERTY_FIELDS.index("content-type")


def _properties(value: Any) -> dict[str, Any]:
    if not isinstance(value, list):
        raise MalformedMessage("the properties section is not a list")
    n = len(value)  # fields past the standard's 13 are not read (the list may be shorter)
    for i, name in _REFUSED_PROPERTIES:
        if i < n and value[i] is not None:
            raise NotCarried(f"the property {name} cannot be carried")
    out: dict[str, Any] = {}
    for i, name, field in _STRING_PROPERTIES:
        v = value[i] if i < n else None
        if v is None:
            continue
        if type(v) is not str:  # a uuid, ulong or binary id would arrive as a string
            raise NotCarried(f"the {name} must be a string to be carried unchanged")
        out[field] = v
    content_type = value[_CONTENT_TYPE] if _CONTENT_TYPE < n else None
    if content_type is not None:
        if not isinstance(content_type, str):
            raise MalformedMessage("the content-type is not a symbol")
        out["content_type"] = str(content_type)
    return out


def _application_properties(value: Any) -> dict[str, AppValue]:
    if not isinstance(value, dict):
        raise MalformedMessage("the application properties are not a map")
    out: dict[str, AppValue] = {}
    for key, v in value.items():
        if type(key) is not str:
            raise NotCarried("application property names must be strings to be carried")
        if key.lower() in _RESERVED:
            raise NotCarried(
                f"the application property {key!r} is reserved: the gateway uses it to carry "
                "a message through a backlog queue; use another name"
            )
        out[key] = _app_value(key, v)
    return out


# The decoder's integer classes → the kind they are carried as (with their type).
_TYPED_INTEGERS: Final[dict[type, TypedKind]] = {
    Ubyte: "ubyte",
    Ushort: "ushort",
    Uint: "uint",
    Ulong: "ulong",
    Byte: "byte",
    Short: "short",
    Long: "long",
    Timestamp: "timestamp",
}


def _app_value(key: str, v: Any) -> AppValue:
    """A value the whole path keeps with its AMQP type, or `NotCarried`."""
    t = type(v)
    if t is str or t is bool:
        return v  # type: ignore[no-any-return]
    if t is Int:
        return int(v)  # a plain int is sent as an AMQP int again
    if t is Double:
        return float(v)  # a plain float is sent as a double again
    kind = _TYPED_INTEGERS.get(t)
    if kind is not None:
        return Typed(kind, int(v))
    if t is Float:
        return Typed("float", float(v))
    if t is uuid.UUID:
        return Typed("uuid", v)
    if t is bytes:
        return Typed("binary", v)
    raise NotCarried(
        f"application property {key[:100]!r}: the AMQP type {t.__name__} is not carried "
        "(carried: string, boolean, the integer types, float, double, timestamp, uuid, binary)"
    )
