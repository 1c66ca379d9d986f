"""A batch is a transfer whose message format is 0x80013700, whatever its bytes look like:
a single message whose body happens to be an encoded AMQP message stays one message."""

from __future__ import annotations

import asyncio

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from proton import Message

from sblocal.server import LocalBroker

from .conftest import receive_n

pytestmark = pytest.mark.integration


async def test_a_single_message_holding_an_encoded_message_is_stored_as_one(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    encoded = bytes(Message(id="inner", body=b"inner body").encode())
    async with asyncio.timeout(20):
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(ServiceBusMessage(encoded, message_id="outer"))
        async with client.get_queue_receiver("orders") as receiver:
            (got,) = await receive_n(receiver, 1)
            await receiver.complete_message(got)
    assert got.message_id == "outer"
    assert b"".join(got.body) == encoded
    assert broker.namespace("primary").counters.messages_received == 1


async def test_a_batch_transfer_is_split_into_its_messages(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    encoded = bytes(Message(id="inner", body=b"inner body").encode())
    async with asyncio.timeout(20):
        async with client.get_queue_sender("orders") as sender:
            batch = await sender.create_message_batch()
            batch.add_message(ServiceBusMessage("one", message_id="b1"))
            batch.add_message(ServiceBusMessage(encoded, message_id="b2"))
            await sender.send_messages(batch)
        async with client.get_queue_receiver("orders") as receiver:
            got = await receive_n(receiver, 2)
            for m in got:
                await receiver.complete_message(m)
    assert [m.message_id for m in got] == ["b1", "b2"]
    assert b"".join(got[1].body) == encoded
    assert broker.namespace("primary").counters.messages_received == 2
