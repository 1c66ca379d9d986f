"""`to_amqp` (what the sender sends) builds the same outgoing AMQP message as the SDK's own
`ServiceBusMessage` with the same properties, field by field, for every property the REST
format can carry; and it refuses what `ServiceBusMessage` refuses.

Pure logic against the pinned SDK's own conversion (`to_outgoing_amqp_message`, the step
right before encoding); the end-to-end property tests in test_integration.py receive what
`to_amqp` sent through the real broker.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport

from gateway.core.message import OutboundMessage
from gateway.servicebus.client import _amqp_value, to_amqp

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
