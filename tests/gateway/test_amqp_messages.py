"""What the AMQP edge carries, and what it refuses (gateway.amqp.messages).

The property: a client's message that the edge accepts arrives at the primary with the same
content — body, ids, properties, application property values *and their AMQP types* —
whether it is sent directly (the gateway's own encoding) or through a backlog queue (the
rewrite, the SDK's decoding on the syphon's receive, the restore, the encoding home). A
message the path cannot carry unchanged is refused, never altered.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiveMode
from azure.servicebus._pyamqp._decode import decode_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.amqp.messages import MalformedMessage, batch_messages, to_outbound
from gateway.core.backlog import restore, rewrite
from gateway.core.message import OutboundMessage
from gateway.errors import NotCarried
from gateway.servicebus.internals.encoding import encode
from gateway.servicebus.receiver import from_sdk
from sbamqp import codec
from sbamqp.codec import (
    Byte,
    Char,
    Decimal64,
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
)
from sbamqp.sections import section

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def message(
    body: bytes = b"x",
    *,
    header: list[Any] | None = None,
    annotations: dict[Any, Any] | None = None,
    properties: list[Any] | None = None,
    app: dict[Any, Any] | None = None,
    extra: list[bytes] = (),  # type: ignore[assignment]
) -> bytes:
    """A client's encoded message, section by section."""
    parts = []
    if header is not None:
        parts.append(section(0x70, header))
    if annotations is not None:
        parts.append(section(0x72, annotations))
    if properties is not None:
        parts.append(section(0x73, properties))
    if app is not None:
        parts.append(section(0x74, app))
    parts.append(section(0x75, body))
    parts.extend(extra)
    return b"".join(parts)


def sections_of(payload: bytes) -> dict[int, Any]:
    return {v.descriptor: v.value for v in codec.decode_all(payload)}


def through_backlog(m: OutboundMessage) -> OutboundMessage:
    """The backlog route: rewritten, encoded, received by the SDK, restored."""
    stored = bytes(encode(rewrite(m, "orders", NOW)))
    received = ServiceBusReceivedMessage(
        decode_payload(memoryview(stored)),
        receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE,
        receiver=None,
    )
    restored = restore(from_sdk(received), NOW + 1)
    assert restored is not None and restored.entity_path == "orders"
    return restored.message


def content(payload: bytes) -> dict[str, Any]:
    """What must arrive unchanged: every section but the stamps the SDKs make from the TTL
    (creation and absolute expiry time), each value with its AMQP type."""
    s = sections_of(payload)
    props = list(s.get(0x73) or []) + [None] * 13
    props[8] = props[9] = None  # absolute-expiry-time, creation-time
    header = list(s.get(0x70) or []) + [None] * 5
    app = s.get(0x74) or {}
    return {
        "ttl": header[2],
        "properties": [(type(v), v) for v in props[:13]],
        "annotations": {k: (type(v), v) for k, v in (s.get(0x72) or {}).items()},
        "app": {k: (type(v), v) for k, v in app.items()},
        "body": s.get(0x75),
    }


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
_id = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
_carried = st.one_of(
    _text,
    st.booleans(),
    st.integers(-(2**31), 2**31 - 1).map(Int),
    st.floats(allow_nan=False).map(Double),
    st.floats(allow_nan=False, width=32).map(Float),
    st.integers(-(2**63), 2**63 - 1).map(Long),
    st.integers(0, 2**8 - 1).map(Ubyte),
    st.integers(0, 2**16 - 1).map(Ushort),
    st.integers(0, 2**32 - 1).map(Uint),
    st.integers(0, 2**64 - 1).map(Ulong),
    st.integers(-(2**7), 2**7 - 1).map(Byte),
    st.integers(-(2**15), 2**15 - 1).map(Short),
    st.integers(-(2**62), 2**62).map(Timestamp),
    st.uuids(),
    st.binary(max_size=30),
)
_names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=10)


@st.composite
def client_messages(draw: st.DrawFn) -> bytes:
    session = draw(st.none() | _id)
    ttl = draw(st.none() | st.integers(1000, 10 * 86400 * 1000))
    # a schedule still to come (one that passed goes home unscheduled: restore)
    schedule = draw(st.none() | st.integers(1_800_000_100_000, 1_900_000_000_000))
    properties = [
        draw(_id),  # message-id
        None,
        draw(st.none() | _text),  # to
        draw(st.none() | _text),  # subject
        draw(st.none() | _text),  # reply-to
        draw(st.none() | _id),  # correlation-id
        draw(st.none() | st.sampled_from(["text/plain", "application/json"]).map(Symbol)),
        None,
        None,
        None,
        session,  # group-id
        None,
        draw(st.none() | _id),  # reply-to-group-id
    ]
    annotations: dict[Any, Any] = {}
    if schedule is not None:
        annotations[Symbol("x-opt-scheduled-enqueue-time")] = Timestamp(schedule)
    if session is not None and draw(st.booleans()):
        annotations[Symbol("x-opt-partition-key")] = session
    app = draw(st.dictionaries(_names, _carried, max_size=6))
    return message(
        draw(st.binary(max_size=200)),
        header=None if ttl is None else [None, None, ttl],
        annotations=annotations or None,
        properties=properties,
        app=app or None,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(client_messages())
def test_an_accepted_message_arrives_unchanged_directly_and_through_a_backlog_queue(
    payload: bytes,
) -> None:
    m = to_outbound(payload)
    want = content(payload)
    assert content(bytes(encode(m))) == want, "sent to the primary"
    home = through_backlog(m)
    got = content(bytes(encode(home)))
    # Service Bus counts a TTL from enqueue: the syphon sends the *remaining* TTL home,
    # and a schedule still to come keeps the whole TTL (gateway.core.backlog.restore).
    got_ttl, want_ttl = got.pop("ttl"), want.pop("ttl")
    assert (got_ttl is None) == (want_ttl is None)
    if want_ttl is not None:
        assert want_ttl - 2000 <= got_ttl <= want_ttl
    assert got == want, "through a backlog queue and the syphon"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (Symbol("s"), "Symbol"),
        (Char("c"), "Char"),
        (Decimal64(bytes(8)), "Decimal64"),
        (None, "NoneType"),
        (Described(Symbol("com.microsoft:datetime-offset"), Long(1)), "Described"),
    ],
)
def test_an_application_property_the_path_would_change_is_refused(value: Any, why: str) -> None:
    with pytest.raises(NotCarried, match=why):
        to_outbound(message(app={"p": value}))


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (message(properties=[Ulong(7)]), "message-id must be a string"),
        (message(properties=[None, None, None, None, None, b"c"]), "correlation-id"),
        (message(properties=[None, b"user"]), "user-id"),
        (message(annotations={Symbol("x-opt-other"): 1}), "annotation"),
        (message(header=[None, Ubyte(9)]), "priority"),
        (message(app={"x-ms-path": "elsewhere"}), "reserved"),
        (message(extra=[section(0x75, b"second")]), "several data sections"),
        (section(0x77, "a string body"), "amqp-value"),
        (message(extra=[section(0x78, {})]), "footer"),
    ],
)
def test_what_cannot_be_carried_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(NotCarried, match=why):
        to_outbound(payload)


def test_a_payload_that_is_not_a_message_is_malformed() -> None:
    with pytest.raises(MalformedMessage):
        to_outbound(b"\x00\x53\x75\xa0\xff")
    with pytest.raises(MalformedMessage):
        batch_messages(b"garbage")


def test_hop_by_hop_parts_are_not_content() -> None:
    m = to_outbound(
        section(0x70, [True, Ubyte(4), None, False, 0])  # durable, default priority
        + section(0x71, {Symbol("x-opt-lock-token"): 1})
        + section(
            0x73, ["id", None, None, None, None, None, None, None, Timestamp(1), Timestamp(2)]
        )
        + section(0x75, b"b")
    )
    assert m == OutboundMessage(body=b"b", message_id="id")


def test_a_message_without_an_id_gets_one() -> None:
    assert len(to_outbound(message()).message_id) == 32


def test_a_batch_is_its_data_sections() -> None:
    one, two = message(b"1"), message(b"2")
    envelope = section(0x70, [True]) + section(0x75, one) + section(0x75, two)
    assert batch_messages(envelope) == [one, two]
    assert [to_outbound(p).body for p in batch_messages(envelope)] == [b"1", b"2"]


def test_the_ttl_and_schedule_are_read() -> None:
    m = to_outbound(
        message(
            header=[None, None, 1500],
            annotations={Symbol("x-opt-scheduled-enqueue-time"): Timestamp(1_800_000_000_000)},
        )
    )
    assert m.time_to_live == dt.timedelta(milliseconds=1500)
    assert m.scheduled_enqueue_time_utc == dt.datetime.fromtimestamp(1_800_000_000, dt.UTC)


def test_symbolic_descriptors_read_as_the_sdks_numeric_ones() -> None:
    """The SDKs' encoding (numeric descriptors) takes a fast path; any other is decoded
    generically, with the same result."""
    fields: dict[str, Any] = {
        "header": [None, None, 1500],
        "annotations": {Symbol("x-opt-partition-key"): "p"},
        "properties": ["id", None, None, "subject"],
        "app": {"n": Long(5), "s": "text"},
    }
    numeric = message(b"body", **fields)
    names = {
        0x70: "amqp:header:list",
        0x72: "amqp:message-annotations:map",
        0x73: "amqp:properties:list",
        0x74: "amqp:application-properties:map",
        0x75: "amqp:data:binary",
    }
    symbolic = b"".join(
        codec.encode(Described(Symbol(names[int(v.descriptor)]), v.value))
        for v in codec.decode_all(numeric)
    )
    assert to_outbound(symbolic) == to_outbound(numeric)
    assert to_outbound(numeric).body == b"body"


def test_a_data_section_longer_than_the_message_is_malformed() -> None:
    whole = message(b"x" * 300)
    with pytest.raises(MalformedMessage):
        to_outbound(whole[:-1])
