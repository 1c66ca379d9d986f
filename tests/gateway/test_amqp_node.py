"""The AMQP edge with the real Node.js SDK (`@azure/service-bus` 7.9.5, run by
tests/compat/node/run.mjs from its lockfile): the habits the Python SDK does not have — a
reply-to that names its `$cbs` receiver link, string message ids, a session per link, an
idle timeout that wants heartbeats, uint application properties, twenty sends in flight on
one sender — through the gateway to the local broker, with the primary up and faulted.

Skipped where the Node tier is not installed (node, and `npm ci --ignore-scripts` in
tests/compat/node)."""

from __future__ import annotations

from typing import Any

import pytest

from sblocal.testing import ControlClient
from tests.gateway.test_amqp_sdk import Connect
from tests.gateway.test_amqp_sdk import amqp_gateway as amqp_gateway  # the fixture
from tests.gateway.test_syphon import SYPHON, backlog_total, depth
from tests.support.node import INSTALLED, NODE, NODE_DIR, run_job
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None or not INSTALLED or not (NODE_DIR / "run.mjs").exists(),
        reason="the Node SDK tier (tests/compat/node) is not installed",
    ),
]


async def run_node(conn: str, *steps: dict[str, Any], entity: str = "orders") -> dict[str, Any]:
    """One run.mjs job against the gateway at `conn`."""
    return await run_job({"connectionString": conn, "entity": entity, "steps": list(steps)})


def messages(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {"body": f"{prefix} {i}", "messageId": f"{prefix}-{i}", "applicationProperties": {"i": i}}
        for i in range(n)
    ]


async def stored(control: ControlClient, entity: str = "orders") -> list[dict[str, Any]]:
    return await control.messages("primary", entity, limit=1000)


async def test_single_list_batch_and_twenty_concurrent_sends(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    result = await run_node(
        conn,
        {"op": "sendEach", "messages": messages("one", 2)},
        {"op": "send", "messages": messages("list", 3)},
        {"op": "batch", "messages": messages("batch", 4)},
        {"op": "concurrent", "messages": messages("c", 20)},
    )
    assert result["ok"], result
    ids = sorted(m["message_id"] for m in await stored(control))
    assert len(ids) == 29 and "c-19" in ids and "batch-3" in ids


async def test_an_unknown_entity_and_a_wrong_key_fail_instead_of_hanging(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    result = await run_node(conn, {"op": "send", "messages": messages("x", 1)}, entity="nope")
    assert not result["ok"] and result["error"]["code"] == "MessagingEntityNotFound", result
    wrong = conn.replace("SharedAccessKey=", "SharedAccessKey=AAAA")
    result = await run_node(wrong, {"op": "send", "messages": messages("x", 1)})
    assert not result["ok"], result


async def test_with_the_primary_down_node_sends_return_and_arrive_home(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    conn = await amqp_gateway(SYPHON)
    result = await run_node(
        conn,
        {"op": "concurrent", "messages": messages("down", 10)},
        {"op": "batch", "messages": messages("downb", 5)},
    )
    assert result["ok"], result
    assert await backlog_total(control) == 15
    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", "orders") == 15

    await eventually(home, within=30, every=0.2)
    got = {m["message_id"]: m for m in await stored(control)}
    assert len(got) == 15
    # A JS number goes as an AMQP uint (rhea's choice), and comes home one.
    assert got["down-3"]["application_properties"] == {"i": 3}
