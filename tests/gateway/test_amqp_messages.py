"""What the AMQP edge carries, and what it refuses (gateway.amqp.messages).

The property: a client's message that the edge accepts arrives at the primary with the same
content — body, ids, properties, application property values *and their AMQP types* —
whether it is sent directly (the gateway's own encoding) or through a backlog queue (the
rewrite, the SDK's decoding on the syphon's receive, the restore, the encoding home). A
message the path cannot carry unchanged is refused, never altered.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import replace
from typing import Any

import pytest
from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusMessageBatch,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
)
from azure.servicebus._pyamqp import _encode
from azure.servicebus._pyamqp._decode import decode_payload
from azure.servicebus._pyamqp.message import BatchMessage
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.amqp.messages import MalformedMessage, batch_messages, to_outbound
from gateway.core.backlog import restore, rewrite
from gateway.core.message import OutboundMessage
from gateway.errors import NotCarried, RequestError
from gateway.servicebus.internals.encoding import add, encode
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
from tests.sbamqp.test_codec import scalars as codec_scalars
from tests.sbamqp.test_codec import values as codec_values

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


def sdk_bytes(m: ServiceBusMessage) -> bytes:
    """The Python SDK's own encoding of `m` (what its sender puts in a transfer)."""
    outgoing = PyamqpTransport.to_outgoing_amqp_message(m.raw_amqp_message)
    return bytes(_encode.encode_payload(bytearray(), outgoing))


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
def client_messages(draw: st.DrawFn, ttl_type: Any = int) -> bytes:
    """A client's message; its TTL encoded as `ttl_type` (a uint as the standard and the
    SDKs have it, or whatever integer a client sends)."""
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
        header=None if ttl is None else [None, None, ttl_type(ttl)],
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


@pytest.mark.parametrize(
    ("ttl", "want"),
    [
        (Uint(0), dt.timedelta(milliseconds=1)),  # the broker's unit, never a falsy "none"
        (Long(0), dt.timedelta(milliseconds=1)),
        (Uint(2**32 - 1), dt.timedelta(milliseconds=2**32 - 1)),
        (Long(2**32), None),  # beyond a uint: sent as none (the entity's default applies)
        (Ulong(2**64 - 1), None),  # was an OverflowError out of timedelta
    ],
)
def test_a_header_ttl_is_read_within_the_uint_the_standard_gives_it(
    ttl: Any, want: dt.timedelta | None
) -> None:
    """Whatever integer type a client encodes its TTL in, the message carries what the wire
    sends for it: at least a millisecond, and none beyond a uint."""
    m = to_outbound(message(header=[None, None, ttl]))
    assert m.time_to_live == want
    assert content(bytes(encode(m)))["ttl"] == (None if want is None else max(ttl, 1))


def test_a_negative_header_ttl_is_malformed() -> None:
    """A negative TTL is not a TTL: the message is refused, never carried as one that a
    backlog could not restore."""
    with pytest.raises(MalformedMessage, match="ttl"):
        to_outbound(message(header=[None, None, Long(-5)]))


@pytest.mark.parametrize("stamp", [2**62, -(2**62)])
def test_a_scheduled_time_beyond_the_calendar_is_malformed(stamp: int) -> None:
    """The client's timestamp, not a bug: refused as its message's own error (it escaped as
    a DecodeError, answered as the gateway's internal error)."""
    with pytest.raises(MalformedMessage, match="scheduled"):
        to_outbound(message(annotations={Symbol("x-opt-scheduled-enqueue-time"): Timestamp(stamp)}))


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


# -- raw passthrough: the client's bytes, sent on as they are -------------------------------


def reencoded(m: OutboundMessage) -> bytes:
    """What the sink sends for `m` without its client's bytes: encoded from the fields."""
    return bytes(encode(replace(m, encoded=None)))


@st.composite
def hop_by_hop_parts(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A client message with hop-by-hop parts (delivery annotations, a header saying more
    than the TTL) and the same message without them, as passthrough should send it."""
    payload = draw(client_messages(Uint))
    parts = list(codec.decode_all(payload))
    header = next((v for v in parts if v.descriptor == 0x70), None)
    ttl = header.value[2] if header is not None else None
    wire = [section(0x70, [True, Ubyte(4), Uint(ttl), False, Uint(3)])] if ttl else []
    wire.append(section(0x71, {Symbol("x-opt-lock-token"): draw(st.uuids())}))
    wire += [codec.encode(v) for v in parts if v.descriptor != 0x70]
    want = ([section(0x70, [None, None, Uint(ttl)])] if ttl else []) + [
        codec.encode(v) for v in parts if v.descriptor != 0x70
    ]
    return b"".join(wire), b"".join(want)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(client_messages(Uint))
def test_a_message_as_the_sdks_encode_it_is_sent_on_in_its_own_bytes(payload: bytes) -> None:
    """Every application-property type, ids, TTL, schedule, partition key: the primary is
    sent the client's bytes, which hold what the fields hold; the size bound covers them."""
    m = to_outbound(payload)
    assert m.encoded == payload
    assert bytes(encode(m)) == payload
    assert content(payload) == content(reencoded(m))
    assert m.size >= len(payload) + 8


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(client_messages())
def test_a_ttl_of_another_integer_type_is_sent_on_as_a_uint(payload: bytes) -> None:
    m = to_outbound(payload)
    assert m.encoded is not None
    assert content(m.encoded) == content(reencoded(m)) == content(payload)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hop_by_hop_parts())
def test_hop_by_hop_parts_are_cut_from_the_passed_through_bytes(parts: tuple[bytes, bytes]) -> None:
    wire, want = parts
    m = to_outbound(wire)
    assert m.encoded == want
    assert content(bytes(encode(m))) == content(reencoded(m)) == content(want)


def test_the_sdks_own_encoding_passes_through_byte_for_byte() -> None:
    """The Python SDK's encoding of a message with every property type it sends (no TTL:
    no clock stamp) is exactly what the gateway would encode: passthrough changes nothing
    on the wire, it only saves the work."""
    sdk = ServiceBusMessage(
        b"body",
        message_id="m-1",
        session_id="s-1",
        partition_key="s-1",
        correlation_id="c",
        subject="sub",
        content_type="application/json",
        reply_to="r",
        to="t",
        scheduled_enqueue_time_utc=dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        application_properties={
            "s": "text",
            "i": 7,
            "f": 0.25,
            "b": True,
            "d": dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
            "u": uuid.UUID(int=5),
        },
    )
    payload = sdk_bytes(sdk)
    m = to_outbound(payload)
    assert m.encoded == payload == reencoded(m)


def test_a_batch_passes_each_message_through() -> None:
    """A `ServiceBusMessageBatch` as the SDK sends it: each message keeps its bytes, and the
    gateway's own batch of them holds exactly those bytes."""
    batch = ServiceBusMessageBatch(max_size_in_bytes=1024 * 1024)
    sent = [
        ServiceBusMessage(f"b-{i}", message_id=f"b-{i}", application_properties={"n": i})
        for i in range(5)
    ]
    for s in sent:
        batch.add_message(s)
    envelope = bytes(_encode.encode_payload(bytearray(), BatchMessage(*batch._message)))
    inner = batch_messages(envelope)
    messages = [to_outbound(p) for p in inner]
    assert [m.encoded for m in messages] == [sdk_bytes(s) for s in sent] == inner
    ours = ServiceBusMessageBatch(max_size_in_bytes=1024 * 1024)
    for m in messages:
        add(ours, m, encode(m))
    assert list(ours._message[5]) == inner
    assert ours.size_in_bytes == batch.size_in_bytes


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (message(properties=[None, None, None, "subject"]), "no message-id: the gateway adds one"),
        (message(properties=["id", None, None, None, None, None, "text/plain"]), "a str type"),
        (message(properties=["id"], annotations={"x-opt-partition-key": "p"}), "a str key"),
        (message(properties=["id"], header=[None, None, Uint(0)]), "a TTL of 0 (sent as 1 ms)"),
        (message(properties=["id"], header=[None, None, Long(2**40)]), "a TTL beyond a uint"),
        (message(properties=["id"] + [None] * 13), "a properties list over 13 fields"),
        (message(properties=["id", None, None, None, None, None, None, None, "x"]), "a stamp"),
    ],
)
def test_bytes_that_would_not_mean_what_the_fields_say_are_encoded_again(
    payload: bytes, why: str
) -> None:
    m = to_outbound(payload)
    assert m.encoded is None, why
    assert bytes(encode(m)) == reencoded(m)


def test_symbolic_descriptors_are_encoded_again() -> None:
    numeric = message(b"body", properties=["id"])
    symbolic = b"".join(
        codec.encode(Described(Symbol("amqp:data:binary" if v.descriptor == 0x75 else
                                      "amqp:properties:list"), v.value))
        for v in codec.decode_all(numeric)
    )  # fmt: skip
    assert to_outbound(numeric).encoded == numeric
    assert to_outbound(symbolic).encoded is None


@given(client_messages())
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_backlog_rewrite_and_the_restore_drop_the_clients_bytes(payload: bytes) -> None:
    m = to_outbound(payload)
    stored = rewrite(m, "orders", NOW)
    assert stored.encoded is None, "the rewrite changed the fields"
    assert m.encoded is not None
    assert through_backlog(m).encoded is None


def test_a_passed_through_message_is_checked_as_any_other() -> None:
    """The sink's checks (PartitionKey = SessionId, ids of at most 128 characters) run on
    the fields whether or not the bytes are the client's."""
    m = to_outbound(
        message(
            properties=["id", None, None, None, None, None, None, None, None, None, "s-1"],
            annotations={Symbol("x-opt-partition-key"): "other"},
        )
    )
    assert m.encoded is not None
    with pytest.raises(ValueError, match="partition_key"):
        encode(m)
    with pytest.raises(ValueError, match="128"):
        encode(to_outbound(message(properties=["i" * 129])))


@pytest.mark.parametrize(
    "payload",
    [
        section(0x73, ["a"]) + section(0x73, ["b"]) + section(0x75, b"x"),  # repeated
        section(0x74, {"k": "v"}) + section(0x73, ["a"]) + section(0x75, b"x"),  # out of order
        section(0x75, b"x") + section(0x70, [None, None, Uint(5)]),  # a header after the body
    ],
)
def test_sections_repeated_or_out_of_order_are_malformed(payload: bytes) -> None:
    """Which of two properties sections would the fields hold, and which would the bytes
    passed through say? Neither: the standard's order, each section once."""
    with pytest.raises(MalformedMessage, match="out of order"):
        to_outbound(payload)
    symbolic = b"".join(
        codec.encode(Described(Symbol({0x70: "amqp:header:list", 0x73: "amqp:properties:list",
                                       0x74: "amqp:application-properties:map",
                                       0x75: "amqp:data:binary"}[int(v.descriptor)]), v.value))
        for v in codec.decode_all(payload)
    )  # fmt: skip
    with pytest.raises(MalformedMessage, match="out of order"):
        to_outbound(symbolic)


def test_a_batch_of_a_message_that_does_not_decode_is_refused_whole() -> None:
    good = message(b"1", properties=["a"])
    envelope = section(0x75, good) + section(0x75, b"\x00\x53\x75\xa0\xff")
    with pytest.raises(MalformedMessage):
        [to_outbound(p) for p in batch_messages(envelope)]
    big = message(b"x" * 300, properties=["b"])  # a vbin32 data section in the envelope
    assert batch_messages(section(0x75, big) + section(0x75, good)) == [big, good]


# -- hostile values: a client's message is carried whole or refused as its own error --------

# Timestamps at and beyond the calendar's ends (year 1 and 9999), where few integers fall.
_edge_stamps = st.sampled_from([-62135596800001, -62135596800000, 253402300799999, 253402300800000])
_stamps = st.one_of(_edge_stamps, st.integers(-(2**63), 2**63 - 1)).map(Timestamp)
_hostile = st.one_of(_stamps, codec_scalars, codec_values)


@st.composite
def hostile_messages(draw: st.DrawFn) -> bytes:
    """A plain message with one hostile value, wherever the gateway reads one: a header
    field, an annotation the gateway reads (or another), a properties field, an application
    property."""
    value = draw(_hostile)
    where = draw(st.sampled_from(["header", "annotations", "properties", "app"]))
    fields: dict[str, Any] = {"properties": ["id"]}
    if where == "header":
        header: list[Any] = [None] * 5
        header[draw(st.integers(0, 4))] = value
        fields["header"] = header
    elif where == "annotations":
        key = draw(st.sampled_from(["x-opt-partition-key", "x-opt-scheduled-enqueue-time", "x-x"]))
        fields["annotations"] = {Symbol(key): value}
    elif where == "properties":
        props: list[Any] = ["id"] + [None] * 12
        props[draw(st.integers(0, 12))] = value
        fields["properties"] = props
    else:
        fields["app"] = {draw(_names): value}
    return message(draw(st.binary(max_size=20)), **fields)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_messages())
def test_a_hostile_message_is_carried_whole_or_refused_as_its_own_error(payload: bytes) -> None:
    """Any value in any field: the message is refused with a client error (never an
    exception the edge would answer as its own internal error), or it is one that the
    primary can be sent and that a backlog queue gives back."""
    try:
        m = to_outbound(payload)
    except RequestError:
        return
    assert bytes(encode(m))
    home = through_backlog(m)
    assert home.body == m.body and home.message_id == m.message_id
