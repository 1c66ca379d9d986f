"""sbamqp.sections: split keeps every section's bytes, the views keep types, join replaces
some sections and leaves the body and footer alone, batches split by their data sections."""

from __future__ import annotations

import datetime
import uuid

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from hypothesis import given, settings
from hypothesis import strategies as st

from sbamqp import sections
from sbamqp.codec import DecodeError, Double, Int, Long, Symbol, Timestamp, Ulong, decode, encode
from sbamqp.sections import (
    AMQP_SEQUENCE,
    AMQP_VALUE,
    APPLICATION_PROPERTIES,
    DATA,
    FOOTER,
    HEADER,
    MESSAGE_ANNOTATIONS,
    PROPERTIES,
    Header,
    Properties,
    section,
)

pytestmark = pytest.mark.unit

WHEN = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)


def sdk_payload(message: ServiceBusMessage) -> bytes:
    """The bytes the pinned SDK puts on the wire for `message`."""
    amqp = PyamqpTransport.to_outgoing_amqp_message(message.raw_amqp_message)
    return bytes(encode_payload(bytearray(), amqp))


def sdk_message() -> ServiceBusMessage:
    message = ServiceBusMessage(
        b"body",
        message_id="mid",
        correlation_id="cid",
        session_id="s1",
        subject="subj",
        content_type="text/plain",
        reply_to="r",
        to="t",
        time_to_live=datetime.timedelta(seconds=30),
        application_properties={
            "s": "v",
            "i": 5,
            "f": 1.5,
            "b": True,
            "u": uuid.UUID(int=7),
            "d": WHEN,
        },
    )
    message.scheduled_enqueue_time_utc = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    return message


def test_an_sdk_message_splits_into_typed_views_and_joins_back_exactly() -> None:
    raw = sdk_payload(sdk_message())
    parts = sections.split(raw)
    assert parts.to_bytes() == raw
    assert parts.header_view().ttl == 30_000
    props = parts.properties_view()
    assert (props.message_id, props.correlation_id, props.group_id) == ("mid", "cid", "s1")
    assert (props.to, props.subject, props.reply_to) == ("t", "subj", "r")
    assert props.content_type == "text/plain" and type(props.content_type) is Symbol
    assert type(props.creation_time) is Timestamp
    items = parts.application_properties_items()
    typed = {k: (type(v), v) for k, _, v in items}
    assert typed == {
        "s": (str, "v"),
        "i": (Int, 5),
        "f": (Double, 1.5),
        "b": (bool, True),
        "u": (uuid.UUID, uuid.UUID(int=7)),
        "d": (Timestamp, Timestamp.from_datetime(WHEN)),
    }
    assert all(decode(r)[0] == v for _, r, v in items)
    annotations = parts.annotations()
    assert annotations[Symbol("x-opt-scheduled-enqueue-time")].to_datetime().year == 2030
    assert parts.data() == [b"body"] and parts.body_code == DATA


def test_join_replaces_application_properties_and_keeps_body_and_footer_bytes() -> None:
    footer = section(FOOTER, {Symbol("f"): "x"})
    raw = sdk_payload(sdk_message()) + footer
    parts = sections.split(raw)
    items = parts.application_properties_items()
    extra = ("x-ms-target", encode("orders"), "orders")
    joined = sections.join(
        parts, application_properties=sections.encode_application_properties([*items, extra])
    )
    again = sections.split(joined)
    assert again.body == parts.body and again.footer == footer
    assert again.properties == parts.properties and again.header == parts.header
    assert again.application_properties_items() == [*items, extra]
    # Unchanged items re-encode to the very bytes the SDK sent.
    same = sections.encode_application_properties(items)
    assert same == parts.application_properties
    dropped = sections.split(sections.join(parts, message_annotations=None))
    assert dropped.message_annotations is None and dropped.body == parts.body
    with pytest.raises(ValueError):
        sections.join(parts, body=b"")  # type: ignore[arg-type]


def test_properties_keep_id_types() -> None:
    for message_id in (uuid.UUID(int=1), Ulong(7), b"\x01\x02", "text"):
        props = Properties(message_id=message_id, correlation_id=message_id, group_id="g")
        back = sections.split(props.to_section()).properties_view()
        assert back.message_id == message_id and type(back.message_id) is type(message_id)
        assert type(back.correlation_id) is type(message_id)
    plain = sections.split(Properties(message_id=7).to_section()).properties_view()
    assert type(plain.message_id) is Ulong  # an id is never an AMQP int
    header = Header(durable=True, priority=9, ttl=5)
    assert sections.split(header.to_section()).header_view() == header


def _batch(*messages: bytes, envelope: bytes = b"") -> bytes:
    return envelope + b"".join(section(DATA, m) for m in messages)


def test_split_batch_takes_each_data_section_as_a_message() -> None:
    one = sdk_payload(ServiceBusMessage(b"one"))
    two = sdk_payload(ServiceBusMessage("two", application_properties={"k": Long(1)}))
    assert sections.split_batch(_batch(one, two)) == [one, two]
    # Node puts a header, empty annotations and properties on the batch itself.
    envelope = (
        section(HEADER, [True])
        + section(MESSAGE_ANNOTATIONS, {})
        + Properties(message_id="batch").to_section()
    )
    assert sections.split_batch(_batch(one, two, envelope=envelope)) == [one, two]


@pytest.mark.parametrize(
    "payload",
    [
        section(AMQP_VALUE, "x"),  # not data
        b"",  # no messages
        section(DATA, b"\xff"),  # a message that is not one
        section(DATA, b"\x00\x53\x75\xa0\x05ab"),  # a truncated inner message
    ],
    ids=["value body", "empty", "garbage inside", "truncated inside"],
)
def test_a_malformed_batch_raises(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        sections.split_batch(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x40",  # not a section
        section(PROPERTIES, []) + section(HEADER, []),  # out of order
        section(HEADER, []) + section(HEADER, []),  # twice
        section(DATA, b"a") + section(AMQP_VALUE, 1),  # a mixed body
        section(AMQP_VALUE, 1) + section(AMQP_VALUE, 2),  # two value sections
        section(FOOTER, {}) + section(DATA, b"a"),  # after the footer
        b"\x00\x53\x99\x40",  # an unknown section
        section(DATA, b"abc")[:-1],  # truncated
        b"\x00\xa3\x05amqp:",  # a truncated symbolic descriptor
    ],
)
def test_a_malformed_message_raises(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        sections.split(payload)


@pytest.mark.parametrize(
    "app",
    [
        {Symbol("k"): "v"},  # a symbol key
        {"k": [1]},  # a list value
        {"k": {"a": 1}},  # a map value
        {Int(1): "v"},  # a non-string key
    ],
    ids=repr,
)
def test_application_properties_must_be_simple(app: dict[object, object]) -> None:
    parts = sections.split(section(APPLICATION_PROPERTIES, app) + section(DATA, b""))
    with pytest.raises(DecodeError):
        parts.application_properties_items()


def test_symbolic_descriptors_and_other_bodies() -> None:
    symbolic = b"\x00" + encode(Symbol("amqp:data:binary")) + encode(b"abc")
    assert sections.split(symbolic).data() == [b"abc"]
    seq = section(AMQP_SEQUENCE, [1]) + section(AMQP_SEQUENCE, [2])
    parts = sections.split(seq)
    assert parts.body_code == AMQP_SEQUENCE and len(parts.body) == 2
    with pytest.raises(DecodeError):
        parts.data()
    assert sections.value_of(sections.split(section(AMQP_VALUE, "v"))) == "v"


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=80))
def test_random_bytes_split_or_raise_decode_error(raw: bytes) -> None:
    try:
        parts = sections.split(raw)
    except DecodeError:
        return
    assert parts.to_bytes() == raw
    for view in (
        parts.header_view,
        parts.properties_view,
        parts.annotations,
        parts.application_properties_items,
    ):
        try:
            view()
        except DecodeError:
            pass


_app_values = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.integers(-(2**31), 2**31 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    st.uuids(),
    st.datetimes(
        min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2200, 1, 1)
    ).map(lambda d: d.replace(tzinfo=datetime.UTC)),
)


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=200),
    st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: not k.startswith("x-sb")),
                    _app_values, max_size=6),
    st.one_of(st.none(), st.text(min_size=1, max_size=20)),
)  # fmt: skip
def test_a_rewrite_then_a_restore_gives_the_message_back(
    body: bytes, app: dict[str, object], session_id: str | None
) -> None:
    """What the backlog does to a message (hints added as application properties and
    annotations) and what the syphon undoes leave the client's bytes as they were."""
    raw = sdk_payload(ServiceBusMessage(body, session_id=session_id, application_properties=app))
    parts = sections.split(raw)
    hints = {"x-sb-target": "orders", "x-sb-ttl": Long(5)}
    rewritten = sections.update_annotations(
        sections.update_application_properties(parts, hints), {"x-sb-marker": True}
    )
    moved = sections.split(rewritten.to_bytes())  # through a backlog queue, as bytes
    assert moved.body == parts.body and moved.properties == parts.properties
    typed = {k: v for k, _, v in moved.application_properties_items()}
    assert typed["x-sb-target"] == "orders" and type(typed["x-sb-ttl"]) is Long
    restored = sections.update_annotations(
        sections.update_application_properties(moved, {}, remove=hints), {}, ["x-sb-marker"]
    )
    assert restored.application_properties == parts.application_properties
    assert restored.header == parts.header and restored.body == parts.body
    assert restored.annotations() == parts.annotations()
    if parts.message_annotations is None:
        assert restored.to_bytes() == raw


def test_update_application_properties_replaces_in_place() -> None:
    parts = sections.split(sdk_payload(ServiceBusMessage(b"x", application_properties={
        "a": "1", "b": 2, "c": True})))  # fmt: skip
    updated = sections.update_application_properties(parts, {"b": Long(3)}, remove=["c"])
    assert [(k, type(v)) for k, _, v in updated.application_properties_items()] == [
        ("a", str),
        ("b", Long),
    ]
    emptied = sections.update_application_properties(parts, {}, remove=["a", "b", "c"])
    assert emptied.application_properties is None
