"""`OutboundMessage.size` is an upper bound of the encoding, not an estimate (issue 33).

The edge refuses a message over `max_message_bytes` and the dispatcher fills a broker batch
up to `max_batch_bytes` by `size` alone, so a size below the encoding let a message through
that the link then refused — after the batch built so far had been stored. Here the bound is
held to the SDK's own encoder (`gateway.servicebus.internals.encoding`, byte for byte the
SDK's path: tests/gateway/test_sdk_mapping.py) over generated messages: long names and
values (str32), many properties, every value type, TTLs, schedules, partition keys, and
whole batches.
"""

from __future__ import annotations

import datetime as dt

import pytest
from azure.servicebus import ServiceBusMessageBatch
from azure.servicebus._pyamqp._encode import encode_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.message import (
    BATCH_ITEM_OVERHEAD,
    INTEGER_RANGES,
    OutboundMessage,
    Typed,
    batch_size,
)
from gateway.servicebus.internals import encoding

pytestmark = pytest.mark.unit

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=300)
_ID = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=128)
_VALUES = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.datetimes(
        min_value=dt.datetime(1970, 1, 2),
        max_value=dt.datetime(9000, 1, 1),
        timezones=st.just(dt.UTC),
    ),
    _TEXT,
    st.binary(max_size=300).map(lambda b: b.hex().encode()),  # bytes go as their UTF-8 text
    # what the AMQP edge carries with its own type (gateway.amqp.messages)
    st.sampled_from(sorted(INTEGER_RANGES)).flatmap(
        lambda kind: st.integers(INTEGER_RANGES[kind].start, INTEGER_RANGES[kind].stop - 1).map(
            lambda v: Typed(kind, v)
        )  # type: ignore[arg-type]
    ),
    st.floats(width=32, allow_nan=False).map(lambda v: Typed("float", v)),
    st.uuids().map(lambda v: Typed("uuid", v)),
    st.binary(max_size=300).map(lambda v: Typed("binary", v)),
)


@st.composite
def messages(draw: st.DrawFn) -> OutboundMessage:
    session = draw(st.none() | _ID)
    return OutboundMessage(
        body=draw(st.binary(max_size=2000)),
        message_id=draw(_ID),
        content_type=draw(st.none() | st.text(st.characters(max_codepoint=127), max_size=200)),
        correlation_id=draw(st.none() | _ID),
        session_id=session,
        subject=draw(st.none() | _TEXT),
        reply_to=draw(st.none() | _TEXT),
        reply_to_session_id=draw(st.none() | _ID),
        to=draw(st.none() | _TEXT),
        time_to_live=draw(
            st.none()
            | st.timedeltas(min_value=dt.timedelta(milliseconds=1), max_value=dt.timedelta(days=40))
        ),
        scheduled_enqueue_time_utc=draw(
            st.none()
            | st.datetimes(
                min_value=dt.datetime(2000, 1, 1),
                max_value=dt.datetime(3000, 1, 1),
                timezones=st.just(dt.UTC),
            )
        ),
        partition_key=draw(st.none() | st.just(session)) if session else None,
        application_properties=draw(st.dictionaries(_TEXT, _VALUES, max_size=30)),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_one_message_never_encodes_larger_than_its_size(m: OutboundMessage) -> None:
    assert len(encoding.encode(m)) + BATCH_ITEM_OVERHEAD <= m.size


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages(), min_size=2, max_size=6))
def test_a_batch_never_encodes_larger_than_its_batch_size(batch: list[OutboundMessage]) -> None:
    """The batch as the SDK puts it on the wire: its envelope (the first message's ids) and
    every message in a data section."""
    sdk_batch = ServiceBusMessageBatch(max_size_in_bytes=2**30)
    for m in batch:
        encoding.add(sdk_batch, m, encoding.encode(m))
    wire = bytearray()
    encode_payload(wire, sdk_batch._message)
    assert len(wire) <= batch_size(batch)


def test_long_names_and_values_are_counted_at_their_widest() -> None:
    """The report: 120 properties of 246-character names and 256-character values were
    counted 62,028 bytes and encoded to 62,741 (str32 costs 5 bytes, not 2)."""
    props = {f"{i:03d}" + "n" * 243: "v" * 256 for i in range(120)}
    m = OutboundMessage(body=b"", message_id="m", application_properties=props)
    assert len(encoding.encode(m)) + BATCH_ITEM_OVERHEAD <= m.size
