"""A scripted client with the .NET SDK's documented habits (Azure.Messaging.ServiceBus, read
in its source: it cannot run here) against the gateway's AMQP edge: SASL ``MSSBCBS`` (its
only mechanism), a session per link, the `$cbs` reply routed by the receiver's *target
address*, ``/orders`` as the sender's target, ``com.microsoft:timeout`` on the attach, a
second token for ``orders/$management``, and a transaction coordinator, which must be
refused. Frames are built and read with sbamqp's own codec; every read has a deadline."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from gateway.app import AMQP_SERVER
from gateway.auth import mint_token
from sbamqp import sections
from sbamqp.codec import Symbol, Uint, Ulong, decode
from sbamqp.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    HEADER_SIZE,
    SASL_HEADER,
    decode_body,
    encode_frame,
    parse_header,
)
from sbamqp.performatives import (
    Accepted,
    Attach,
    Begin,
    Coordinator,
    Detach,
    Disposition,
    Flow,
    Open,
    Performative,
    Rejected,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    Source,
    Target,
    Transfer,
)
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, SEND_KEY
from tests.support.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEP = 10.0  # each read's deadline


class Client:
    """A bare AMQP client over one socket (see the module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, channel: int, perf: Performative, payload: bytes = b"", sasl: bool = False):
        self.writer.write(encode_frame(channel, perf, payload, FRAME_SASL if sasl else FRAME_AMQP))

    async def header(self) -> bytes:
        async with asyncio.timeout(STEP):
            return await self.reader.readexactly(HEADER_SIZE)

    async def frame(self) -> tuple[int, Performative | None, bytes]:
        async with asyncio.timeout(STEP):
            head = await self.reader.readexactly(8)
            parsed = parse_header(head, 0, 1 << 20)
            assert parsed is not None
            body = await self.reader.readexactly(parsed.size - 8)
        perf, payload = decode_body(body[parsed.body_offset - 8 :], parsed.frame_type)
        return parsed.channel, perf, payload

    async def expect(self, kind: type[Performative]) -> tuple[int, Any, bytes]:
        """The next frame of `kind`, skipping flows, heartbeats and the like."""
        while True:
            channel, perf, payload = await self.frame()
            if isinstance(perf, kind):
                return channel, perf, payload


def request(message_id: Any, reply_to: str, props: dict[str, Any], body: Any) -> bytes:
    return b"".join(
        (
            sections.section(sections.PROPERTIES, [message_id, None, None, None, reply_to]),
            sections.section(sections.APPLICATION_PROPERTIES, props),
            sections.section(sections.AMQP_VALUE, body),
        )
    )


def reply_of(payload: bytes) -> tuple[Any, dict[str, Any]]:
    parts = sections.split(payload)
    props = {k: v for k, _raw, v in parts.application_properties_items()}
    return parts.properties_view().correlation_id, props


async def handshake(port: int) -> Client:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    c = Client(reader, writer)
    writer.write(SASL_HEADER)
    assert await c.header() == SASL_HEADER
    _, mechanisms, _ = await c.expect(SaslMechanisms)
    assert "MSSBCBS" in list(mechanisms.sasl_server_mechanisms)
    c.send(0, SaslInit(mechanism=Symbol("MSSBCBS")), sasl=True)
    _, outcome, _ = await c.expect(SaslOutcome)
    assert outcome.code == 0
    writer.write(AMQP_HEADER)
    assert await c.header() == AMQP_HEADER
    c.send(0, Open(container_id="dotnet-like", hostname="localhost", idle_time_out=Uint(60000)))
    await c.expect(Open)
    return c


async def begin(c: Client, channel: int) -> None:
    c.send(channel, Begin(next_outgoing_id=0, incoming_window=5000, outgoing_window=5000))
    await c.expect(Begin)


async def credit(c: Client, handle: int) -> None:
    """Wait for the server's credit on our sender `handle`."""
    while True:
        _, flow, _ = await c.expect(Flow)
        if flow.handle == handle and flow.link_credit:
            return


async def put_token(c: Client, channel: int, audience: str, token: str) -> tuple[Any, Any]:
    """A put-token on its own session, the reply routed by the receiver's target address."""
    await begin(c, channel)
    reply_address = f"cbs-reply-{uuid.uuid4()}"
    c.send(channel, Attach(name="cbs-s", handle=0, role=False, source=Source(address="cbs-s"),
                           target=Target(address="$cbs")))  # fmt: skip
    c.send(channel, Attach(name="cbs-r", handle=1, role=True, source=Source(address="$cbs"),
                           target=Target(address=reply_address)))  # fmt: skip
    c.send(channel, Flow(next_incoming_id=0, incoming_window=5000, next_outgoing_id=0,
                         outgoing_window=5000, handle=Uint(1), delivery_count=Uint(0),
                         link_credit=Uint(10)))  # fmt: skip
    await credit(c, 0)  # a client sends once it has credit
    message_id = f"msg-{uuid.uuid4()}"  # .NET sends a string id
    payload = request(
        message_id,
        reply_address,
        {"operation": "put-token", "type": "servicebus.windows.net:sastoken", "name": audience},
        token,
    )
    c.send(channel, Transfer(handle=0, delivery_id=Uint(0), delivery_tag=b"\x00",
                             message_format=Uint(0)), payload)  # fmt: skip
    _, _transfer, body = await c.expect(Transfer)  # the server sends nothing but replies
    correlation, props = reply_of(body)
    return correlation == message_id, props["status-code"]


async def test_a_dotnet_like_client_sends_and_its_coordinator_is_refused(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH})
    port = gw.app[AMQP_SERVER].ports["plain"]
    c = await handshake(port)
    try:
        audience = f"sb://localhost:{port}/orders"
        token = mint_token(audience, "sender", SEND_KEY, 3600)
        assert await put_token(c, 0, audience, token) == (True, 200)
        manage = mint_token(f"{audience}/$management", "sender", SEND_KEY, 3600)
        assert await put_token(c, 1, f"{audience}/$management", manage) == (True, 200)

        await begin(c, 2)  # a session per link
        c.send(2, Attach(name="snd", handle=0, role=False, source=Source(address="snd-1"),
                         target=Target(address="/orders"),
                         properties={Symbol("com.microsoft:timeout"): Uint(60000)}))  # fmt: skip
        _, attach, _ = await c.expect(Attach)
        assert attach.max_message_size and attach.max_message_size > 0
        await credit(c, 0)
        message = sections.section(sections.PROPERTIES, ["dotnet-1"]) + sections.section(
            sections.DATA, b"from a .NET-like client"
        )
        c.send(2, Transfer(handle=0, delivery_id=Uint(0), delivery_tag=b"\x01",
                           message_format=Uint(0)), message)  # fmt: skip
        _, disposition, _ = await c.expect(Disposition)
        assert isinstance(disposition.state, Accepted), disposition

        await begin(c, 3)
        coordinator = Coordinator(capabilities=[Symbol("amqp:local-transactions")])
        c.send(3, Attach(name="txn", handle=0, role=False, source=Source(address="txn"),
                         target=coordinator))  # fmt: skip
        _, detach, _ = await c.expect(Detach)
        assert detach.error is not None and detach.error.condition == "amqp:not-implemented"
    finally:
        c.writer.close()
    [stored] = await control.messages("primary", "orders")
    assert stored["message_id"] == "dotnet-1"


async def test_a_transfer_without_a_token_is_rejected_unauthorized(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH})
    c = await handshake(gw.app[AMQP_SERVER].ports["plain"])
    try:
        await begin(c, 0)
        c.send(0, Attach(name="snd", handle=0, role=False, source=Source(address="s"),
                         target=Target(address="orders")))  # fmt: skip
        await credit(c, 0)
        body = sections.section(sections.DATA, b"x")
        c.send(0, Transfer(handle=0, delivery_id=Uint(0), delivery_tag=b"\x01",
                           message_format=Uint(0)), body)  # fmt: skip
        _, disposition, _ = await c.expect(Disposition)
        assert isinstance(disposition.state, Rejected)
        assert disposition.state.error.condition == "amqp:unauthorized-access"
        info = disposition.state.error.info
        assert isinstance(info, dict), "an info map, always (pyamqp needs one)"
    finally:
        c.writer.close()
    assert await control.messages("primary", "orders") == []


def test_the_scripted_frames_decode() -> None:
    # The codec the script leans on reads back what it wrote.
    raw = sections.section(sections.PROPERTIES, [Ulong(1)])
    assert decode(raw)[0].value == [Ulong(1)]
