"""Message sections: split an encoded message into raw sections, view them, re-assemble.

An AMQP message is a run of described sections in a fixed order: header, delivery
annotations, message annotations, properties, application properties, the body (one or
more data sections, one or more sequence sections, or one value section), footer.
``split`` keeps each section's exact bytes, so ``Sections.to_bytes()`` gives back the same
payload, and ``join`` replaces some sections (say the application properties, to add a
routing hint) while the body and the footer stay byte for byte as the client sent them.

The views (``Header``, ``Properties``, ``application_properties``) decode a section only
when asked. ``split_batch`` takes a batch transfer (message format 0x80013700) apart into
its encoded messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sbamqp.codec import (
    Buffer,
    DecodeError,
    Described,
    Symbol,
    Timestamp,
    Ubyte,
    Uint,
    Ulong,
    decode,
    encode,
    skip,
)

__all__ = [
    "AMQP_SEQUENCE",
    "AMQP_VALUE",
    "APPLICATION_PROPERTIES",
    "DATA",
    "DELIVERY_ANNOTATIONS",
    "FOOTER",
    "HEADER",
    "MESSAGE_ANNOTATIONS",
    "PROPERTIES",
    "Header",
    "Properties",
    "Sections",
    "join",
    "section",
    "split",
    "split_batch",
    "update_annotations",
    "update_application_properties",
]

HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78

_NAMES = {
    "amqp:header:list": HEADER,
    "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    "amqp:properties:list": PROPERTIES,
    "amqp:application-properties:map": APPLICATION_PROPERTIES,
    "amqp:data:binary": DATA,
    "amqp:amqp-sequence:list": AMQP_SEQUENCE,
    "amqp:value:*": AMQP_VALUE,
    "amqp:footer:map": FOOTER,
}
_SINGLE = {
    HEADER: "header",
    DELIVERY_ANNOTATIONS: "delivery_annotations",
    MESSAGE_ANNOTATIONS: "message_annotations",
    PROPERTIES: "properties",
    APPLICATION_PROPERTIES: "application_properties",
}
_BODY = (DATA, AMQP_SEQUENCE, AMQP_VALUE)


@dataclass(frozen=True, slots=True)
class Sections:
    """A message's sections, each the exact bytes of its encoding (descriptor included).

    ``body`` holds the body sections in order and ``body_code`` their kind (DATA,
    AMQP_SEQUENCE or AMQP_VALUE; None for a message without a body).
    """

    header: bytes | None = None
    delivery_annotations: bytes | None = None
    message_annotations: bytes | None = None
    properties: bytes | None = None
    application_properties: bytes | None = None
    body: tuple[bytes, ...] = ()
    body_code: int | None = None
    footer: bytes | None = None

    def to_bytes(self) -> bytes:
        """The message, re-assembled in section order."""
        parts = [
            self.header,
            self.delivery_annotations,
            self.message_annotations,
            self.properties,
            self.application_properties,
            *self.body,
            self.footer,
        ]
        return b"".join(p for p in parts if p)

    def header_view(self) -> Header:
        """The header's fields (defaults when there is no header)."""
        return Header.from_section(self.header)

    def properties_view(self) -> Properties:
        """The properties' fields (all None when there is no properties section)."""
        return Properties.from_section(self.properties)

    def annotations(self) -> dict[Any, Any]:
        """The message annotations as a map (empty when absent)."""
        return _map_section(self.message_annotations)

    def application_properties_items(self) -> list[tuple[str, bytes, Any]]:
        """The application properties: ``(key, raw value bytes, typed value)`` in order."""
        return application_properties(self.application_properties)

    def data(self) -> list[bytes]:
        """The binaries of the data body sections (``DecodeError`` for another body)."""
        if self.body_code not in (DATA, None):
            raise DecodeError("the body is not made of data sections")
        return [_section_value(raw) for raw in self.body]

    @property
    def body_size(self) -> int:
        """Bytes of the body sections."""
        return sum(len(raw) for raw in self.body)


def _section_code(buf: Buffer, off: int) -> tuple[int, int]:
    """(section code, offset of its value); ``DecodeError`` if not a section."""
    if buf[off] != 0x00:
        raise DecodeError(f"no section descriptor at offset {off}")
    if off + 3 < len(buf) and buf[off + 1] == 0x53 and HEADER <= buf[off + 2] <= FOOTER:
        return buf[off + 2], off + 3  # the usual smallulong descriptor
    descriptor, value_off = decode(buf, off + 1)
    if isinstance(descriptor, int) and not isinstance(descriptor, bool):
        code = descriptor
    else:
        code = _NAMES.get(descriptor, -1) if isinstance(descriptor, str) else -1
    if not HEADER <= code <= FOOTER:
        raise DecodeError(f"unknown section descriptor {descriptor!r:.60}")
    return code, value_off


def split(payload: Buffer) -> Sections:
    """The sections of an encoded message, each kept as its exact bytes.

    Checks the order (each section kind at most once, the body after the properties and
    before the footer, one kind of body, at most one value section) and that every section
    fits in the payload; the sections' insides are decoded only by the views. Raises
    ``DecodeError``.
    """
    found: dict[str, bytes] = {}
    body: list[bytes] = []
    body_code: int | None = None
    footer: bytes | None = None
    last = 0
    off = 0
    n = len(payload)
    while off < n:
        code, value_off = _section_code(payload, off)
        end = skip(payload, value_off)
        raw = bytes(payload[off:end])
        if footer is not None:
            raise DecodeError("a section after the footer")
        if code in _SINGLE:
            if code <= last:
                raise DecodeError(f"section {code:#x} out of order")
            found[_SINGLE[code]] = raw
        elif code == FOOTER:
            footer = raw
        else:
            if body_code is not None and (code != body_code or code == AMQP_VALUE):
                raise DecodeError("a body mixes section kinds, or has two value sections")
            body_code = code
            body.append(raw)
        last = code
        off = end
    return Sections(body=tuple(body), body_code=body_code, footer=footer, **found)


def _section_value(raw: bytes) -> Any:
    _, value_off = _section_code(raw, 0)
    value, _ = decode(raw, value_off)
    return value


def _map_section(raw: bytes | None) -> dict[Any, Any]:
    if raw is None:
        return {}
    value = _section_value(raw)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DecodeError("an annotations section is not a map")
    return value


def application_properties(raw: bytes | None) -> list[tuple[str, bytes, Any]]:
    """``(key, raw value bytes, typed value)`` per application property, in wire order.

    Keys must be strings (the standard says so; the SDKs send strings). Values must be
    simple (no list, map or array; a described value is allowed, as .NET sends some
    types so). Raises ``DecodeError``.
    """
    if raw is None:
        return []
    _, value_off = _section_code(raw, 0)
    code = raw[value_off]
    if code == 0x40:
        return []
    if code not in (0xC1, 0xD1):
        raise DecodeError("application properties are not a map")
    if code == 0xC1:
        if value_off + 3 > len(raw):
            raise DecodeError("truncated application properties")
        count, pos = raw[value_off + 2], value_off + 3
    else:
        if value_off + 9 > len(raw):
            raise DecodeError("truncated application properties")
        count = int.from_bytes(raw[value_off + 5 : value_off + 9], "big")
        pos = value_off + 9
    end = skip(raw, value_off)
    if count % 2 or count > end - pos:
        raise DecodeError("application properties: a bad element count")
    items = []
    seen = set()
    for _ in range(count // 2):
        key, pos = decode(raw, pos)
        if type(key) is not str:
            raise DecodeError(f"application property key is not a string: {key!r:.60}")
        if key in seen:
            raise DecodeError(f"duplicate application property {key!r:.60}")
        seen.add(key)
        start = pos
        value, pos = decode(raw, pos)
        if isinstance(value, list | dict):
            raise DecodeError(f"application property {key!r:.60} is not a simple value")
        items.append((key, raw[start:pos], value))
    if pos != end:
        raise DecodeError("application properties: size does not match the elements")
    return items


def section(code: int, value: Any) -> bytes:
    """The encoding of one section holding ``value`` (a map, a list, bytes, ...)."""
    return b"\x00\x53" + bytes((code,)) + encode(value)


def encode_application_properties(items: list[tuple[str, bytes, Any]]) -> bytes:
    """An application-properties section from ``(key, raw value, _)`` items: the raw
    value bytes are reused as they are, so each value keeps its exact encoding."""
    body = b"".join(encode(key) + raw for key, raw, _ in items)
    count = 2 * len(items)
    if len(body) + 1 < 256 and count < 256:
        value = bytes((0xC1, len(body) + 1, count)) + body
    else:
        value = b"\xd1" + (len(body) + 4).to_bytes(4, "big") + count.to_bytes(4, "big") + body
    return b"\x00\x53\x74" + value


def join(sections: Sections, **replaced: bytes | None) -> bytes:
    """The message with some sections replaced (raw section bytes, or None to drop one).

    Only the header, annotations, properties and application properties may be replaced;
    the body and the footer keep their bytes. Raises ``ValueError`` for another name.
    """
    allowed = set(_SINGLE.values())
    unknown = set(replaced) - allowed
    if unknown:
        raise ValueError(f"cannot replace {sorted(unknown)}")
    changes: dict[str, Any] = dict(replaced)
    return replace(sections, **changes).to_bytes()


def update_application_properties(
    sections: Sections, updates: Mapping[str, Any], remove: Iterable[str] = ()
) -> Sections:
    """The message with application properties set (replaced in place, or appended) and
    others removed. Untouched properties keep their exact bytes; new values are encoded
    with ``sbamqp.codec.encode`` (give them their AMQP type). With nothing left, the section
    goes. Raises ``DecodeError`` for application properties that cannot be read."""
    gone = set(remove)
    items = []
    pending = dict(updates)
    for key, raw, value in sections.application_properties_items():
        if key in gone:
            continue
        if key in pending:
            new = pending.pop(key)
            items.append((key, encode(new), new))
        else:
            items.append((key, raw, value))
    items += [(key, encode(value), value) for key, value in pending.items()]
    section_bytes = encode_application_properties(items) if items else None
    return replace(sections, application_properties=section_bytes)


def update_annotations(
    sections: Sections, updates: Mapping[str, Any], remove: Iterable[str] = ()
) -> Sections:
    """The message with message annotations set (keys become symbols) and others removed;
    the rest of the map is re-encoded with its types kept. With nothing left, the section
    goes."""
    gone = {Symbol(k) for k in remove}
    current = {k: v for k, v in sections.annotations().items() if k not in gone}
    for key, value in updates.items():
        current.pop(key, None)  # a string key of the same text
        current[Symbol(key)] = value
    section_bytes = section(MESSAGE_ANNOTATIONS, current) if current else None
    return replace(sections, message_annotations=section_bytes)


def split_batch(payload: Buffer) -> list[bytes]:
    """The encoded messages of a batch transfer (message format 0x80013700).

    The batch's body is one data section per message. Node also puts a header, empty
    annotations and properties on the batch itself: tolerated and ignored. Every message
    is checked with ``split``. Raises ``DecodeError`` (also for a batch without messages).
    """
    outer = split(payload)
    if outer.body_code != DATA or not outer.body:
        raise DecodeError("a batch body must be data sections")
    messages = []
    for raw in outer.body:
        inner = _section_value(raw)
        if not isinstance(inner, bytes):
            raise DecodeError("a batch data section is not binary")
        split(inner)
        messages.append(inner)
    return messages


@dataclass(slots=True)
class Header:
    """The header section's fields (defaults as the standard gives them)."""

    durable: bool = False
    priority: int = 4
    ttl: int | None = None
    first_acquirer: bool = False
    delivery_count: int = 0

    @classmethod
    def from_section(cls, raw: bytes | None) -> Header:
        """Decode a raw header section (``DecodeError`` if it is not a header list)."""
        if raw is None:
            return cls()
        value = _section_value(raw)
        if not isinstance(value, list):
            raise DecodeError("the header section is not a list")
        value = (value + [None] * 5)[:5]
        kinds = (bool, int, int, bool, int)
        for v, kind in zip(value, kinds, strict=True):
            if v is not None and not isinstance(v, kind):
                raise DecodeError(f"header field of the wrong type: {v!r:.60}")
        header = cls()
        for f, v in zip(fields(cls), value, strict=True):
            if v is not None:
                setattr(header, f.name, v)
        return header

    def to_section(self) -> bytes:
        """The header section's encoding."""
        values = [
            self.durable,
            Ubyte(self.priority),
            None if self.ttl is None else Uint(self.ttl),
            self.first_acquirer,
            Uint(self.delivery_count),
        ]
        while values and values[-1] is None:
            values.pop()
        return section(HEADER, values)


# The type each properties field must have (None: an id, checked apart).
_PROPERTY_KINDS: tuple[type | tuple[type, ...] | None, ...] = (
    None, bytes, str, str, str, None, str, str, Timestamp, Timestamp, str, int, str,
)  # fmt: skip
_PROPERTY_NAMES = (
    "message_id", "user_id", "to", "subject", "reply_to", "correlation_id", "content_type",
    "content_encoding", "absolute_expiry_time", "creation_time", "group_id", "group_sequence",
    "reply_to_group_id",
)  # fmt: skip


@dataclass(slots=True)
class Properties:
    """The properties section. Ids keep their AMQP type (``Ulong``, ``uuid.UUID``,
    ``bytes`` or ``str``); ``group_id`` is Service Bus's session id."""

    message_id: Any = None
    user_id: bytes | None = None
    to: str | None = None
    subject: str | None = None
    reply_to: str | None = None
    correlation_id: Any = None
    content_type: str | None = None
    content_encoding: str | None = None
    absolute_expiry_time: Timestamp | None = None
    creation_time: Timestamp | None = None
    group_id: str | None = None
    group_sequence: int | None = None
    reply_to_group_id: str | None = None
    extra: list[Any] = field(default_factory=list)

    @classmethod
    def from_section(cls, raw: bytes | None) -> Properties:
        """Decode a raw properties section (``DecodeError`` for a field of a wrong type)."""
        if raw is None:
            return cls()
        value = _section_value(raw)
        if not isinstance(value, list):
            raise DecodeError("the properties section is not a list")
        return cls.from_list(value)

    @classmethod
    def from_list(cls, value: list[Any]) -> Properties:
        """From the properties' decoded list (``DecodeError`` for a field of a wrong type)."""
        padded = (value + [None] * 13)[:13]
        for v, kind, name in zip(padded, _PROPERTY_KINDS, _PROPERTY_NAMES, strict=True):
            if v is not None and kind is not None and not isinstance(v, kind):
                raise DecodeError(f"properties.{name} is of the wrong type")
        for v in (padded[0], padded[5]):
            if isinstance(v, list | dict | Described | bool):
                raise DecodeError("a message or correlation id is not an id")
        props = cls(*padded)
        props.extra = value[13:]
        return props

    def to_list(self) -> list[Any]:
        """The properties as typed AMQP values, trailing nulls trimmed."""
        values: list[Any] = [
            _id(self.message_id),
            self.user_id,
            self.to,
            self.subject,
            self.reply_to,
            _id(self.correlation_id),
            None if self.content_type is None else Symbol(self.content_type),
            None if self.content_encoding is None else Symbol(self.content_encoding),
            self.absolute_expiry_time,
            self.creation_time,
            self.group_id,
            None if self.group_sequence is None else Uint(self.group_sequence),
            self.reply_to_group_id,
            *self.extra,
        ]
        while values and values[-1] is None:
            values.pop()
        return values

    def to_section(self) -> bytes:
        """The properties section's encoding."""
        return section(PROPERTIES, self.to_list())


def _id(value: Any) -> Any:
    """A plain ``int`` id as the ulong an id must be; typed values stay as they are."""
    return Ulong(value) if type(value) is int else value


def message(
    *,
    properties: Properties | None = None,
    application_properties: dict[str, Any] | None = None,
    value: Any = None,
    data: bytes | None = None,
) -> bytes:
    """A small encoded message (for replies such as ``$cbs`` and management answers)."""
    parts = []
    if properties is not None:
        parts.append(properties.to_section())
    if application_properties is not None:
        parts.append(section(APPLICATION_PROPERTIES, application_properties))
    if data is not None:
        parts.append(section(DATA, data))
    else:
        parts.append(section(AMQP_VALUE, value))
    return b"".join(parts)


def value_of(sections: Sections) -> Any:
    """The body of a message with one value section (a request body), decoded."""
    if sections.body_code != AMQP_VALUE:
        raise DecodeError("the body is not a value section")
    return _section_value(sections.body[0])


def descriptor_of(raw: bytes) -> int:
    """The section code of one raw section."""
    return _section_code(raw, 0)[0]
