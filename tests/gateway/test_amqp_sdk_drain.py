"""Drain under load with both real SDKs: a replica shuts down while a Node sender and Python
senders are mid-stream, behind a load balancer that moves on to another replica.

The load balancer is a relay per SDK (tests/support/relay.py), which also reads the
frames. What must show:

* on the wire, every sending connection to the draining replica has its sender link's
  credit go to 0, then is closed with `amqp:connection:forced`;
* the SDKs, with retries on (their defaults for Python; Node's count with a short delay,
  its default being 30 s), reconnect through the relay to the other replica and finish
  their streams: no error reaches a Python application, so every error the drain caused
  was one its SDK retries;
* Node (7.9.5) also finishes, but in up to half the runs here only with one retry of the
  application's own: a race in the SDK itself fails one send with a plain, unretried
  ``Error: Failed to connect``. The send after the close re-opens the old connection
  object (its `$cbs` session opens the connection when it finds it closed) while the SDK's
  own disconnect handler is still replacing it, and that handler then closes the
  connection just opened (the relay shows it: a new connection, SASL and open, closed by
  the client at once). Nothing the gateway sends after `connection:forced` changes it;
  the send was never transferred, so the application's retry stores it once
  (docs/amqp.md);
* every send an SDK saw accepted is at the primary, once or more (a retried send that the
  first replica had stored before it closed is stored again: no message ids are checked
  for duplicates, as with Service Bus itself without duplicate detection).

tests/gateway/test_amqp_sdk.py keeps the retry-less case (the Python SDK sees
`ServiceBusConnectionError`, never for an accepted send).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from gateway.app import AMQP_SERVER
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, connection_string
from tests.gateway.test_syphon import receive_all
from tests.support.node import INSTALLED, NODE, run_job
from tests.support.processes import free_port
from tests.support.relay import Connection, Relay
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None or not INSTALLED,
        reason="the Node SDK tier (tests/compat/node) is not installed",
    ),
]

DEADLINE = 120.0  # the whole exchange; each SDK's own operation timeout is inside it
STREAM = 300  # sends a sender makes, one after the other
PYTHON_SENDERS = 2
BEFORE_DRAIN = 20  # sends each SDK has had accepted when the drain starts


def drained_then_forced(conn: Connection) -> None:
    """The gateway flowed the sender link to credit 0, then closed `connection:forced`."""
    closed = conn.gateway_close()
    assert closed is not None, "the draining replica closed the connection"
    at, condition = closed
    assert condition == "amqp:connection:forced"
    zero = [t for t, _handle, credit in conn.credit_to_client() if credit == 0]
    assert zero and min(zero) <= at, "credit 0 before the close"


async def python_sender(n: int, relay: Relay, acknowledged: list[str], done: Path) -> None:
    """Send py-n-0, py-n-1... one after the other: STREAM, and on until `done` exists."""
    conn = connection_string(relay.port)
    async with ServiceBusClient.from_connection_string(conn) as sb:  # default retries
        async with sb.get_queue_sender("orders") as sender:
            i = 0
            while i < STREAM or not done.exists():
                mid = f"py-{n}-{i}"
                await sender.send_messages(ServiceBusMessage(b"x", message_id=mid))
                acknowledged.append(mid)
                i += 1


def moved_on(relays: tuple[Relay, ...], port: int) -> bool:
    """Has each relay's client sent a message through a connection to `port`?"""
    return all(
        any(c.transfers_to("orders") for c in r.connections if c.target_port == port)
        for r in relays
    )


async def test_a_drain_under_node_and_python_load_loses_nothing_and_the_sdks_retry(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient, tmp_path: Path
) -> None:
    env = {"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH}
    draining = await gateway(env)
    other = await gateway({**env, "SBGATE_AMQP_PLAIN_PORT": str(free_port())})
    first = draining.app[AMQP_SERVER].ports["plain"]
    acknowledged: list[str] = []
    # Every stream goes on past STREAM until both SDKs sent through the other replica: on a
    # fast machine Node finished its 300 sends before the Python senders had 20, so before
    # the drain began.
    done = tmp_path / "done"

    async with Relay(first) as node_relay, Relay(first) as py_relay:
        job: dict[str, Any] = {
            "connectionString": connection_string(node_relay.port),
            "entity": "orders",
            "retry": {"maxRetries": 3, "retryDelayInMs": 500},
            # One retry of the application's own, for the SDK's race (module docstring).
            "steps": [
                {
                    "op": "stream",
                    "prefix": "node",
                    "count": STREAM,
                    "appRetries": 1,
                    "until": str(done),
                }
            ],
        }
        async with asyncio.timeout(DEADLINE):
            node = asyncio.create_task(run_job(job, script="habits.mjs", deadline=DEADLINE))
            senders = [
                asyncio.create_task(python_sender(n, py_relay, acknowledged, done))
                for n in range(PYTHON_SENDERS)
            ]
            tasks = [node, *senders]
            try:

                def mid_stream() -> bool:
                    node_sent = sum(c.transfers_to("orders") for c in node_relay.connections)
                    return node_sent >= BEFORE_DRAIN and len(acknowledged) >= BEFORE_DRAIN

                await eventually(mid_stream, within=60, every=0.05, what="both SDKs sending")
                other_port = other.app[AMQP_SERVER].ports["plain"]
                node_relay.retarget(other_port)
                py_relay.retarget(other_port)
                await draining.close()  # the app's cleanup: the AMQP edge drains first
                relays = (node_relay, py_relay)
                await eventually(
                    lambda: moved_on(relays, other_port), within=60, every=0.05, what="moved"
                )
                done.touch()
                result = await node
                await asyncio.gather(*senders)  # a Python error fails the test here
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        node_connections = list(node_relay.connections)
        py_connections = list(py_relay.connections)

    # Python: no error reached the application (its default retries), every send done.
    assert len(acknowledged) >= PYTHON_SENDERS * STREAM
    # Node: done, the SDK's retries aside with at most its own reconnect race (module
    # docstring) for the application to retry: a plain `Error`, for a send never accepted.
    assert result["ok"], result
    assert len(result["acknowledged"]) >= STREAM
    race = {"name": "Error", "message": "Failed to connect"}
    assert all({k: v for k, v in e.items() if v is not None} == race for e in result["appRetried"])
    # Each SDK was on the draining replica, then reconnected to the other.
    for connections, clients in ((node_connections, 1), (py_connections, PYTHON_SENDERS)):
        drained = [c for c in connections if c.target_port == first]
        assert len(drained) == clients, "one connection each to the draining replica"
        assert len(connections) > clients, "and a reconnect to the other"
        for conn in drained:
            drained_then_forced(conn)
    stored = {m.message_id for m in await receive_all(broker, "orders")}
    assert set(result["acknowledged"]) <= stored, "every send Node saw accepted is stored"
    assert set(acknowledged) <= stored, "every send Python saw accepted is stored"
