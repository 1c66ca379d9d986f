"""The real Node.js SDK (`@azure/service-bus`, pinned in tests/compat/node/package-lock.json
and installed by `make node-deps`) sending to the local broker: single, list, batch, twenty
concurrent sends on one sender, scheduling and cancelling.

Each send needs the broker to answer Node's `$cbs` put-token on the link its reply-to names
(Node's reply-to is its receiver's link name), and scheduling the same on `$management`: a
broker that gets it wrong leaves the client waiting, so every run has a process deadline.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from sblocal.server import LocalBroker
from sblocal.testing import BrokerProcess, ControlClient
from tests.broker.conftest import fast_config, running
from tests.support.node import NODE, run_job

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(NODE is None, reason="node is not installed (`make sysdeps` installs it)"),
]


async def run_node(job: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    return await run_job(job, env=env)


def _job(
    broker: BrokerProcess | LocalBroker, *steps: dict[str, Any], entity: str = "orders"
) -> dict[str, Any]:
    return {
        "connectionString": broker.connection_string("primary"),
        "entity": entity,
        "steps": list(steps),
    }


def _messages(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {"body": f"{prefix} {i}", "messageId": f"{prefix}-{i}", "applicationProperties": {"i": i}}
        for i in range(n)
    ]


async def _stored(control: ControlClient, entity: str = "orders") -> list[dict[str, Any]]:
    return await control.messages("primary", entity, limit=1000)


async def test_single_and_list_sends_arrive_intact(broker: BrokerProcess, control: ControlClient):
    single = {
        "body": "hello from node",
        "messageId": "node-1",
        "subject": "greeting",
        "applicationProperties": {"origin": "node", "n": 7, "ok": True},
    }
    result = await run_node(
        _job(
            broker,
            {"op": "send", "messages": [single]},
            {"op": "send", "messages": _messages("list", 2)},
        )
    )
    assert result == {"ok": True, "steps": [{"sent": 1}, {"sent": 2}]}
    stored = await _stored(control)
    assert [m["message_id"] for m in stored] == ["node-1", "list-0", "list-1"]
    first = stored[0]
    assert first["subject"] == "greeting"
    assert first["application_properties"] == {"origin": "node", "n": 7, "ok": True}
    assert "hello from node" in json.dumps(first["body_value"] or first["body_text"])


async def test_a_batch_is_stored_as_its_messages(broker: BrokerProcess, control: ControlClient):
    result = await run_node(_job(broker, {"op": "batch", "messages": _messages("batch", 3)}))
    assert result == {"ok": True, "steps": [{"sent": 3}]}
    stored = await _stored(control)
    assert [m["message_id"] for m in stored] == ["batch-0", "batch-1", "batch-2"]
    assert [m["application_properties"] for m in stored] == [{"i": 0}, {"i": 1}, {"i": 2}]


async def test_twenty_concurrent_sends_on_one_sender(broker: BrokerProcess, control: ControlClient):
    result = await run_node(_job(broker, {"op": "concurrent", "messages": _messages("c", 20)}))
    assert result == {"ok": True, "steps": [{"sent": 20}]}
    stored = await _stored(control)
    assert sorted(m["message_id"] for m in stored) == sorted(f"c-{i}" for i in range(20))


async def test_schedule_and_cancel(broker: BrokerProcess, control: ControlClient):
    step = {
        "op": "schedule",
        "messages": _messages("later", 2),
        "at": "2035-01-01T00:00:00Z",
        "cancel": [0],
    }
    result = await run_node(_job(broker, step))
    assert result["ok"], result
    (scheduled,) = result["steps"]
    first, second = (int(s) for s in scheduled["sequenceNumbers"])
    assert scheduled["cancelled"] == [str(first)]
    stored = await _stored(control)
    assert [(m["message_id"], m["sequence_number"], m["state"]) for m in stored] == [
        ("later-1", second, "scheduled")
    ]
    assert stored[0]["scheduled_enqueue_time"].startswith("2035-01-01T00:00:00")


async def test_an_unknown_entity_fails_the_send_instead_of_hanging(broker: BrokerProcess):
    result = await run_node(
        _job(broker, {"op": "send", "messages": _messages("x", 1)}, entity="no-such-queue")
    )
    assert result["ok"] is False
    assert result["error"]["code"] == "MessagingEntityNotFound", result


async def test_sends_over_amqps_trusting_the_development_certificate():
    """Node keeps the connection string's port with TLS on (the Python SDK would dial 5671)
    and trusts an extra CA through NODE_EXTRA_CA_CERTS."""
    async with running(fast_config(amqp_tls=True)) as tls_broker:
        assert tls_broker.ca_cert is not None
        env = {**os.environ, "NODE_EXTRA_CA_CERTS": tls_broker.ca_cert}
        job = _job(tls_broker, {"op": "batch", "messages": _messages("tls", 2)})
        result = await run_node(job, env=env)
        assert result == {"ok": True, "steps": [{"sent": 2}]}
        assert tls_broker.namespace("primary").counters.messages_received == 2
