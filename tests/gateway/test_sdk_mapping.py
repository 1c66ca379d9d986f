"""What the sender sends is what the SDK's own path sends.

* `to_amqp` (single messages) builds the same outgoing AMQP message as the SDK's own
  `ServiceBusMessage` with the same properties, field by field, for every property the REST
  format can carry; and it refuses what `ServiceBusMessage` refuses.
* `encoding.encode` + `encoding.add` (batches, each message encoded once) give the same
  encoded bytes, the same batch size to the byte, the same refusals and the same batch on
  the wire as the SDK's `ServiceBusMessageBatch.add_message`, for hypothesis' messages; and
  a guard fails loudly when the installed SDK is not the pinned one or the internals
  `encoding` relies on changed.

Pure logic against the pinned SDK's own conversion and encoder; test_encoding_broker.py and
the end-to-end property tests in test_integration.py receive what was sent through the
real broker.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

import pytest
from azure.core.settings import settings as azure_settings
from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus._common import constants as sb_constants
from azure.servicebus._pyamqp import _encode
from azure.servicebus._pyamqp.message import BatchMessage, Header, Properties
from azure.servicebus._pyamqp.types import TYPE, FieldDefinition
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.aio import ServiceBusSender
from azure.servicebus.aio._transport._pyamqp_transport_async import PyamqpTransportAsync
from azure.servicebus.exceptions import MessageSizeExceededError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.core.message import OutboundMessage
from gateway.errors import FailureKind, SendFailure
from gateway.servicebus.client import SdkSender, to_amqp
from gateway.servicebus.internals import encoding
from gateway.servicebus.internals.encoding import amqp_value as _amqp_value

AT = dt.datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)

MESSAGES = {
    "minimal": OutboundMessage(body=b"x", message_id="m-1"),
    "empty body": OutboundMessage(body=b"", message_id="m-2"),
    "every system property": OutboundMessage(
        body=b'{"a": 1}',
        message_id="m-3",
        content_type="application/json",
        correlation_id="c-1",
        session_id="s-1",
        subject="label",
        reply_to="replies",
        reply_to_session_id="rs-1",
        to="somewhere",
        time_to_live=dt.timedelta(seconds=90.5),
        scheduled_enqueue_time_utc=AT,
        partition_key="s-1",
    ),
    "partition key alone": OutboundMessage(body=b"p", message_id="m-4", partition_key="pk"),
    "sub-second ttl": OutboundMessage(
        body=b"t", message_id="m-5", time_to_live=dt.timedelta(milliseconds=500)
    ),
    "application properties of every type": OutboundMessage(
        body=b"a",
        message_id="m-6",
        application_properties={
            "s": "text",
            "i": 42,
            "big": 2**40,
            "neg": -(2**35),
            "f": 1.5,
            "b": True,
            "raw": b"bytes",  # the SDK decodes bytes values as UTF-8 on both paths
            "when": AT,
        },
    ),
}


def to_sdk(m: OutboundMessage) -> ServiceBusMessage:
    """The reference: the SDK's `ServiceBusMessage`, every property mapped one to one."""
    props = {k: _amqp_value(v) for k, v in m.application_properties.items()}
    msg = ServiceBusMessage(
        m.body,
        application_properties=props or None,
        session_id=m.session_id,
        message_id=m.message_id,
        scheduled_enqueue_time_utc=m.scheduled_enqueue_time_utc,
        time_to_live=m.time_to_live,
        content_type=m.content_type,
        correlation_id=m.correlation_id,
        subject=m.subject,
        partition_key=m.partition_key,
        to=m.to,
        reply_to=m.reply_to,
        reply_to_session_id=m.reply_to_session_id,
    )
    if m.time_to_live is not None:
        # The setter truncates to whole seconds; the gateway sends milliseconds.
        header = msg.raw_amqp_message.header
        assert header is not None
        header.time_to_live = max(1, round(m.time_to_live.total_seconds() * 1000))
    return msg


# Set from the send time by the SDK itself, on both paths alike.
_TIME_FIELDS = ("creation_time", "absolute_expiry_time")


def outgoing(message: Any) -> dict[str, Any]:
    """The pyamqp message the SDK would encode, as a dict, send-time stamps set aside."""
    raw = message if not hasattr(message, "raw_amqp_message") else message.raw_amqp_message
    out = PyamqpTransport.to_outgoing_amqp_message(raw)._asdict()
    props = out["properties"]
    stamps = {}
    if props is not None:
        stamps = {f: getattr(props, f) for f in _TIME_FIELDS}
        out["properties"] = props._replace(**dict.fromkeys(_TIME_FIELDS))
    out["_has_expiry"] = stamps.get("absolute_expiry_time") is not None
    return out


@pytest.mark.parametrize("name", list(MESSAGES))
def test_to_amqp_sends_what_service_bus_message_sends(name: str) -> None:
    m = MESSAGES[name]
    assert outgoing(to_amqp(m)) == outgoing(to_sdk(m))


def test_the_ttl_is_kept_in_milliseconds() -> None:
    out = outgoing(to_amqp(MESSAGES["sub-second ttl"]))
    assert out["header"].ttl == 500 and out["_has_expiry"]


@pytest.mark.parametrize(
    "fields",
    [
        {"message_id": "m" * 129},
        {"message_id": "m", "session_id": "s" * 129},
        {"message_id": "m", "partition_key": "p" * 129},
        {"message_id": "m", "reply_to_session_id": "r" * 129},
        {"message_id": "m", "session_id": "a", "partition_key": "b"},
    ],
)
def test_to_amqp_refuses_what_service_bus_message_refuses(fields: dict[str, str]) -> None:
    m = OutboundMessage(body=b"x", **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        to_sdk(m)
    with pytest.raises(ValueError):
        to_amqp(m)


# -- the encoded form: each message encoded once (gateway/servicebus/internals/encoding.py) -

T = TypeVar("T")


def same_second(compute: Callable[[], T]) -> T:
    """`compute()` within one wall-clock second: with a TTL, both paths stamp the creation
    time from the clock in whole seconds (retried when a second boundary fell in between)."""
    while True:
        before = int(time.time())
        result = compute()
        if int(time.time()) == before:
            return result


def new_batch(max_size: int | None = None) -> ServiceBusMessageBatch:
    """A batch as `ServiceBusSender.create_message_batch` makes one (the async transport)."""
    return ServiceBusMessageBatch(max_size_in_bytes=max_size, amqp_transport=PyamqpTransportAsync)


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except Exception as exc:  # both paths must refuse alike: compare the exception types
        return "refused", type(exc)


def sdk_encoded(message: Any) -> bytes:
    """The bytes the SDK's `add_message` keeps for `message`."""
    batch = new_batch()
    batch.add_message(message)
    [data] = batch._message[5]
    return bytes(data)


def wire(batch: ServiceBusMessageBatch) -> bytes:
    """The batch as the SDK's send encodes it (`send_messages_async`: `BatchMessage(*_message)`
    handed to the link, which runs `encode_payload` over it)."""
    return bytes(_encode.encode_payload(bytearray(), BatchMessage(*batch._message)))


_ids = st.text(max_size=12) | st.text(min_size=120, max_size=130)
_opt_text = st.none() | st.text(max_size=24)
_when = st.datetimes(
    min_value=dt.datetime(1980, 1, 1), max_value=dt.datetime(2200, 1, 1), timezones=st.just(dt.UTC)
)
_app_value = st.one_of(
    st.text(max_size=24),
    st.integers(min_value=-(2**64), max_value=2**64),  # beyond a long: both refuse
    st.floats(),
    st.booleans(),
    st.binary(max_size=12),  # not always UTF-8: both refuse those
    _when,
)
# Up to 60 days: past 2**32 ms (49.7 days) the AMQP header's uint TTL cannot carry it.
_ttl = st.timedeltas(min_value=dt.timedelta(microseconds=1), max_value=dt.timedelta(days=60))


@st.composite
def outbound(draw: st.DrawFn, valid: bool = False) -> OutboundMessage:
    """Any message the REST format (or a backlog queue) can carry; `valid`: only ones the
    SDK takes."""
    ids = st.text(max_size=24) if valid else _ids
    session = draw(st.none() | ids)
    partition = draw(st.none() | st.just(session) | (st.none() if valid else ids))
    app_value = (
        st.one_of(st.text(max_size=24), st.integers(-(2**63), 2**63 - 1), st.booleans(), _when)
        if valid
        else _app_value
    )
    return OutboundMessage(
        body=draw(st.binary(max_size=400)),  # encoded sizes on both sides of 256
        message_id=draw(ids.filter(bool)),  # never empty: the REST parser makes one up
        content_type=draw(st.none() | st.sampled_from(["application/json", "text/plain"])),
        correlation_id=draw(_opt_text),
        session_id=session,
        subject=draw(_opt_text),
        reply_to=draw(_opt_text),
        reply_to_session_id=draw(st.none() | ids),
        to=draw(_opt_text),
        time_to_live=draw(
            st.none() | (st.timedeltas(dt.timedelta(microseconds=1), dt.timedelta(days=40)))
            if valid
            else st.none() | _ttl
        ),
        scheduled_enqueue_time_utc=draw(st.none() | _when),
        partition_key=partition,
        application_properties=draw(st.dictionaries(st.text(max_size=10), app_value, max_size=6)),
    )


@pytest.mark.parametrize("name", list(MESSAGES))
def test_each_message_encodes_to_the_bytes_the_sdk_keeps(name: str) -> None:
    m = MESSAGES[name]
    ours, sdk = same_second(lambda: (bytes(encoding.encode(m)), sdk_encoded(to_sdk(m))))
    assert ours == sdk


@given(m=outbound())
@example(m=MESSAGES["every system property"])
@example(m=OutboundMessage(body=b"", message_id="m", session_id="", partition_key=""))
@example(m=OutboundMessage(body=b"x", message_id="m", time_to_live=dt.timedelta(days=50)))
@example(  # properties over 255 bytes: a list32
    m=OutboundMessage(body=b"x", message_id="é" * 128, to="t" * 100, correlation_id="c" * 40)
)
@example(m=OutboundMessage(body=b"x", message_id="m", subject=0))  # type: ignore[arg-type]
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_property_encodes_as_the_sdks_add_message_encodes_it(m: OutboundMessage) -> None:
    """Ours, the SDK's `add_message` of `to_amqp(m)` and of the reference `ServiceBusMessage`:
    the same bytes, or all three refuse alike. (An empty PartitionKey is the one difference
    from `ServiceBusMessage`, which sends it as an empty annotation: the gateway, as before,
    sends none.)"""
    ours, via_to_amqp, via_sdk_message = same_second(
        lambda: (
            outcome(lambda: bytes(encoding.encode(m))),
            outcome(lambda: sdk_encoded(to_amqp(m))),
            outcome(lambda: sdk_encoded(to_sdk(m))),
        )
    )
    assert ours == via_to_amqp
    if encoding.ttl_ms(m) is None and m.time_to_live is not None:
        # Beyond AMQP's 32-bit millisecond TTL the SDK's own message cannot be encoded; we
        # send it without a TTL on purpose (encoding.ttl_ms).
        assert ours == outcome(lambda: bytes(encoding.encode(replace(m, time_to_live=None))))
    elif m.partition_key != "":
        assert ours == via_sdk_message


def _add_ours(batch: ServiceBusMessageBatch, m: OutboundMessage) -> None:
    encoding.add(batch, m, encoding.encode(m))


def _add_sdk(batch: ServiceBusMessageBatch, m: OutboundMessage) -> None:
    batch.add_message(to_amqp(m))


@given(
    ms=st.lists(outbound(valid=True), min_size=1, max_size=8),
    room=st.integers(min_value=0, max_value=3000),
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_batch_takes_refuses_and_sends_what_the_sdks_batch_does(
    ms: list[OutboundMessage], room: int
) -> None:
    """Message by message: the same acceptance, the same `size_in_bytes` and count, and in
    the end the same batch on the wire (the envelope set from the first message)."""
    limit = new_batch().size_in_bytes + room

    def run() -> tuple[list[Any], list[Any], bytes, bytes]:
        ours, sdk = new_batch(limit), new_batch(limit)
        steps_ours, steps_sdk = [], []
        for m in ms:
            steps_ours.append((outcome(_add_ours, ours, m), ours.size_in_bytes, len(ours)))
            steps_sdk.append((outcome(_add_sdk, sdk, m), sdk.size_in_bytes, len(sdk)))
        return steps_ours, steps_sdk, wire(ours), wire(sdk)

    steps_ours, steps_sdk, wire_ours, wire_sdk = same_second(run)
    assert steps_ours == steps_sdk
    assert wire_ours == wire_sdk


@pytest.mark.parametrize("body_size", [0, 100, 200, 213, 214, 215, 216, 300, 5000])
def test_a_message_that_exactly_fills_the_batch_fits_and_one_byte_less_room_refuses(
    body_size: int,
) -> None:
    """At the edge of the 5/8-byte overhead (encoded sizes 255, 256, 257) and away from it."""
    first = OutboundMessage(body=b"f" * 50, message_id="first", session_id="s", partition_key="s")
    m = OutboundMessage(body=b"b" * body_size, message_id="m")
    size = len(encoding.encode(m))
    for before in ([], [first]):  # alone, and after another message
        empty = new_batch()
        for f in before:
            empty.add_message(to_amqp(f))
        need = empty.size_in_bytes + size + (5 if size < 256 else 8)
        for limit, fits in ((need, True), (need - 1, False)):
            ours, sdk = new_batch(limit), new_batch(limit)
            for f in before:
                _add_ours(ours, f)
                sdk.add_message(to_amqp(f))
            got_ours = outcome(_add_ours, ours, m)
            got_sdk = outcome(_add_sdk, sdk, m)
            expected = ("ok", None) if fits else ("refused", MessageSizeExceededError)
            assert got_ours == got_sdk == expected
            assert (
                ours.size_in_bytes
                == sdk.size_in_bytes
                == (need if fits else need - size - (5 if size < 256 else 8))
            )
            assert len(ours) == len(sdk) == len(before) + fits
            assert wire(ours) == wire(sdk)


# -- the sender: one encoding per message, the SDK's own batch sent ------------------------


class RecordingSdkSender:
    """The port `SdkSender` drives (`ServiceBusSender`'s two calls), batches recorded as
    their wire bytes; the link's batch limit is `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent: list[bytes] = []

    async def create_message_batch(self) -> ServiceBusMessageBatch:
        return new_batch(self.limit)

    async def send_messages(self, batch: ServiceBusMessageBatch) -> None:
        self.sent.append(wire(batch))


def _sdk_sender(limit: int) -> tuple[SdkSender, RecordingSdkSender]:
    port = RecordingSdkSender(limit)
    return SdkSender("primary", "orders", cast(ServiceBusSender, port)), port


async def _both_paths(limit: int, ms: list[OutboundMessage]) -> tuple[Any, Any]:
    """What `SdkSender.send` sends (or raises) on the encode-once path and the SDK's."""

    async def run(via_sdk: bool) -> Any:
        sender, port = _sdk_sender(limit)
        try:
            await (sender._send_via_sdk(ms) if via_sdk else sender.send(ms))
        except SendFailure as failure:
            return failure.kind, port.sent
        return port.sent

    while True:  # both within one second (TTL stamps)
        before = int(time.time())
        got = await run(False), await run(True)
        if int(time.time()) == before:
            return got


async def test_a_send_that_overflows_the_links_batch_sends_nothing() -> None:
    """Issue 33: a call that does not fit the link in one batch used to send the batch built
    so far (stored) and go on with another; a failure after that failed the whole call,
    part of it stored, and the dispatcher's bisection sent the stored part again. Now one
    call is one transfer, all or none: it is refused before anything is sent."""
    ms = [OutboundMessage(body=bytes([i]) * 400, message_id=f"m-{i}") for i in range(5)]
    limit = new_batch().size_in_bytes + 2 * (len(encoding.encode(ms[0])) + 8)  # two per batch
    ours, sdk = await _both_paths(limit, ms)
    assert ours == sdk == (FailureKind.MESSAGE_TOO_LARGE, [])
    ours, sdk = await _both_paths(10 * limit, ms)
    assert len(ours) == 1 and ours == sdk


async def test_a_message_too_large_for_the_link_fails_the_call_before_anything_is_sent() -> None:
    big = OutboundMessage(body=b"x" * 2000, message_id="big")
    small = OutboundMessage(body=b"small", message_id="s")
    for batch in ([big, small], [small, big]):  # first in the batch, or after one that fits
        ours, sdk = await _both_paths(1000, batch)
        assert ours == sdk == (FailureKind.MESSAGE_TOO_LARGE, [])


async def test_an_invalid_message_fails_the_send_before_anything_is_sent() -> None:
    bad = OutboundMessage(body=b"x", message_id="m" * 129)
    ours, sdk = await _both_paths(10_000, [OutboundMessage(body=b"ok", message_id="a"), bad])
    assert ours == sdk == (FailureKind.INVALID_MESSAGE, [])


# -- the guard: the pinned SDK, its internals as `encoding` knows them -----------------------

# The SDK functions this relies on are hashed with the rest of the seam's
# (gateway/servicebus/internals/relied_on.py, tests/gateway/test_sdk_seam.py).


def test_the_batch_state_encoding_writes_has_the_shape_it_expects() -> None:
    batch = new_batch(4096)
    assert batch._amqp_transport is PyamqpTransportAsync
    assert isinstance(batch._message, list) and len(batch._message) == 9
    assert batch._message[5] == [] and batch._count == 0
    assert batch._size == batch.size_in_bytes == len(wire(batch))
    assert batch.max_size_in_bytes == 4096
    assert sb_constants._BATCH_MESSAGE_OVERHEAD_COST == [5, 8]
    assert PyamqpTransportAsync.set_batch_envelope_properties is encoding._set_envelope


class _Span:
    """The least of azure-core's `AbstractSpan` that the SDK's `trace_message` uses."""

    def __init__(self, name: str | None = None, kind: Any = None, **_: Any) -> None:
        self.name = name

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def to_header(self) -> dict[str, str]:
        return {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}

    def add_attribute(self, key: str, value: Any) -> None:
        return None


async def test_with_azure_core_tracing_on_batches_take_the_sdks_own_path() -> None:
    """The SDK then adds trace properties to each message: `encoding` stands aside."""
    azure_settings.tracing_implementation.set_value(_Span)
    try:
        assert not encoding.applies()
        sender, port = _sdk_sender(10_000)
        await sender.send(
            [OutboundMessage(body=b"a", message_id="a"), OutboundMessage(body=b"b", message_id="b")]
        )
    finally:
        azure_settings.tracing_implementation.unset_value()
    assert encoding.applies()
    [sent] = port.sent
    assert sent.count(b"traceparent") == 2 and sent.count(b"Diagnostic-Id") == 2


def test_the_header_and_properties_fields_are_encoded_as_the_sdk_picks() -> None:
    """`encoding` frames these two lists itself, with the encoder `encode_value` would pick
    for each field's declared type."""
    for definition, encoders in (
        (Header._definition, encoding._HEADER),  # type: ignore[attr-defined]
        (Properties._definition, encoding._PROPERTIES),  # type: ignore[attr-defined]
    ):
        assert len(definition) == len(encoders)
        for field, encoder in zip(definition, encoders, strict=True):
            kind = field.type
            if isinstance(kind, FieldDefinition):  # message ids: what a str becomes
                kind = _encode._FIELD_DEFINITIONS[kind]("id")[TYPE]
            if encoder is not None:
                assert _encode._ENCODE_MAP[kind] is encoder, field.name
