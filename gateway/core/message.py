"""The message the gateway sends: independent of HTTP and of the Service Bus SDK."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

# Random ids (a message's default MessageId, a request's id, at every edge): 32 hex digits of
# os.urandom, as uuid4().hex, taken from a pool filled 256 at a time, so that a request
# makes no getrandom call of its own. `deque.popleft` is one C call, atomic under the GIL: no
# id is handed out twice, whichever thread asks. A forked child empties the pool it
# inherited (it would hand out its parent's next ids: duplicate MessageIds are dropped by
# Service Bus's duplicate detection).
_IDS_PER_FILL = 256
_ids: deque[str] = deque()


def random_id() -> str:
    """32 random hex digits (128 bits from os.urandom)."""
    try:
        return _ids.popleft()
    except IndexError:
        pool = os.urandom(16 * _IDS_PER_FILL).hex()
        _ids.extend(pool[i : i + 32] for i in range(0, len(pool), 32))
        return _ids.popleft()


os.register_at_fork(after_in_child=_ids.clear)


# AMQP types an application property may have beyond the REST format's own (string, int or
# long, double, boolean): what the AMQP edge carries with its type (`Typed`).
TypedKind = Literal[
    "ubyte", "ushort", "uint", "ulong", "byte", "short", "long", "float", "timestamp", "uuid",
    "binary",
]  # fmt: skip
TYPED_KINDS: Final = frozenset(get_args(TypedKind))
# The integer kinds' ranges (AMQP 1.0, 1.6): what a restored value is checked against.
INTEGER_RANGES: Final = {
    "ubyte": range(0, 2**8),
    "ushort": range(0, 2**16),
    "uint": range(0, 2**32),
    "ulong": range(0, 2**64),
    "byte": range(-(2**7), 2**7),
    "short": range(-(2**15), 2**15),
    "long": range(-(2**63), 2**63),
    "timestamp": range(-(2**63), 2**63),  # milliseconds since the epoch
}


@dataclass(frozen=True, slots=True)
class Typed:
    """An application property value sent with an AMQP type of its own (a uint, a uuid, a
    timestamp in milliseconds, binary...; gateway.amqp.messages): encoded with that type,
    and carried through a backlog queue with it (gateway.core.backlog)."""

    kind: TypedKind
    value: int | float | bytes | uuid.UUID


AppValue = str | int | float | bool | bytes | dt.datetime | Typed

# What Service Bus counts against its size limit is the whole encoded AMQP message. `size` is
# an upper bound of that encoding, not an estimate: every part is counted at its widest AMQP
# form (a string or binary as str32/vbin32, a map or list as map32/list32, a number as 8
# bytes), so a message measured at or under a limit encodes at or under it, whatever its
# property names and values (tests/gateway/test_size_bound.py holds it to the SDK's encoder
# over generated messages). It errs toward 413, by a few bytes per field.
_DESCRIBED = 3  # a section's descriptor: 0x00, smallulong, code
_COMPOUND = 9  # a list32 or map32 constructor: code, 4-byte size, 4-byte count
_VARIABLE = 5  # a str32, sym32 or vbin32 constructor: code, 4-byte length
_FIXED8 = 9  # a long, double, timestamp or uint-as-uint: code and up to 8 bytes
# The body's data section; the header (with a TTL: durable, priority, ttl, first-acquirer,
# delivery-count); the properties list's 13 fields as nulls, plus two timestamps the SDK
# stamps with a TTL; the message annotations' map.
_BODY = _DESCRIBED + _VARIABLE
_HEADER = _DESCRIBED + _COMPOUND + 4 + _FIXED8
_PROPERTIES = _DESCRIBED + _COMPOUND + 13
_STAMPS = 2 * _FIXED8
_MAP = _DESCRIBED + _COMPOUND
# The annotation keys the SDK writes (x-opt-scheduled-enqueue-time, x-opt-partition-key).
_SCHEDULE_ANNOTATION = _VARIABLE + 28 + _FIXED8
_PARTITION_ANNOTATION = _VARIABLE + 19 + _VARIABLE
# What one message adds to a broker batch beyond its own encoding (the SDK's
# `_BATCH_MESSAGE_OVERHEAD_COST`, the larger of its two values: a data section around it).
BATCH_ITEM_OVERHEAD = 8


@dataclass(frozen=True, slots=True)
class OutboundMessage:
    """One message as a client asked for it (the REST BrokerProperties, named as the SDK does)."""

    body: bytes
    message_id: str
    content_type: str | None = None
    correlation_id: str | None = None
    session_id: str | None = None
    subject: str | None = None  # REST "Label"
    reply_to: str | None = None
    reply_to_session_id: str | None = None
    to: str | None = None
    time_to_live: dt.timedelta | None = None
    scheduled_enqueue_time_utc: dt.datetime | None = None
    partition_key: str | None = None
    application_properties: dict[str, AppValue] = field(default_factory=dict)
    # Raw passthrough (the AMQP edge): the message's AMQP encoding as the client sent it, less
    # what the gateway drops on the way (gateway.amqp.messages), sent to the primary as it
    # is instead of being encoded again from the fields above, which it holds unchanged.
    # None: encoded from the fields. Whatever changes a field must drop it (the backlog
    # rewrite and the syphon's restore do: gateway.core.backlog).
    encoded: bytes | None = field(default=None, repr=False, compare=False)
    # An upper bound of the bytes Service Bus counts against its size limit (see above),
    # computed once: the edge checks it and the dispatcher's admission gate counts it.
    size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = estimate_size(self)
        if self.encoded is not None:  # a client's encoding may be wider than the bound's
            size = max(size, len(self.encoded) + BATCH_ITEM_OVERHEAD)
        object.__setattr__(self, "size", size)

    @property
    def batch_key(self) -> str | None:
        """Messages with different partition/session keys must not share one broker batch."""
        return self.partition_key or self.session_id


def _text(s: str) -> int:
    return _VARIABLE + len(s.encode("utf-8", "surrogatepass"))


def _value_size(v: AppValue) -> int:
    """An application-property value at its widest encoding: bool 1 byte; a uuid 17; an
    integer of any kind (up to a long or ulong), a float (a double) and a datetime or
    timestamp 9; bytes and binary a vbin32, a string a str32."""
    raw: object = v.value if isinstance(v, Typed) else v
    if isinstance(raw, bool):
        return 1
    if isinstance(raw, uuid.UUID):
        return 1 + 16
    if isinstance(raw, int | float | dt.datetime):
        return _FIXED8
    if isinstance(raw, bytes):
        return _VARIABLE + len(raw)
    if isinstance(raw, str):
        return _text(raw)
    # Nothing the edges build; a backlog message anyone wrote may hold it (the syphon's
    # receive then reports the message unreadable: gateway.servicebus.receiver).
    raise TypeError(f"an application property of type {type(raw).__name__}")


def properties_size(props: dict[str, AppValue]) -> int:
    """The application-properties section of `props`, at its widest."""
    if not props:
        return 0
    return _MAP + sum(_text(k) + _value_size(v) for k, v in props.items())


def estimate_size(m: OutboundMessage, extra_properties: dict[str, AppValue] | None = None) -> int:
    """An upper bound of `m`'s encoding (with `extra_properties` added to its application
    properties) plus what it adds to a broker batch. See the constants above."""
    n = BATCH_ITEM_OVERHEAD + _BODY + len(m.body) + _PROPERTIES
    for s in (
        m.message_id,
        m.content_type,
        m.correlation_id,
        m.session_id,
        m.subject,
        m.reply_to,
        m.reply_to_session_id,
        m.to,
    ):
        if s:
            n += _text(s)
    if m.time_to_live is not None:
        n += _HEADER + _STAMPS
    if m.partition_key or m.scheduled_enqueue_time_utc is not None:
        n += _MAP
        if m.scheduled_enqueue_time_utc is not None:
            n += _SCHEDULE_ANNOTATION
        if m.partition_key:
            n += _PARTITION_ANNOTATION + len(m.partition_key.encode("utf-8", "surrogatepass"))
    props = m.application_properties
    if extra_properties:
        props = {**props, **extra_properties}
    return n + properties_size(props)


def envelope_size(first: OutboundMessage) -> int:
    """An upper bound of a broker batch's envelope, which carries its first message's
    MessageId, SessionId and PartitionKey (the SDK's `set_batch_envelope_properties`)."""
    n = _PROPERTIES + _text(first.message_id)
    if first.session_id:
        n += _text(first.session_id)
    if first.partition_key:
        n += (
            _MAP + _PARTITION_ANNOTATION + len(first.partition_key.encode("utf-8", "surrogatepass"))
        )
    return n


def batch_size(messages: Sequence[OutboundMessage]) -> int:
    """An upper bound of one broker send of `messages`: a lone message goes as it is;
    several go in a batch with an envelope."""
    total = sum(m.size for m in messages)
    return total if len(messages) <= 1 else total + envelope_size(messages[0])
