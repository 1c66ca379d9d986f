"""Messages encoded once (gateway/servicebus/internals/encoding.py) reach the real broker whole.

The batch path of `SdkSender` over the real azure-servicebus SDK and the local broker: every
REST property and application-property type comes back through the SDK's receiver, in
order; a send larger than the link's batch limit goes out as several of the SDK's batches,
all stored. test_sdk_mapping.py holds the bytes to the SDK's own path; this is the broker's
word on them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient

from gateway.core.message import OutboundMessage
from gateway.errors import FailureKind, SendFailure
from gateway.servicebus.client import SdkSender
from gateway.servicebus.internals import encoding
from sblocal.testing import BrokerProcess, ControlClient
from tests.gateway.test_integration import receive

AT = dt.datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=dt.UTC)


async def send(broker: BrokerProcess, messages: list[OutboundMessage]) -> int:
    """Send through `SdkSender` on a real SDK sender; the number of transfers it made."""
    async with ServiceBusClient.from_connection_string(broker.connection_string("primary")) as sb:
        async with sb.get_queue_sender("orders") as sdk_sender:
            transfers = 0
            send_messages = sdk_sender.send_messages

            async def counted(*args: Any, **kwargs: Any) -> None:
                nonlocal transfers
                transfers += 1
                await send_messages(*args, **kwargs)

            sdk_sender.send_messages = counted  # type: ignore[method-assign]
            await SdkSender("primary", "orders", sdk_sender).send(messages)
            return transfers


def app_props(m: ServiceBusReceivedMessage) -> dict[str, Any]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in (m.application_properties or {}).items()
    }


async def test_every_property_of_a_batch_arrives_intact(
    broker: BrokerProcess, control: ControlClient
) -> None:
    assert encoding.applies(), "the encode-once path must be the one under test"
    messages = [
        OutboundMessage(
            body=f'{{"n": {i}}}'.encode() * (1 if i else 40),  # one over 256 bytes encoded
            message_id=f"order-{i}",
            content_type="application/json",
            correlation_id=f"corr-{i}",
            session_id="sess-1",
            subject="created",
            reply_to="replies",
            reply_to_session_id="rs-1",
            to="billing",
            time_to_live=dt.timedelta(hours=1, milliseconds=250),
            partition_key="sess-1",
            application_properties={
                "text": "héllo",
                "int": 42,
                "big": 2**40,
                "neg": -(2**35),
                "float": 0.25,
                "flag": True,
                "raw": b"bytes",
                "when": AT,
            },
        )
        for i in range(3)
    ]
    assert await send(broker, messages) == 1, "one batch"
    got = await receive(broker, "orders", count=3)
    assert [m.message_id for m in got] == ["order-0", "order-1", "order-2"]
    for sent, m in zip(messages, got, strict=True):
        assert b"".join(m.body) == sent.body
        assert m.content_type == "application/json" and m.correlation_id == sent.correlation_id
        assert m.session_id == "sess-1" and m.partition_key == "sess-1"
        assert m.subject == "created" and m.reply_to == "replies" and m.to == "billing"
        assert m.reply_to_session_id == "rs-1"
        assert m.time_to_live == dt.timedelta(hours=1, milliseconds=250)
        props = app_props(m)
        assert props == {
            "text": "héllo",
            "int": 42,
            "big": 2**40,
            "neg": -(2**35),
            "float": 0.25,
            "flag": True,
            "raw": "bytes",
            "when": round(AT.timestamp() * 1000),  # an AMQP timestamp: the SDK gives ms
        }


async def test_a_scheduled_batch_message_keeps_its_schedule(
    broker: BrokerProcess, control: ControlClient
) -> None:
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    await send(
        broker,
        [
            OutboundMessage(body=b"now", message_id="now"),
            OutboundMessage(body=b"later", message_id="later", scheduled_enqueue_time_utc=later),
        ],
    )
    entity = await control.entity("primary", "orders")
    assert entity["scheduled"] == 1 and entity["active"] == 1


async def test_a_send_over_the_links_batch_limit_stores_nothing(
    broker: BrokerProcess, control: ControlClient
) -> None:
    """More bytes than one batch takes: `SdkSender` used to send what fitted and go on with
    another batch, so a later failure left part of the call stored (issue 33). One call is
    one transfer now: refused before anything is sent (the dispatcher bisects a call of
    several requests; one request that does not fit alone gets 413)."""
    messages = [
        OutboundMessage(body=bytes([65 + i]) * 200_000, message_id=f"big-{i}") for i in range(6)
    ]
    with pytest.raises(SendFailure) as info:
        await send(broker, messages)
    assert info.value.kind is FailureKind.MESSAGE_TOO_LARGE
    assert await send(broker, messages[:1]) == 1
    counters = await control.counters("primary")
    assert counters["messages_received"] == 1
    assert [m["message_id"] for m in await control.messages("primary", "orders")] == ["big-0"]
