"""The real Python SDK (azure-servicebus, pinned) against sbamqp's engine, driven by a tiny
asyncio server in the test (tests/sbamqp/peer.py): put-token, sender attach, single and
batch sends, and rejections that surface as the SDK's own exceptions."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import (
    MessagingEntityNotFoundError,
    ServiceBusError,
    ServiceBusServerBusyError,
)

from sbamqp import conventions, engine, sections
from sbamqp.performatives import Error, Rejected
from tests.sbamqp.peer import Peer, connection_string, serve

pytestmark = pytest.mark.integration

DEADLINE = 20


def _client(port: int) -> ServiceBusClient:
    return ServiceBusClient.from_connection_string(connection_string(port), retry_total=0)


async def test_single_and_batch_sends_are_accepted() -> None:
    peer = Peer()
    async with serve(peer) as port, _client(port) as client:
        sender = client.get_queue_sender("orders")
        async with asyncio.timeout(DEADLINE), sender:
            await sender.send_messages(
                ServiceBusMessage(
                    b"one",
                    message_id="m-1",
                    session_id=None,
                    application_properties={"k": "v", "n": 5},
                )
            )
            batch = await sender.create_message_batch()
            batch.add_message(ServiceBusMessage("two"))
            batch.add_message(ServiceBusMessage("three"))
            await sender.send_messages(batch)
    tokens = [name for name, _ in peer.tokens]
    assert tokens and tokens[0].endswith("/orders"), tokens
    single, batch_delivery = peer.received
    assert single.entity == "orders" and single.message_format == 0
    message = sections.split(single.payload)
    assert message.properties_view().message_id == "m-1"
    assert message.data() == [b"one"]
    assert [(k, v) for k, _, v in message.application_properties_items()] == [("k", "v"), ("n", 5)]
    assert batch_delivery.message_format == conventions.BATCH_MESSAGE_FORMAT
    bodies = [sections.split(m).data() for m in sections.split_batch(batch_delivery.payload)]
    assert bodies == [[b"two"], [b"three"]]
    attached = [e.link for e in peer.events if isinstance(e, engine.LinkAttached)]
    assert any(link.target_address and link.target_address.endswith("/orders") for link in attached)


@pytest.mark.parametrize(
    ("condition", "exception"),
    [
        (conventions.Condition.SERVER_BUSY, ServiceBusServerBusyError),
        (conventions.Condition.NOT_FOUND, MessagingEntityNotFoundError),
    ],
)
async def test_a_rejection_raises_the_sdk_exception(condition: str, exception: type) -> None:
    peer = Peer(outcomes={"orders": Rejected(Error(condition, "refused here"))})
    async with serve(peer) as port, _client(port) as client:
        sender = client.get_queue_sender("orders")
        async with asyncio.timeout(DEADLINE), sender:
            with pytest.raises(exception):
                await sender.send_messages(ServiceBusMessage(b"x"))
    assert len(peer.received) == 1


async def test_a_message_larger_than_a_frame_arrives_whole() -> None:
    peer = Peer(limits=engine.Limits(max_frame_size=4096))
    body = bytes(range(256)) * 400  # 100 KiB over 4 KiB frames
    async with serve(peer) as port, _client(port) as client:
        sender = client.get_queue_sender("orders")
        async with asyncio.timeout(DEADLINE), sender:
            await sender.send_messages(ServiceBusMessage(body))
    (received,) = peer.received
    assert sections.split(received.payload).data() == [body]


async def test_a_receiver_is_refused_with_the_senders_only_text() -> None:
    peer = Peer()
    async with serve(peer) as port, _client(port) as client:
        receiver = client.get_queue_receiver("orders")
        async with asyncio.timeout(DEADLINE):
            with pytest.raises(ServiceBusError, match="only accepts senders"):
                async with receiver:
                    await receiver.receive_messages(max_wait_time=1)


async def test_schedule_messages_goes_through_the_management_link() -> None:
    peer = Peer()
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
    async with serve(peer) as port, _client(port) as client:
        sender = client.get_queue_sender("orders")
        async with asyncio.timeout(DEADLINE), sender:
            numbers = await sender.schedule_messages(
                [ServiceBusMessage(b"a"), ServiceBusMessage(b"b")], when
            )
    assert numbers == [1, 2]
    ((app, body),) = peer.management
    assert app["operation"] == "com.microsoft:schedule-message"
    assert len(body["messages"]) == 2


async def test_concurrent_senders() -> None:
    peer = Peer()
    names = [f"q{i}" for i in range(5)]
    async with serve(peer) as port, _client(port) as client:
        senders = [client.get_queue_sender(name) for name in names]

        async def send_ten(sender: object) -> None:
            async with sender:  # type: ignore[attr-defined]
                for i in range(10):
                    await sender.send_messages(ServiceBusMessage(f"m{i}"))  # type: ignore[attr-defined]

        async with asyncio.timeout(DEADLINE), asyncio.TaskGroup() as group:
            for sender in senders:
                group.create_task(send_ten(sender))
    by_entity: dict[str, int] = {}
    for received in peer.received:
        by_entity[received.entity] = by_entity.get(received.entity, 0) + 1
    assert by_entity == dict.fromkeys(names, 10)
    opened = [e for e in peer.events if isinstance(e, engine.Opened)]
    assert len(opened) == len(names)  # the Python SDK opens a connection per sender
