"""An idle pause with the real Node SDK: a sender sends, stays idle longer than its
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
habits.mjs) to 2 s, so a 6 s pause outlasts what rhea tolerates; the slow one keeps the
default and pauses 125 s. The Python SDK's sender asks for no idle timeout (its open
carries none: test_amqp_sdk_refresh.py checks it), so it needs no heartbeats.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.app import AMQP_SERVER
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, connection_string
from tests.support.node import INSTALLED, NODE, run_job
from tests.support.processes import free_port
from tests.support.relay import Relay

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None or not INSTALLED,
        reason="the Node SDK tier (tests/compat/node) is not installed",
    ),
]

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


async def test_a_node_sender_survives_an_idle_pause_longer_than_its_idle_timeout(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    await idle_pause(gateway, control, idle_ms=2_000, pause_ms=6_000)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_node_sender_survives_an_idle_pause_with_the_default_60_s_timeout(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    await idle_pause(gateway, control, idle_ms=None, pause_ms=125_000)
