"""`make run` and unmodified SDK apps: the banner's connection string is all they are given.

The Makefile's own command (`gateway serve --dev`, with its embedded broker pair) prints the
string; the real Python SDK and the real Node.js SDK (tests/compat/node) send with it; with
the primary faulted through the broker's control API (the banner's too) their sends still
return, and once the fault is cleared the messages reach `orders`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from sblocal.testing import ControlClient
from tests.gateway.test_amqp_node import run_node
from tests.support.node import INSTALLED, NODE
from tests.support.processes import GatewayProcess, free_port
from tests.support.waiting import eventually
from tests.test_readme import make_run_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_STRING = re.compile(r"Endpoint=sb://\S+;UseDevelopmentEmulator=true")
_CONTROL = re.compile(r"control API: (http://\S+)")


async def test_an_unmodified_sdk_app_sends_with_the_banners_string(tmp_path: Path) -> None:
    command, *args = make_run_command(tmp_path / "banner.txt")
    env = {
        "PYTHONUNBUFFERED": "1",
        "SBGATE_AMQP_PLAIN_PORT": str(free_port()),  # make run's 5672 may be taken here
        "SBGATE_FAILOVER_INTERVAL": "0",  # fail over at the first fault: a short test
    }
    gw = GatewayProcess(
        "make-run", env, port=free_port(), log_dir=tmp_path, command=command, args=args
    )
    async with gw:
        await eventually(lambda: _STRING.search(gw.printed()) is not None, within=60, every=0.2)
        banner = gw.printed()
        match, control_match = _STRING.search(banner), _CONTROL.search(banner)
        assert match is not None and control_match is not None, banner
        conn, control = match.group(0), ControlClient(control_match.group(1))

        async def send(*ids: str) -> None:
            async with asyncio.timeout(60):  # the SDK's own retries, as an app has them
                async with ServiceBusClient.from_connection_string(conn) as sb:
                    async with sb.get_queue_sender("orders") as sender:
                        for mid in ids:
                            await sender.send_messages(ServiceBusMessage(b"app", message_id=mid))

        node = NODE is not None and INSTALLED  # the Node tier (make node-deps)

        async def send_node(*ids: str) -> None:
            if node:
                msgs = [{"body": "node app", "messageId": mid} for mid in ids]
                result = await run_node(conn, {"op": "sendEach", "messages": msgs})
                assert result["ok"], result

        await send("app-1")
        await send_node("node-1")
        await control.add_fault("primary", "amqp:internal-error", operation="send")
        await send("app-2", "app-3")  # they return: accepted into a backlog queue
        await send_node("node-2", "node-3")
        expected = ["app-1", "app-2", "app-3"] + (["node-1", "node-2", "node-3"] if node else [])
        assert (await control.entity("primary", "orders"))["active"] == (2 if node else 1)
        await control.clear_faults("primary")

        async def home() -> bool:
            return (await control.entity("primary", "orders"))["active"] == len(expected)

        await eventually(home, within=60, every=0.5)  # the dev profile pings every 5 s
        ids = sorted(m["message_id"] for m in await control.messages("primary", "orders"))
        assert ids == expected
