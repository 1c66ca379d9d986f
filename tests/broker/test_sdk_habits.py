"""The wire habits of the Service Bus SDKs that do not run here, scripted with proton's engine
(tests/broker/scripted.py): .NET's SASL mechanism ``MSSBCBS`` and its reply-to by target
address; Node's reply-to by link name with a string message-id. A broker that gets one wrong
leaves the client waiting: every step here has a deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from proton import Message

from sblocal import sas
from sblocal.config import DEV_KEY_NAME, DEV_KEY_VALUE
from sblocal.server import LocalBroker
from tests.broker.scripted import ScriptedPeer, raw_sasl

pytestmark = pytest.mark.integration


def _token(port: int, entity: str) -> str:
    return sas.sign(
        f"sb://localhost:{port}/{entity}", DEV_KEY_NAME, DEV_KEY_VALUE, int(time.time()) + 600
    )


def _put_token(port: int, entity: str, message_id: Any, reply_to: str | None) -> Message:
    return Message(
        id=message_id,
        reply_to=reply_to,
        properties={
            "operation": "put-token",
            "name": f"sb://localhost:{port}/{entity}",
            "type": "servicebus.windows.net:sastoken",
        },
        body=_token(port, entity),
    )


@pytest.fixture
def peer_factory() -> Iterator[Any]:
    peers: list[ScriptedPeer] = []

    def make(port: int, **kwargs: Any) -> ScriptedPeer:
        peer = ScriptedPeer(port, **kwargs)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.close()


async def _in_thread(fn: Any, *args: Any) -> Any:
    """The scripted peer blocks on its socket: off the loop the in-process broker uses."""
    async with asyncio.timeout(30):
        return await asyncio.to_thread(fn, *args)


async def test_sasl_offers_mssbcbs_and_anonymous_and_accepts_mssbcbs(broker: LocalBroker):
    import socket

    port = broker.amqp_port("primary")

    def exchange(mechanism: str) -> tuple[list[str], int]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            return raw_sasl(sock, mechanism)

    offered, outcome = await _in_thread(exchange, "MSSBCBS")
    assert offered == ["MSSBCBS", "ANONYMOUS"]
    assert outcome == 0
    _, refused = await _in_thread(exchange, "PLAIN")
    assert refused == 1  # auth: a mechanism that was not offered


async def test_dotnet_habits_mssbcbs_a_session_per_link_and_reply_to_by_target(
    broker: LocalBroker, peer_factory: Any
):
    """.NET: SASL MSSBCBS, each link in its own session, `/entity` targets, a uuid
    message-id, and reply-to = its receiver's target address."""
    port = broker.amqp_port("primary")

    def script() -> tuple[Message, Any]:
        peer = peer_factory(port, mechanism="MSSBCBS")
        assert peer.offered == ["MSSBCBS", "ANONYMOUS"]
        requests = peer.sender("cbs-sender", "$cbs")
        replies = peer.receiver("cbs-receiver", "$cbs", target="cbs-client-reply-7")
        message_id = uuid.uuid4()
        reply = peer.request(
            requests, replies, _put_token(port, "orders", message_id, "cbs-client-reply-7")
        )
        sender = peer.sender("orders-sender", "/orders")
        delivery = peer.send(sender, Message(body="from .NET").encode(), tag=b"t1")
        return reply, (message_id, delivery.remote_state)

    reply, (message_id, state) = await _in_thread(script)
    assert reply.properties["status-code"] == 200
    assert reply.correlation_id == message_id
    assert isinstance(reply.correlation_id, uuid.UUID)
    assert state == reply_accepted()
    assert broker.namespace("primary").counters.messages_received == 1


async def test_node_habits_reply_to_by_link_name_with_a_string_message_id(
    broker: LocalBroker, peer_factory: Any
):
    """Node: SASL ANONYMOUS, the `$cbs` receiver named `cbs-<uuid>` with no target,
    reply-to = that name, a string message-id (echoed as a string, not as binary)."""
    port = broker.amqp_port("primary")
    name = f"cbs-{uuid.uuid4()}"

    def script() -> Message:
        peer = peer_factory(port)
        requests = peer.sender(f"cbs-sender-{uuid.uuid4()}", "$cbs")
        replies = peer.receiver(name, "$cbs")
        return peer.request(requests, replies, _put_token(port, "orders", "node-id-1", name))

    reply = await _in_thread(script)
    assert reply.properties["status-code"] == 200
    assert reply.correlation_id == "node-id-1"
    assert isinstance(reply.correlation_id, str)


async def test_node_management_replies_go_to_its_uuid_target(
    broker: LocalBroker, peer_factory: Any
):
    """Node's `$management` receiver has a uuid target, named in its requests' reply-to,
    and lives in a session of its own."""
    port = broker.amqp_port("primary")
    reply_address = str(uuid.uuid4())

    def script() -> Message:
        peer = peer_factory(port)
        requests = peer.sender("cbs-s", "$cbs")
        replies = peer.receiver("cbs-r", "$cbs")
        token = peer.request(
            requests, replies, _put_token(port, "orders/$management", "m-1", "cbs-r")
        )
        assert token.properties["status-code"] == 200
        mgmt = peer.sender("mgmt-sender", "orders/$management")
        mgmt_replies = peer.receiver(
            "mgmt-receiver", "orders/$management", target=reply_address, session=peer.session()
        )
        request = Message(
            id="req-1",
            reply_to=reply_address,
            properties={"operation": "com.microsoft:no-such-operation"},
            body={},
        )
        return peer.request(mgmt, mgmt_replies, request)

    reply = await _in_thread(script)
    assert reply.correlation_id == "req-1"
    assert reply.properties["statusCode"] == 501


def reply_accepted() -> Any:
    from proton import Delivery

    return Delivery.ACCEPTED
