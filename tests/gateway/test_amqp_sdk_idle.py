"""An idle pause with the real SDKs: a sender sends, stays idle longer than its
connection's idle timeout, and sends again on the same sender and the same connection.

The Node SDK (@azure/core-amqp under @azure/service-bus 7.9.5) asks for an idle timeout of
60 s in its open and has no option to change it; its AMQP library (rhea) closes the
connection with `amqp:resource-limit-exceeded` once nothing has arrived for twice that,
and the SDK then opens a new connection on the next send, which the application never
sees. So the gateway must send heartbeats (empty frames) at half the timeout the client
asks for, and the evidence is on the wire: a relay (tests/support/relay.py) between the SDK
and the gateway sees the timeout in the client's open, the gateway's empty frames during
the pause, and a single TCP connection throughout.

The short test sets the SDK's default (the one constant its connection options read,
habits.mjs) to 3 s, so an 8 s pause outlasts what rhea tolerates; the slow one keeps the
default and pauses 125 s.

The Python SDK's sender asks for no idle timeout (its open carries none:
test_amqp_sdk_refresh.py checks it), so it needs no heartbeats; it also sends none of its
own while idle (it talks when it sends), which is why the gateway advertises no idle
timeout by default: with one set, an idle Python sender is cut off, and its next send
fails with a connection error (which the SDK retries, on a new connection).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import ServiceBusConnectionError

from gateway.app import AMQP_SERVER
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, DEADLINE, connection_string
from tests.support.node import INSTALLED, NODE, run_job
from tests.support.processes import free_port
from tests.support.relay import Relay
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODE_SKIP = pytest.mark.skipif(
    NODE is None or not INSTALLED, reason="the Node SDK tier (tests/compat/node) is not installed"
)

NODE_DEFAULT_IDLE_MS = 60_000  # @azure/core-amqp's defaultConnectionIdleTimeoutInMs


async def idle_pause(
    gateway: GatewayFactory, control: ControlClient, *, idle_ms: int | None, pause_ms: int
) -> None:
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH})
    server = gw.app[AMQP_SERVER]
    async with Relay(server.ports["plain"]) as relay:
        job: dict[str, Any] = {
            "connectionString": connection_string(relay.port),
            "entity": "orders",
            "steps": [
                {"op": "send", "messageId": "before-idle"},
                {"op": "idle", "ms": pause_ms},
                {"op": "send", "messageId": "after-idle"},
            ],
        }
        if idle_ms is not None:
            job["idleTimeoutMs"] = idle_ms
        result = await run_job(job, script="habits.mjs", deadline=pause_ms / 1000 + 60)
        assert result["ok"], result
        assert len(relay.connections) == 1, "the same connection: not closed and replaced"
        [conn] = relay.connections
        asked = idle_ms or NODE_DEFAULT_IDLE_MS
        assert conn.client_idle_timeout_ms() == asked, "what Node asks for in its open"
        assert pause_ms > 2 * asked, "longer than the client tolerates silence"
        # Nothing but heartbeats crossed during the pause: the gateway's kept it open.
        assert len(conn.heartbeats_to_client()) >= 2
    stored = await control.messages("primary", "orders", limit=10)
    assert sorted(m["message_id"] for m in stored) == ["after-idle", "before-idle"]


@NODE_SKIP
async def test_a_node_sender_survives_an_idle_pause_longer_than_its_idle_timeout(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    await idle_pause(gateway, control, idle_ms=3_000, pause_ms=8_000)


@NODE_SKIP
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_node_sender_survives_an_idle_pause_with_the_default_60_s_timeout(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    await idle_pause(gateway, control, idle_ms=None, pause_ms=125_000)


PYTHON_PAUSE = 10.0  # seconds idle: more than twice the gateway's idle timeout below


@pytest.mark.parametrize("gateway_idle_timeout", ["0", "4"])
async def test_a_python_sender_idles_without_heartbeats(
    gateway: GatewayFactory, control: ControlClient, gateway_idle_timeout: str
) -> None:
    env = {"SBGATE_AMQP_IDLE_TIMEOUT": gateway_idle_timeout}
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH, **env})
    server = gw.app[AMQP_SERVER]
    async with Relay(server.ports["plain"]) as relay:
        conn_str = connection_string(relay.port)
        async with asyncio.timeout(DEADLINE + PYTHON_PAUSE):
            async with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as sb:
                async with sb.get_queue_sender("orders") as sender:
                    await sender.send_messages(ServiceBusMessage(b"1", message_id="py-before"))
                    paused = time.monotonic()
                    await eventually(
                        lambda: time.monotonic() > paused + PYTHON_PAUSE,
                        within=PYTHON_PAUSE + 5,
                        every=0.5,
                        what="the idle pause",
                    )
                    after = ServiceBusMessage(b"2", message_id="py-after")
                    if gateway_idle_timeout == "0":
                        await sender.send_messages(after)
                    else:
                        with pytest.raises(ServiceBusConnectionError):
                            await sender.send_messages(after)
        [conn] = relay.connections
        assert conn.client_idle_timeout_ms() is None
        closed = conn.gateway_close()
    stored = sorted(m["message_id"] for m in await control.messages("primary", "orders"))
    if gateway_idle_timeout == "0":
        # Nothing on the wire for the pause, and the connection is still good.
        assert stored == ["py-after", "py-before"]
    else:
        # At most a stray empty frame from the client: the gateway closed it as idle.
        assert closed is not None and closed[1] == "amqp:resource-limit-exceeded"
        assert stored == ["py-before"]
