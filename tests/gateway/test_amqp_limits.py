"""The AMQP edge's caps and timers: connections, the handshake deadline, the credit floor,
the maximum connection age (sockets and the real SDK against the in-process gateway)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import ServiceBusError, ServiceBusServerBusyError

from gateway.amqp.server import AmqpServer
from gateway.app import AMQP_SERVER
from gateway.metrics import Metrics
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, DEADLINE, connection_string, receive
from tests.support.processes import free_port
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Start = Callable[[dict[str, str]], Awaitable[AmqpServer]]


@pytest.fixture
def amqp_server(gateway: GatewayFactory) -> Start:
    async def start(env: dict[str, str]) -> AmqpServer:
        gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH, **env})
        return gw.app[AMQP_SERVER]

    return start


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    async with asyncio.timeout(within):
        while await reader.read(4096):
            pass  # the server's protocol header, then EOF
    return True


async def test_a_silent_connection_is_closed_at_the_handshake_deadline(
    amqp_server: Start, control: ControlClient
) -> None:
    server = await amqp_server({"SBGATE_AMQP_HANDSHAKE_TIMEOUT": "0.3"})
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports["plain"])
    try:
        assert await closed_by_server(reader, within=5)
    finally:
        writer.close()


async def test_a_connection_over_the_cap_is_closed_at_once(
    amqp_server: Start, control: ControlClient
) -> None:
    server = await amqp_server({"SBGATE_AMQP_MAX_CONNECTIONS": "1"})
    port = server.ports["plain"]
    _r1, w1 = await asyncio.open_connection("127.0.0.1", port)
    await eventually(lambda: server.connections == 1, within=5)
    r2, w2 = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await closed_by_server(r2, within=5)
        assert server.connections == 1
    finally:
        w1.close()
        w2.close()


async def test_a_link_keeps_one_credit_while_admission_is_full(
    amqp_server: Start, broker: BrokerProcess, control: ControlClient
) -> None:
    server = await amqp_server({})
    server.has_room = lambda: False  # type: ignore[method-assign]  # admission at its high-water
    conn = connection_string(server.ports["plain"])
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                for i in range(3):  # one at a time, as the Python SDK sends
                    await sender.send_messages(ServiceBusMessage(b"x", message_id=f"f-{i}"))
    assert len(await receive(broker, 3)) == 3


async def test_an_old_connection_is_closed_and_the_sdk_reconnects_unnoticed(
    amqp_server: Start, broker: BrokerProcess, control: ControlClient
) -> None:
    # Long enough for the SDK to open a connection and send on it on a loaded machine (at
    # 0.5 s a fresh clone's run once saw all four of its attempts closed before their send),
    # short enough to meet within the test.
    server = await amqp_server({"SBGATE_AMQP_MAX_CONNECTION_AGE": "2"})
    conn = connection_string(server.ports["plain"])
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn) as sb:  # the SDK's retries
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"1", message_id="age-1"))
                await eventually(lambda: server.connections == 0, within=10)
                await sender.send_messages(ServiceBusMessage(b"2", message_id="age-2"))
    assert sorted(m.message_id for m in await receive(broker, 2)) == ["age-1", "age-2"]


def test_the_open_hostname_must_be_served() -> None:
    from gateway.config import load_settings

    settings = load_settings({"SBGATE_PUBLIC_HOSTS": "gw.example.com,other.example.com:5671"})
    server = AmqpServer(settings, None, None)  # type: ignore[arg-type]  # nothing else used
    assert server.serves_host("gw.example.com") and server.serves_host("OTHER.example.com")
    assert server.serves_host("localhost") and server.serves_host("127.0.0.1")
    assert not server.serves_host("evil.example.com")


async def test_the_edge_counts_its_connections_tokens_refusals_and_deliveries(
    amqp_server: Start, broker: BrokerProcess, control: ControlClient
) -> None:
    server = await amqp_server({})
    observer = server.edge.observer
    assert isinstance(observer, Metrics)
    registry = observer.registry
    conn = connection_string(server.ports["plain"])
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"x", message_id="m-1"))
                assert registry.get_sample_value("sbgate_amqp_open_connections") == 1
            with pytest.raises(ServiceBusError):
                async with sb.get_queue_receiver("orders") as receiver:
                    await receiver.receive_messages(max_wait_time=1)
    sample = registry.get_sample_value
    assert (sample("sbgate_amqp_put_tokens_total", {"result": "granted"}) or 0) >= 1
    assert sample("sbgate_amqp_refused_total", {"kind": "link"}) == 1
    answered = {"entity": "orders", "status": "201", "route": "primary", "protocol": "amqp"}
    assert sample("sbgate_http_requests_total", answered) == 1
    await eventually(lambda: sample("sbgate_amqp_open_connections") == 0, within=10)


async def test_garbage_closes_only_its_own_connection(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
) -> None:
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH})
    server = gw.app[AMQP_SERVER]
    port = server.ports["plain"]
    conn = connection_string(port)
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"before", message_id="g-1"))
                for junk in (b"GET / HTTP/1.1\r\n\r\n", b"AMQP\x03\x01\x00\x00" + b"\xff" * 64):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(junk)
                    try:
                        assert await closed_by_server(reader, within=5)
                    finally:
                        writer.close()
                await sender.send_messages(ServiceBusMessage(b"after", message_id="g-2"))
    assert (await gw.get("/healthz")).status == 200
    assert sorted(m.message_id for m in await receive(broker, 2)) == ["g-1", "g-2"]


async def test_deliveries_held_at_the_edge_are_bounded_whatever_the_credit(
    amqp_server: Start, broker: BrokerProcess, control: ControlClient
) -> None:
    # Credit is per link (1000, as Service Bus grants) and a client may send past it: what
    # bounds the edge's memory is the bytes of its unsettled deliveries, at most twice the
    # dispatcher's pending bytes. Past that, a delivery is refused `server-busy` at once.
    server = await amqp_server(
        {
            "SBGATE_MAX_PENDING_BYTES": str(64 * 1024),
            "SBGATE_MAX_BATCH_BYTES": str(64 * 1024),
            "SBGATE_MAX_MESSAGE_BYTES": str(64 * 1024),
            "SBGATE_SEND_TIMEOUT": "1",
            "SBGATE_ADMISSION_TIMEOUT": "1",
        }
    )
    await control.add_fault("primary", "amqp:internal-error", operation="send", mode="hang")
    conn = connection_string(server.ports["plain"])
    held: list[int] = []

    async def one(sender: Any, i: int) -> BaseException | None:
        try:
            await sender.send_messages(ServiceBusMessage(b"x" * 10_000, message_id=f"h-{i}"))
        except ServiceBusError as err:
            held.append(server.held_bytes)
            return err
        return None

    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                outcomes = await asyncio.gather(*(one(sender, i) for i in range(30)))
    refused = [e for e in outcomes if e is not None and "holds its limit" in str(e)]
    assert refused, "30 x 10 kB against a 128 kB bound: some refused at once"
    assert all(isinstance(e, ServiceBusServerBusyError) for e in refused)
    assert max(held) <= 2 * 64 * 1024
    await eventually(lambda: server.held_bytes == 0, within=10)
    # Each refusal is counted and answered like a request (metrics, access line): an
    # operator sees why producers were told to back off.
    observer = server.edge.observer
    assert isinstance(observer, Metrics)
    sample = observer.registry.get_sample_value
    assert sample("sbgate_amqp_refused_total", {"kind": "delivery"}) == len(refused)
    busy = {"entity": "orders", "status": "503", "route": "none", "protocol": "amqp"}
    assert (sample("sbgate_http_requests_total", busy) or 0) >= len(refused)
