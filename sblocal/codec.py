"""AMQP 1.0 message encoding at the section level.

The broker never needs a full decode of the messages it stores: it reads a few fields
(header, message annotations, properties) to apply Service Bus semantics and keeps the rest
(application properties, body, footer) as the exact bytes the sender wrote. On delivery it
writes a fresh header and message-annotations section in front of those bytes. This keeps
every body type (data, value, sequence, several data sections) intact and costs a few
microseconds per message instead of a full proton decode/encode round trip.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, cast

from proton import UNDESCRIBED, Array, Data, Described, symbol, timestamp, ubyte, uint, ulong

# Section descriptor codes (AMQP 1.0 §3.2).
HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78

_SYMBOLIC_DESCRIPTORS = {
    b"amqp:header:list": HEADER,
    b"amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    b"amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    b"amqp:properties:list": PROPERTIES,
    b"amqp:application-properties:map": APPLICATION_PROPERTIES,
    b"amqp:data:binary": DATA,
    b"amqp:amqp-sequence:list": AMQP_SEQUENCE,
    b"amqp:value:*": AMQP_VALUE,
    b"amqp:footer:map": FOOTER,
}

# Service Bus broker annotations (what azure-servicebus reads on a received message).
SEQUENCE_NUMBER = symbol("x-opt-sequence-number")
ENQUEUED_TIME = symbol("x-opt-enqueued-time")
LOCKED_UNTIL = symbol("x-opt-locked-until")
SCHEDULED_ENQUEUE_TIME = symbol("x-opt-scheduled-enqueue-time")
PARTITION_KEY = symbol("x-opt-partition-key")
MESSAGE_STATE = symbol("x-opt-message-state")
DEADLETTER_SOURCE = symbol("x-opt-deadletter-source")
ENQUEUE_SEQUENCE_NUMBER = symbol("x-opt-enqueue-sequence-number")
BROKER_ANNOTATIONS = frozenset(
    {SEQUENCE_NUMBER, ENQUEUED_TIME, LOCKED_UNTIL, MESSAGE_STATE, DEADLETTER_SOURCE}
)

PROPERTY_NAMES = (
    "message_id",
    "user_id",
    "to",
    "subject",
    "reply_to",
    "correlation_id",
    "content_type",
    "content_encoding",
    "absolute_expiry_time",
    "creation_time",
    "group_id",
    "group_sequence",
    "reply_to_group_id",
)


class CodecError(ValueError):
    """The bytes are not a well-formed AMQP message."""


def _skip(buf: bytes | memoryview, off: int) -> int:
    """Return the offset just past the AMQP value that starts at ``off``."""
    code = buf[off]
    off += 1
    if code == 0x00:  # described: descriptor value, then the value itself
        return _skip(buf, _skip(buf, off))
    width = code >> 4
    if width == 0x4:
        return off
    if width == 0x5:
        return off + 1
    if width == 0x6:
        return off + 2
    if width == 0x7:
        return off + 4
    if width == 0x8:
        return off + 8
    if width == 0x9:
        return off + 16
    if width in (0xA, 0xC, 0xE):
        return off + 1 + buf[off]
    if width in (0xB, 0xD, 0xF):
        return off + 4 + int.from_bytes(buf[off : off + 4], "big")
    raise CodecError(f"unknown AMQP format code 0x{code:02x}")


def split_sections(buf: bytes | memoryview) -> list[tuple[int, int, int]]:
    """Split an encoded message into ``(descriptor, start, end)`` sections."""
    out: list[tuple[int, int, int]] = []
    off = 0
    n = len(buf)
    try:
        while off < n:
            if buf[off] != 0x00:
                raise CodecError("message section is not a described type")
            kind = buf[off + 1]
            if kind == 0x53:  # smallulong descriptor
                code = buf[off + 2]
            elif kind == 0x80:  # ulong descriptor
                code = int.from_bytes(buf[off + 2 : off + 10], "big")
            else:  # symbolic descriptor (rare; decode it properly)
                data = Data()
                data.decode(bytes(buf[off + 1 : off + 1 + (_skip(buf, off + 1) - off - 1)]))
                data.rewind()
                data.next()
                code = _SYMBOLIC_DESCRIPTORS.get(str(data.get_object()).encode(), -1)
            end = _skip(buf, off)
            if end > n:
                raise CodecError("truncated message")
            out.append((code, off, end))
            off = end
    except IndexError as exc:
        raise CodecError("truncated message") from exc
    return out


def _own(value: Any) -> Any:
    """Copy proton's binary memoryviews out before the `Data` that owns them is freed."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, Described):
        return Described(value.descriptor, _own(value.value))
    if isinstance(value, dict):
        return type(value)((_own(k), _own(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_own(v) for v in value]
    if isinstance(value, Array):
        return Array(value.descriptor, value.type, *[_own(v) for v in value.elements])
    return value


def decode_value(buf: bytes | memoryview) -> Any:
    """Decode one AMQP value (a whole section: returns its ``Described``)."""
    data = Data()
    data.decode(bytes(buf))
    data.rewind()
    data.next()
    return _own(data.get_object())


def encode_value(value: Any) -> bytes:
    data = Data()
    data.put_object(value)
    return bytes(data.encode())


def section_body(buf: bytes | memoryview) -> Any:
    """The value inside a described section."""
    described = decode_value(buf)
    return described.value if isinstance(described, Described) else described


@dataclass(slots=True)
class ParsedMessage:
    """The fields of an incoming message that the broker acts on, plus its raw tail."""

    durable: bool
    priority: int | None
    ttl_ms: int | None
    annotations: dict[Any, Any]
    properties: list[Any]
    tail: bytes  # properties section onward (properties, application properties, body, footer)
    app_properties_range: tuple[int, int] | None  # inside ``tail``
    has_body: bool

    def prop(self, name: str) -> Any:
        i = PROPERTY_NAMES.index(name)
        return self.properties[i] if i < len(self.properties) else None


def parse_message(buf: bytes | memoryview) -> ParsedMessage:
    """Parse an encoded AMQP message into what the broker needs; raises CodecError."""
    sections = split_sections(buf)
    durable = False
    priority: int | None = None
    ttl: int | None = None
    annotations: dict[Any, Any] = {}
    properties: list[Any] = []
    tail_start: int | None = None
    app_range: tuple[int, int] | None = None
    has_body = False
    try:
        for code, start, end in sections:
            if code == HEADER:
                header = section_body(buf[start:end]) or []
                durable = bool(header[0]) if len(header) > 0 and header[0] is not None else False
                priority = int(header[1]) if len(header) > 1 and header[1] is not None else None
                ttl = int(header[2]) if len(header) > 2 and header[2] is not None else None
            elif code == DELIVERY_ANNOTATIONS:
                continue  # hop-by-hop: never stored
            elif code == MESSAGE_ANNOTATIONS:
                annotations = dict(section_body(buf[start:end]) or {})
            else:
                if tail_start is None:
                    tail_start = start
                if code == PROPERTIES:
                    properties = list(section_body(buf[start:end]) or [])
                elif code == APPLICATION_PROPERTIES:
                    app_range = (start - tail_start, end - tail_start)
                elif code in (DATA, AMQP_SEQUENCE, AMQP_VALUE):
                    has_body = True
    except Exception as exc:  # proton raises several types on malformed input
        raise CodecError(f"malformed message section: {exc}") from exc
    tail = bytes(buf[tail_start:]) if tail_start is not None else b""
    return ParsedMessage(durable, priority, ttl, annotations, properties, tail, app_range, has_body)


def split_batch(buf: bytes | memoryview) -> list[bytes]:
    """The messages of a batch transfer (message format 0x80013700, which the transfer
    frame carries: the broker learns it in `sblocal.amqp.front`): each data section of the
    envelope is one encoded message. The envelope's other sections (Node puts a header,
    empty annotations and properties there) belong to no message; an empty batch, or one
    with an amqp-value or amqp-sequence body, is malformed.
    """
    inner: list[bytes] = []
    for code, start, end in split_sections(buf):
        if code == DATA:
            payload = section_body(buf[start:end])
            if not isinstance(payload, bytes):
                raise CodecError("a batch's data section holds no message")
            inner.append(payload)
        elif code in (AMQP_SEQUENCE, AMQP_VALUE):
            raise CodecError("a batch carries its messages in data sections only")
    if not inner:
        raise CodecError("a batch with no message")
    return inner


def encode_header(
    durable: bool, priority: int | None, ttl_ms: int | None, delivery_count: int
) -> bytes:
    fields: list[Any] = [
        durable,
        ubyte(priority) if priority is not None else None,
        uint(ttl_ms) if ttl_ms is not None and 0 <= ttl_ms <= 0xFFFFFFFF else None,
        delivery_count == 0,
        uint(delivery_count),
    ]
    return encode_value(Described(ulong(HEADER), fields))


def encode_annotations(annotations: dict[Any, Any]) -> bytes:
    return encode_value(Described(ulong(MESSAGE_ANNOTATIONS), annotations))


def encode_app_properties(props: dict[Any, Any]) -> bytes:
    return encode_value(Described(ulong(APPLICATION_PROPERTIES), props))


def ts(ms: int) -> timestamp:
    return timestamp(ms)


def long_array(values: list[int]) -> Array:
    return Array(cast(Any, UNDESCRIBED), Data.LONG, *values)


def timestamp_array(values: list[int]) -> Array:
    return Array(cast(Any, UNDESCRIBED), Data.TIMESTAMP, *[timestamp(v) for v in values])


def as_uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, bytes) and len(value) == 16:
        return uuid.UUID(bytes=value)
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            return None
    return None


def to_text(value: Any) -> str | None:
    """Message ids may be strings, uuids, ulongs or binary; Service Bus compares them as text."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
