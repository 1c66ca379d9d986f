"""The AMQP edge end to end: the real Python SDK (7.15.0), unmodified, given only a
connection string that names the gateway, sends through it to the local broker.

The gateway runs in process (`create_app`, the production runner); the SDK dials its plain
listener (``UseDevelopmentEmulator=true``). Every SDK call is under a deadline: a protocol
mismatch shows as a client that waits forever, and must fail the test instead.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient

from gateway.amqp.server import AMQP_SERVER
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_syphon import receive_all
from tests.support.processes import free_port
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEND_KEY = "c2VuZGVyLWtleS1mb3ItdGVzdHMtb25seS0wMDAwMDAwMDA="
OTHER_KEY = "b3RoZXIta2V5LWZvci10ZXN0cy1vbmx5LTAwMDAwMDAwMDA="
RULES = json.dumps(
    {
        "rules": [
            {"name": "sender", "primary_key": SEND_KEY, "rights": ["Send"], "entities": ["*"]},
            {
                "name": "orders-only",
                "primary_key": OTHER_KEY,
                "rights": ["Send"],
                "entities": ["orders"],
            },
        ]
    }
)
AUTH = {"SBGATE_AUTH_RULES": RULES, "SBGATE_PUBLIC_HOSTS": "localhost"}
DEADLINE = 30.0  # every SDK call; the gateway answers within admission + send timeouts

Connect = Callable[..., Awaitable[str]]


def connection_string(port: int, key_name: str = "sender", key: str = SEND_KEY) -> str:
    return (
        f"Endpoint=sb://localhost:{port};SharedAccessKeyName={key_name};"
        f"SharedAccessKey={key};UseDevelopmentEmulator=true"
    )


@pytest.fixture
async def amqp_gateway(gateway: GatewayFactory) -> AsyncIterator[Connect]:
    """Start a gateway with the AMQP plain listener; returns its connection string."""

    async def start(env: dict[str, str] | None = None, **kw: Any) -> str:
        gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH, **(env or {})})
        port = gw.app[AMQP_SERVER].ports["plain"]
        return connection_string(port, **kw)

    yield start


async def send(conn: str, entity: str, messages: Any, *, topic: bool = False) -> None:
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            sender = sb.get_topic_sender(entity) if topic else sb.get_queue_sender(entity)
            async with sender:
                await sender.send_messages(messages)


async def receive(broker: BrokerProcess, count: int, queue: str = "orders") -> list[Any]:
    out: list[ServiceBusReceivedMessage] = []

    async def enough() -> bool:
        out.extend(await receive_all(broker, queue))
        return len(out) >= count

    await eventually(enough, within=20, every=0.2)
    assert len(out) == count
    return out


async def test_a_single_message_arrives_with_its_properties(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    sent = ServiceBusMessage(
        b"hello",
        message_id="m-1",
        correlation_id="c-1",
        subject="greeting",
        content_type="text/plain",
        time_to_live=dt.timedelta(hours=1),
        application_properties={"tenant": "t1", "n": 7, "ratio": 0.5, "ok": True},
    )
    await send(conn, "orders", sent)
    [got] = await receive(broker, 1)
    assert got.message_id == "m-1" and got.correlation_id == "c-1"
    assert got.subject == "greeting" and got.content_type == "text/plain"
    assert b"".join(got.body) == b"hello"
    assert got.time_to_live == dt.timedelta(hours=1)
    props = {k.decode(): v for k, v in (got.application_properties or {}).items()}
    assert props == {"tenant": b"t1", "n": 7, "ratio": 0.5, "ok": True}
