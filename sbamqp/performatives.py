"""AMQP 1.0 performatives, SASL frames, delivery states and terminus types as dataclasses.

Each type is a described list on the wire. ``from_described`` checks every field's type
(a peer sending a string where a handle belongs gets a ``DecodeError``, not a crash later),
fills absent trailing fields with their defaults, and ignores extra fields. ``encode``
gives the described list with trailing nulls trimmed.

Field values use the ``sbamqp.codec`` types; the encoder wraps plain ints and strings in
the field's AMQP type, so the engine can write ``Flow(link_credit=5)``.

One rule the Service Bus SDKs depend on: an ``Error`` always encodes its ``info`` as a map
(an empty one when there is none). The Python SDK indexes into it and its send never
returns when it is null.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from sbamqp.codec import (
    Array,
    DecodeError,
    Described,
    Symbol,
    Ubyte,
    Uint,
    Ulong,
    Ushort,
    encode,
)

__all__ = [
    "PERFORMATIVES",
    "SASL_FRAMES",
    "Accepted",
    "Attach",
    "Begin",
    "Close",
    "Coordinator",
    "DeliveryState",
    "Detach",
    "Disposition",
    "End",
    "Error",
    "Flow",
    "Modified",
    "Open",
    "Performative",
    "Received",
    "Rejected",
    "Released",
    "SaslChallenge",
    "SaslInit",
    "SaslMechanisms",
    "SaslOutcome",
    "SaslResponse",
    "Source",
    "Target",
    "TransactionalState",
    "decode_outcome",
    "descriptor_code",
]

T = TypeVar("T", bound="Composite")

# Field kinds: how a field is checked when decoded and wrapped when encoded.
_Check = Callable[[Any], bool]


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFFFFFF


def _is_ulong(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFFFFFFFFFFFFFF


def _is_ushort(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFF


def _is_ubyte(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFF


def _is_symbols(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _symbols(v: Any) -> Any:
    if isinstance(v, str):
        return Symbol(v)
    return Array([Symbol(x) for x in v], code=0xB3)


_KINDS: dict[str, tuple[_Check, Callable[[Any], Any]]] = {
    "uint": (_is_uint, Uint),
    "ulong": (_is_ulong, Ulong),
    "ushort": (_is_ushort, Ushort),
    "ubyte": (_is_ubyte, Ubyte),
    "bool": (lambda v: isinstance(v, bool), bool),
    # A symbol where a string belongs is taken: refusing it would end the connection of a
    # client that encodes a name or an address that way, for nothing.
    "str": (lambda v: isinstance(v, str), str),
    "symbol": (lambda v: isinstance(v, str), Symbol),
    "binary": (lambda v: isinstance(v, bytes), bytes),
    "map": (lambda v: isinstance(v, dict), lambda v: v),
    "symbols": (_is_symbols, _symbols),
    "any": (lambda v: True, lambda v: v),
}


def _fail(cls: type, name: str, value: Any) -> DecodeError:
    return DecodeError(f"{cls.__name__}.{name}: unexpected {type(value).__name__} {value!r:.60}")


@dataclass
class Composite:
    """A described list with typed fields (the base of every type in this module)."""

    DESCRIPTOR: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    # Per field, in wire order: its kind (a key of _KINDS) or a Composite type.
    KINDS: ClassVar[tuple[Any, ...]] = ()
    MANDATORY: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_described(cls: type[T], value: Any) -> T:
        """Check and convert a decoded ``Described`` (its descriptor already matched)."""
        items = value.value if isinstance(value, Described) else value
        if not isinstance(items, list):
            raise DecodeError(f"{cls.__name__} is not a list")
        args = {}
        for (f, kind), item in zip(zip(fields(cls), cls.KINDS, strict=True), items, strict=False):
            if item is None:
                continue
            if isinstance(kind, str):
                if not _KINDS[kind][0](item):
                    raise _fail(cls, f.name, item)
                args[f.name] = item
            else:
                args[f.name] = _composite(kind, item, cls, f.name)
        for name in cls.MANDATORY:
            if name not in args:
                raise DecodeError(f"{cls.__name__}.{name} is mandatory")
        return cls(**args)

    def to_list(self) -> list[Any]:
        """The fields as typed AMQP values, trailing nulls trimmed."""
        out: list[Any] = []
        for f, kind in zip(fields(self), self.KINDS, strict=True):
            v = getattr(self, f.name)
            if v is None:
                out.append(None)
            elif isinstance(kind, str):
                out.append(_KINDS[kind][1](v))
            else:
                out.append(v.described())
        while out and out[-1] is None:
            out.pop()
        return out

    def described(self) -> Described:
        """This value as a ``Described`` with its numeric descriptor."""
        return Described(Ulong(self.DESCRIPTOR), self.to_list())

    def encode(self) -> bytes:
        """The AMQP encoding of this value."""
        return encode(self.described())


def _composite(kind: Any, item: Any, owner: type, name: str) -> Any:
    if kind is DeliveryState:
        return decode_outcome(item)
    if not isinstance(item, Described) or _descriptor_code(item.descriptor) != kind.DESCRIPTOR:
        if kind is Target and isinstance(item, Described) and _is_coordinator(item):
            return Coordinator.from_described(item)
        raise _fail(owner, name, item)
    return kind.from_described(item)


def _descriptor_code(descriptor: Any) -> int | None:
    if isinstance(descriptor, int) and not isinstance(descriptor, bool):
        return descriptor
    if isinstance(descriptor, str):
        return _BY_NAME.get(descriptor)
    return None


def _is_coordinator(item: Described) -> bool:
    return _descriptor_code(item.descriptor) == Coordinator.DESCRIPTOR


@dataclass
class Error(Composite):
    """An AMQP error. ``info`` always encodes as a map (see the module docstring)."""

    DESCRIPTOR = 0x1D
    NAME = "amqp:error:list"
    KINDS = ("symbol", "str", "map")
    MANDATORY = frozenset({"condition"})
    condition: str = ""
    description: str | None = None
    info: dict[Any, Any] | None = None

    def to_list(self) -> list[Any]:
        """Like every composite, except that ``info`` is never left out."""
        return [Symbol(self.condition), self.description, dict(self.info or {})]


@dataclass
class Source(Composite):
    """A link source (for a sender link the peer opens, an arbitrary name)."""

    DESCRIPTOR = 0x28
    NAME = "amqp:source:list"
    KINDS = ("str", "uint", "symbol", "uint", "bool", "map", "symbol", "map", "any", "symbols",
             "symbols")  # fmt: skip
    address: str | None = None
    durable: int | None = None
    expiry_policy: str | None = None
    timeout: int | None = None
    dynamic: bool | None = None
    dynamic_node_properties: dict[Any, Any] | None = None
    distribution_mode: str | None = None
    filter: dict[Any, Any] | None = None
    default_outcome: Any = None
    outcomes: Any = None
    capabilities: Any = None


@dataclass
class Target(Composite):
    """A link target: for a sender, the entity address it sends to."""

    DESCRIPTOR = 0x29
    NAME = "amqp:target:list"
    KINDS = ("str", "uint", "symbol", "uint", "bool", "map", "symbols")
    address: str | None = None
    durable: int | None = None
    expiry_policy: str | None = None
    timeout: int | None = None
    dynamic: bool | None = None
    dynamic_node_properties: dict[Any, Any] | None = None
    capabilities: Any = None


@dataclass
class Coordinator(Composite):
    """A transaction coordinator target: recognised only to be refused."""

    DESCRIPTOR = 0x30
    NAME = "amqp:coordinator:list"
    KINDS = ("symbols",)
    capabilities: Any = None


class DeliveryState(Composite):
    """The base of delivery states and outcomes."""


@dataclass
class Received(DeliveryState):
    """The received delivery state (never sent by this engine)."""

    DESCRIPTOR = 0x23
    NAME = "amqp:received:list"
    KINDS = ("uint", "ulong")
    section_number: int | None = None
    section_offset: int | None = None


@dataclass
class Accepted(DeliveryState):
    """The accepted outcome."""

    DESCRIPTOR = 0x24
    NAME = "amqp:accepted:list"


@dataclass
class Rejected(DeliveryState):
    """The rejected outcome, with its error (always sent with one)."""

    DESCRIPTOR = 0x25
    NAME = "amqp:rejected:list"
    KINDS = (Error,)
    error: Error | None = None


@dataclass
class Released(DeliveryState):
    """The released outcome."""

    DESCRIPTOR = 0x26
    NAME = "amqp:released:list"


@dataclass
class Modified(DeliveryState):
    """The modified outcome."""

    DESCRIPTOR = 0x27
    NAME = "amqp:modified:list"
    KINDS = ("bool", "bool", "map")
    delivery_failed: bool | None = None
    undeliverable_here: bool | None = None
    message_annotations: dict[Any, Any] | None = None


@dataclass
class TransactionalState(DeliveryState):
    """A transactional state (``amqp:transactional-state``): recognised to be refused."""

    DESCRIPTOR = 0x34
    NAME = "amqp:transactional-state:list"
    KINDS = ("binary", "any")
    txn_id: bytes | None = None
    outcome: Any = None


_STATES: dict[int, type[DeliveryState]] = {
    c.DESCRIPTOR: c for c in (Received, Accepted, Rejected, Released, Modified, TransactionalState)
}


def decode_outcome(value: Any) -> DeliveryState:
    """A decoded ``Described`` delivery state as its dataclass; ``DecodeError`` otherwise."""
    if not isinstance(value, Described):
        raise DecodeError(f"delivery state is not described: {value!r:.60}")
    cls = _STATES.get(_descriptor_code(value.descriptor) or -1)
    if cls is None:
        raise DecodeError(f"unknown delivery state {value.descriptor!r:.60}")
    return cls.from_described(value)


class Performative(Composite):
    """The base of AMQP frame bodies."""


@dataclass
class Open(Performative):
    """open: the connection's parameters."""

    DESCRIPTOR = 0x10
    NAME = "amqp:open:list"
    KINDS = ("str", "str", "uint", "ushort", "uint", "symbols", "symbols", "symbols", "symbols",
             "map")  # fmt: skip
    MANDATORY = frozenset({"container_id"})
    container_id: str = ""
    hostname: str | None = None
    max_frame_size: int | None = None
    channel_max: int | None = None
    idle_time_out: int | None = None
    outgoing_locales: Any = None
    incoming_locales: Any = None
    offered_capabilities: Any = None
    desired_capabilities: Any = None
    properties: dict[Any, Any] | None = None


@dataclass
class Begin(Performative):
    """begin: a session."""

    DESCRIPTOR = 0x11
    NAME = "amqp:begin:list"
    KINDS = ("ushort", "uint", "uint", "uint", "uint", "symbols", "symbols", "map")
    MANDATORY = frozenset({"next_outgoing_id", "incoming_window", "outgoing_window"})
    remote_channel: int | None = None
    next_outgoing_id: int = 0
    incoming_window: int = 0
    outgoing_window: int = 0
    handle_max: int | None = None
    offered_capabilities: Any = None
    desired_capabilities: Any = None
    properties: dict[Any, Any] | None = None


@dataclass
class Attach(Performative):
    """attach: a link. ``role`` False is a sender, True a receiver."""

    DESCRIPTOR = 0x12
    NAME = "amqp:attach:list"
    KINDS = ("str", "uint", "bool", "ubyte", "ubyte", Source, Target, "map", "bool", "uint",
             "ulong", "symbols", "symbols", "map")  # fmt: skip
    MANDATORY = frozenset({"name", "handle", "role"})
    name: str = ""
    handle: int = 0
    role: bool = False
    snd_settle_mode: int | None = None
    rcv_settle_mode: int | None = None
    source: Source | None = None
    target: Target | Coordinator | None = None
    unsettled: dict[Any, Any] | None = None
    incomplete_unsettled: bool | None = None
    initial_delivery_count: int | None = None
    max_message_size: int | None = None
    offered_capabilities: Any = None
    desired_capabilities: Any = None
    properties: dict[Any, Any] | None = None


@dataclass
class Flow(Performative):
    """flow: session windows, and a link's credit when ``handle`` is set."""

    DESCRIPTOR = 0x13
    NAME = "amqp:flow:list"
    KINDS = ("uint", "uint", "uint", "uint", "uint", "uint", "uint", "uint", "bool", "bool",
             "map")  # fmt: skip
    MANDATORY = frozenset({"incoming_window", "next_outgoing_id", "outgoing_window"})
    next_incoming_id: int | None = None
    incoming_window: int = 0
    next_outgoing_id: int = 0
    outgoing_window: int = 0
    handle: int | None = None
    delivery_count: int | None = None
    link_credit: int | None = None
    available: int | None = None
    drain: bool | None = None
    echo: bool | None = None
    properties: dict[Any, Any] | None = None


@dataclass
class Transfer(Performative):
    """transfer: one frame of a delivery (the payload follows the performative)."""

    DESCRIPTOR = 0x14
    NAME = "amqp:transfer:list"
    KINDS = ("uint", "uint", "binary", "uint", "bool", "bool", "ubyte", DeliveryState, "bool",
             "bool", "bool")  # fmt: skip
    MANDATORY = frozenset({"handle"})
    handle: int = 0
    delivery_id: int | None = None
    delivery_tag: bytes | None = None
    message_format: int | None = None
    settled: bool | None = None
    more: bool | None = None
    rcv_settle_mode: int | None = None
    state: DeliveryState | None = None
    resume: bool | None = None
    aborted: bool | None = None
    batchable: bool | None = None

    @classmethod
    def from_described(cls: type[T], value: Any) -> T:
        """The hot path: a transfer as SDK senders send it (uint handle, delivery id and
        format, binary tag, booleans, then nulls: the Python SDK sends all eleven fields) is
        taken without the generic checks; anything else goes through them."""
        items = value.value if isinstance(value, Described) else value
        if (
            type(items) is list
            and 4 <= len(items) <= 11
            and type(items[0]) is Uint
            and type(items[1]) is Uint
            and type(items[2]) is bytes
            and type(items[3]) is Uint
            and all(v is None or v is True or v is False for v in items[4:6])
            and all(v is None for v in items[6:])
        ):
            return cls(*items[:6])
        return super().from_described.__func__(cls, value)  # type: ignore[attr-defined, no-any-return]


@dataclass
class Disposition(Performative):
    """disposition: the state of deliveries ``first``..``last``."""

    DESCRIPTOR = 0x15
    NAME = "amqp:disposition:list"
    KINDS = ("bool", "uint", "uint", "bool", DeliveryState, "bool")
    MANDATORY = frozenset({"role", "first"})
    role: bool = True
    first: int = 0
    last: int | None = None
    settled: bool | None = None
    state: DeliveryState | None = None
    batchable: bool | None = None


@dataclass
class Detach(Performative):
    """detach: a link ends (``closed``) or is suspended."""

    DESCRIPTOR = 0x16
    NAME = "amqp:detach:list"
    KINDS = ("uint", "bool", Error)
    MANDATORY = frozenset({"handle"})
    handle: int = 0
    closed: bool | None = None
    error: Error | None = None


@dataclass
class End(Performative):
    """end: a session ends."""

    DESCRIPTOR = 0x17
    NAME = "amqp:end:list"
    KINDS = (Error,)
    error: Error | None = None


@dataclass
class Close(Performative):
    """close: the connection ends."""

    DESCRIPTOR = 0x18
    NAME = "amqp:close:list"
    KINDS = (Error,)
    error: Error | None = None


@dataclass
class SaslMechanisms(Performative):
    """sasl-mechanisms: what the server offers."""

    DESCRIPTOR = 0x40
    NAME = "amqp:sasl-mechanisms:list"
    KINDS = ("symbols",)
    MANDATORY = frozenset({"sasl_server_mechanisms"})
    sasl_server_mechanisms: Any = field(default_factory=list)


@dataclass
class SaslInit(Performative):
    """sasl-init: the mechanism the client chose."""

    DESCRIPTOR = 0x41
    NAME = "amqp:sasl-init:list"
    KINDS = ("symbol", "binary", "str")
    MANDATORY = frozenset({"mechanism"})
    mechanism: str = ""
    initial_response: bytes | None = None
    hostname: str | None = None


@dataclass
class SaslChallenge(Performative):
    """sasl-challenge (never sent: the mechanisms offered need none)."""

    DESCRIPTOR = 0x42
    NAME = "amqp:sasl-challenge:list"
    KINDS = ("binary",)
    challenge: bytes = b""


@dataclass
class SaslResponse(Performative):
    """sasl-response (refused: no challenge is ever sent)."""

    DESCRIPTOR = 0x43
    NAME = "amqp:sasl-response:list"
    KINDS = ("binary",)
    response: bytes = b""


@dataclass
class SaslOutcome(Performative):
    """sasl-outcome: 0 ok, 1 auth, 2 sys, 3 sys-perm, 4 sys-temp."""

    DESCRIPTOR = 0x44
    NAME = "amqp:sasl-outcome:list"
    KINDS = ("ubyte", "binary")
    MANDATORY = frozenset({"code"})
    code: int = 0
    additional_data: bytes | None = None


PERFORMATIVES: dict[int, type[Performative]] = {
    c.DESCRIPTOR: c for c in (Open, Begin, Attach, Flow, Transfer, Disposition, Detach, End, Close)
}
SASL_FRAMES: dict[int, type[Performative]] = {
    c.DESCRIPTOR: c for c in (SaslMechanisms, SaslInit, SaslChallenge, SaslResponse, SaslOutcome)
}

# Descriptors may also be sent as symbols ("amqp:open:list"): the same types by name.
_NAMED: tuple[type[Composite], ...] = (
    *PERFORMATIVES.values(),
    *SASL_FRAMES.values(),
    *_STATES.values(),
    Error,
    Source,
    Target,
    Coordinator,
)
_BY_NAME: dict[str, int] = {c.NAME: c.DESCRIPTOR for c in _NAMED}


def descriptor_code(descriptor: Any) -> int | None:
    """The numeric descriptor for a ``Ulong`` or a symbolic one; None if unknown."""
    return _descriptor_code(descriptor)
