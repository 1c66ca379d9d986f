"""The message the gateway sends: independent of HTTP and of the Service Bus SDK."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

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

# Fixed per-message overhead of the AMQP encoding (header, section descriptors, ...). Service
# Bus counts the whole encoded message against its size limit; we count body + properties +
# this allowance, which errs on the side of answering 413 rather than having the broker reject.
_OVERHEAD = 64


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
    # Bytes as Service Bus counts them against the message size limit (an upper estimate),
    # computed once: the edge checks it and the dispatcher's admission gate counts it.
    size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", estimate_size(self))

    @property
    def batch_key(self) -> str | None:
        """Messages with different partition/session keys must not share one broker batch."""
        return self.partition_key or self.session_id


def _value_size(v: AppValue) -> int:
    raw: object = v.value if isinstance(v, Typed) else v
    if isinstance(raw, bool):
        return 1
    if isinstance(raw, uuid.UUID):
        return 16
    if isinstance(raw, int | float | dt.datetime):
        return 8
    if isinstance(raw, bytes):
        return len(raw)
    if isinstance(raw, str):
        return len(raw.encode("utf-8"))
    # Nothing the edges build; a backlog message anyone wrote may hold it (the syphon's
    # receive then reports the message unreadable: gateway.servicebus.receiver).
    raise TypeError(f"an application property of type {type(raw).__name__}")


def estimate_size(m: OutboundMessage, extra_properties: dict[str, AppValue] | None = None) -> int:
    """Body + system properties + application properties (+ `extra_properties`), in bytes."""
    n = _OVERHEAD + len(m.body)
    for s in (
        m.message_id,
        m.content_type,
        m.correlation_id,
        m.session_id,
        m.subject,
        m.reply_to,
        m.reply_to_session_id,
        m.to,
        m.partition_key,
    ):
        if s:
            n += len(s.encode("utf-8")) + 2
    if m.time_to_live is not None:
        n += 9
    if m.scheduled_enqueue_time_utc is not None:
        n += 30
    for props in (m.application_properties, extra_properties or {}):
        for k, v in props.items():
            n += len(k.encode("utf-8")) + _value_size(v) + 4
    return n
