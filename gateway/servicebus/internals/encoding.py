"""Each outgoing message encoded once, below the SDK's public API.

Why this exists: `ServiceBusMessageBatch.add_message` encodes every message twice — once to
measure it (`get_message_encoded_size`) and once more to append it (`add_batch`) — and wraps
each `AmqpAnnotatedMessage` in a `ServiceBusMessage` on the way. That was about a third of the
gateway's CPU end to end (docs/performance.md, "Encoding each message once"). Here each
`OutboundMessage` becomes the SDK's own outgoing pyamqp `Message` directly, is encoded once
by the SDK's own encoder (`encode_payload`), and the bytes are both measured and kept: they
are appended to a `ServiceBusMessageBatch` made by `create_message_batch`, which the SDK then
sends as usual (`send_messages(batch)`), so the frames on the wire are the SDK's own.

What it relies on, all from the exactly pinned azure-servicebus==7.15.0 (`SDK_VERSION`):

* `PyamqpTransport.to_outgoing_amqp_message`'s mapping, redone in `outgoing`: a header only
  with a TTL; with a TTL, creation and absolute-expiry times stamped from the clock at
  whole seconds; properties only when one is set; bytes application-property values decoded
  as UTF-8; an empty annotation or application-property map left out;
* pyamqp's `Message`, `Header`, `Properties` and its encoder: `encode_payload` for the
  annotations, application properties and body; the header and properties lists framed
  here (`_described_list`: `describe_performative` + `encode_list` without their generic
  walk, which was two thirds of the encoding's cost) with the field encoders
  `encode_value` picks for their declared types (`encode_string`, `encode_symbol`,
  `encode_timestamp`, `encode_uint`, `encode_binary`);
* `ServiceBusMessageBatch._add`'s size rule: the batch starts at the encoded size of an empty
  `BatchMessage` (`size_in_bytes`), each message adds its encoded size plus 5 bytes (under
  256) or 8 (`_BATCH_MESSAGE_OVERHEAD_COST`), and a message that would take the total over
  `max_size_in_bytes` is refused with `MessageSizeExceededError`, the batch unchanged;
* the batch's private state: `_message` (the `BatchMessage` fields, encoded messages
  appended to slot 5), `_size`, `_count`, and `set_batch_envelope_properties` (message id,
  session id and partition key of the first message on the envelope). `_messages` (the
  `ServiceBusMessage`s) stays empty: the SDK reads it only for tracing's span links and to
  rebuild a batch made by another transport, neither of which happens on this path.

tests/gateway/test_sdk_mapping.py holds this to the SDK's own path byte for byte (every
REST property, batch sizes to the byte, the batch on the wire) and fails loudly when the
installed SDK is not the pinned version or any function above changed;
tests/gateway/test_encoding_broker.py receives what it sent through the local broker. At
run time a different SDK version, or azure-core tracing being on (the SDK then adds trace
properties and span links per message), turns this path off (`switch.applies`): the sender
falls back to `add_message`.
"""

from __future__ import annotations

import datetime as dt
import struct
import time
from typing import Any

from azure.servicebus import ServiceBusMessageBatch
from azure.servicebus._common.constants import (
    _BATCH_MESSAGE_OVERHEAD_COST,
    MAX_ABSOLUTE_EXPIRY_TIME,
    MAX_DURATION_VALUE,
)
from azure.servicebus._pyamqp._encode import (
    encode_binary,
    encode_payload,
    encode_string,
    encode_symbol,
    encode_timestamp,
    encode_uint,
)
from azure.servicebus._pyamqp.message import Header, Message, Properties
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.exceptions import MessageSizeExceededError

from gateway.core.message import OutboundMessage, Typed
from gateway.servicebus.internals.switch import SDK_VERSION, VERSION_MATCHES, applies

__all__ = ["SDK_VERSION", "VERSION_MATCHES", "add", "applies", "check", "encode"]


_INT32 = range(-(2**31), 2**31)
AMQP_MAX_TTL_MS = 2**32 - 1  # the header's ttl field is an AMQP uint
_MAX_ID = 128  # the SDK's MESSAGE_PROPERTY_MAX_LENGTH
# Message annotations Service Bus reads (the SDK's own names, azure.servicebus._common.constants).
PARTITION_KEY = b"x-opt-partition-key"
SCHEDULED_ENQUEUE_TIME = b"x-opt-scheduled-enqueue-time"
_SMALL, _LARGE = _BATCH_MESSAGE_OVERHEAD_COST  # per-message overhead in a batch, in bytes
_set_envelope = PyamqpTransport.set_batch_envelope_properties


def amqp_value(value: Any) -> Any:
    """The SDK encodes a Python int as a 32-bit AMQP int and fails beyond it: send larger
    integers as typed AMQP longs (received back as plain ints). A `Typed` value is sent with
    its own AMQP type."""
    if isinstance(value, Typed):
        return {TYPE: getattr(AMQPTypes, value.kind), VALUE: value.value}
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT32:
        return {TYPE: AMQPTypes.long, VALUE: value}
    return value


def check(m: OutboundMessage) -> None:
    """Raise ValueError where `ServiceBusMessage` would (ids over 128 characters,
    PartitionKey != SessionId): a message from a backlog queue has not been through the REST
    parser's checks."""
    for name, value in (
        ("message_id", m.message_id),
        ("session_id", m.session_id),
        ("partition_key", m.partition_key),
        ("reply_to_session_id", m.reply_to_session_id),
    ):
        if value and len(value) > _MAX_ID:
            raise ValueError(f"{name} cannot be longer than {_MAX_ID} characters.")
    if m.partition_key and m.session_id is not None and m.partition_key != m.session_id:
        raise ValueError("partition_key cannot be set to a different value than session_id")


def ttl_ms(m: OutboundMessage) -> int | None:
    """The TTL in milliseconds: `ServiceBusMessage`'s setter would truncate it to whole
    seconds (0.5 s: no TTL at all)."""
    if m.time_to_live is None:
        return None
    ms = max(1, round(m.time_to_live.total_seconds() * 1000))
    # AMQP's header TTL is a 32-bit millisecond count (~49.7 days) and the SDK cannot encode
    # more. Service Bus caps a TTL at the entity's default anyway, so a longer one is sent as
    # none: the entity's default applies, never shorter than what the client asked for.
    return ms if ms <= AMQP_MAX_TTL_MS else None


def outgoing(m: OutboundMessage) -> Message:
    """The pyamqp message the SDK's `to_outgoing_amqp_message` makes of `to_amqp(m)`."""
    check(m)
    header = None
    creation = expiry = None
    ttl = ttl_ms(m)
    if ttl is not None:
        header = Header(ttl=ttl)
        if ttl != MAX_DURATION_VALUE:
            # Exactly the SDK's stamp (local-time mktime of the UTC time, whole seconds).
            creation = int(time.mktime(dt.datetime.now(dt.UTC).timetuple()) * 1000)
            expiry = int(min(MAX_ABSOLUTE_EXPIRY_TIME, creation + ttl))
    properties = None
    fields = (
        m.message_id,
        m.to,
        m.subject,
        m.reply_to,
        m.correlation_id,
        m.content_type,
        m.session_id,
        m.reply_to_session_id,
    )
    if creation is not None or fields.count(None) != len(fields):
        properties = Properties(
            message_id=m.message_id,
            to=m.to,
            subject=m.subject,
            reply_to=m.reply_to,
            correlation_id=m.correlation_id,
            content_type=m.content_type,
            creation_time=creation,
            absolute_expiry_time=expiry,
            group_id=m.session_id,
            reply_to_group_id=m.reply_to_session_id,
        )
    annotations: dict[str | bytes, Any] | None = None
    if m.partition_key or m.scheduled_enqueue_time_utc is not None:
        annotations = {}  # in ServiceBusMessage's order: the map's bytes follow it
        if m.scheduled_enqueue_time_utc is not None:
            annotations[SCHEDULED_ENQUEUE_TIME] = m.scheduled_enqueue_time_utc
        if m.partition_key:
            annotations[PARTITION_KEY] = m.partition_key
    app: dict[str | bytes, Any] | None = None
    if m.application_properties:
        app = {
            k: v.decode("utf-8") if isinstance(v, bytes) else amqp_value(v)
            for k, v in m.application_properties.items()
        }
    return Message(
        header=header,
        message_annotations=annotations,
        properties=properties,
        application_properties=app,
        data=[m.body],
    )


# The header's and the properties' fields (pyamqp's `Header._definition` and
# `Properties._definition`) with the encoder `encode_value` picks for each (message ids:
# `encode_message_id`'s choice for a str).
_HEADER = (None, None, encode_uint, None, None)
_PROPERTIES = (
    encode_string,  # message_id (str)
    encode_binary,  # user_id
    encode_string,  # to
    encode_string,  # subject
    encode_string,  # reply_to
    encode_string,  # correlation_id (str)
    encode_symbol,  # content_type
    encode_symbol,  # content_encoding
    encode_timestamp,  # absolute_expiry_time
    encode_timestamp,  # creation_time
    encode_string,  # group_id
    encode_uint,  # group_sequence
    encode_string,  # reply_to_group_id
)
_HEADER_DESCRIPTOR = b"\x00\x53\x70"  # described, smallulong 0x70
_PROPERTIES_DESCRIPTOR = b"\x00\x53\x73"


def _described_list(output: bytearray, descriptor: bytes, values: Any, encoders: Any) -> None:
    """`describe_performative` + `encode_list` for a list of known field types, without the
    generic walk: null as 0x40, list8 while it fits in one length byte, else list32."""
    body = bytearray()
    for value, encoder in zip(values, encoders, strict=True):
        if value is None:
            body += b"\x40"
        else:
            encoder(body, value)
    size, count = len(body), len(encoders)
    output += descriptor
    if count <= 255 and size < 255:
        output += bytes((0xC0, size + 1, count))
    else:
        output += struct.pack(">BLL", 0xD0, size + 4, count)
    output += body


def _encode_fast(message: Message) -> bytearray:
    """`encode_payload(message)` with the header and properties encoded field by field; the
    annotations, application properties and body by `encode_payload` itself, in its order."""
    output = bytearray()
    if message.header is not None:
        _described_list(output, _HEADER_DESCRIPTOR, message.header, _HEADER)
    if message.message_annotations:
        encode_payload(output, Message(message_annotations=message.message_annotations))
    if message.properties is not None:
        _described_list(output, _PROPERTIES_DESCRIPTOR, message.properties, _PROPERTIES)
    encode_payload(
        output, Message(application_properties=message.application_properties, data=message.data)
    )
    return output


def encode(m: OutboundMessage) -> bytearray:
    """`m` encoded as the SDK encodes it into a batch. Raises ValueError (or TypeError) for
    a message `ServiceBusMessage` refuses or the encoder cannot encode.

    A message the AMQP edge passed through raw (`m.encoded`: the client's own encoding, less
    what the edge drops, holding exactly `m`'s fields) is not encoded again: its bytes are
    sent as they are, after the same checks (`check`). They differ from this encoding only
    in form (a str8 for a str32, say) and in the client's own creation and expiry stamps
    (tests/gateway/test_amqp_messages.py holds the content equal)."""
    if m.encoded is not None:
        check(m)
        return bytearray(m.encoded)
    message = outgoing(m)
    try:
        return _encode_fast(message)
    except TypeError:  # a field not of its type (not a str): `encode_value` then tries
        pass  # `encode_unknown`, so the generic path decides
    output = bytearray()
    encode_payload(output, message)
    return output


def add(batch: ServiceBusMessageBatch, m: OutboundMessage, encoded: bytearray) -> None:
    """`batch.add_message(to_amqp(m))` with `m` already `encoded`: the same size rule, the
    same refusal (`MessageSizeExceededError`, the batch unchanged), the same bytes kept."""
    size = len(encoded)
    after = batch._size + size + (_SMALL if size < 256 else _LARGE)
    if after > batch.max_size_in_bytes:
        raise MessageSizeExceededError(
            message=f"ServiceBusMessageBatch has reached its size limit: {batch.max_size_in_bytes}"
        )
    envelope = batch._message
    envelope[5].append(encoded)
    batch._size = after
    batch._count += 1
    if batch._count == 1:  # the SDK sets the envelope from the first message
        _set_envelope(envelope, m.message_id, m.session_id, m.partition_key or None)
