"""Every request all or none, and never stored twice (issue 33), end to end: the real SDK
over AMQP against the local broker. Each test reproduces one report and failed before its
fix: the size bound (tests/gateway/test_size_bound.py holds it to the encoder), the split
that stored part of a call, and the bisection that sent the stored part again."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.metrics import Metrics
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A gateway whose limits are above the broker's (a Premium setting in front of a Standard
# entity, or any mismatch): only the link can refuse, and it must refuse before storing.
LOOSE = {
    "SBGATE_MAX_MESSAGE_BYTES": str(1024 * 1024),
    "SBGATE_MAX_BATCH_BYTES": str(2 * 1024 * 1024),
    "SBGATE_MAX_BODY_BYTES": str(4 * 1024 * 1024),
    "SBGATE_SENDERS_PER_ENTITY": "1",
    "SBGATE_SDK_RETRY_TOTAL": "0",
}
BATCH = {"Content-Type": "application/vnd.microsoft.servicebus.json"}


async def stored_ids(control: ControlClient, path: str = "orders") -> list[str]:
    return [m["message_id"] for m in await control.messages("primary", path, limit=1000)]


def hostile_item() -> dict[str, Any]:
    """The report's item: 120 properties of 246-character names and 256-character values,
    and a body that brings the old estimate to exactly 262,144 bytes (it encoded to 262,478,
    over the link's limit)."""
    props = {f"{i:03d}" + "n" * 243: "v" * 256 for i in range(120)}
    return {
        "Body": "b" * 201_351,
        "BrokerProperties": {"MessageId": "hostile"},
        "UserProperties": props,
    }


async def test_the_reported_item_is_refused_at_the_edge_and_nothing_of_its_request_is_stored(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway()
    items = [{"Body": "small", "BrokerProperties": {"MessageId": "small"}}, hostile_item()]
    for body in ([hostile_item()], items):
        r = await gw.post("/queues/orders/messages", data=orjson.dumps(body), headers=BATCH)
        assert r.status == 413, await r.text()
        assert (await r.json())["error"] == "payload_too_large"
    assert await stored_ids(control) == []


async def test_a_request_the_link_refuses_stores_none_of_its_messages(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    """`[small, big]`, within the gateway's limits but not the link's: answered 413 while
    `small` was stored (the batch built so far went out before the big one was refused)."""
    gw = await gateway(LOOSE)
    items = [
        {"Body": "small", "BrokerProperties": {"MessageId": "small"}},
        {"Body": "x" * 300_000, "BrokerProperties": {"MessageId": "big"}},
    ]
    r = await gw.post("/queues/orders/messages", data=orjson.dumps(items), headers=BATCH)
    assert r.status == 413, await r.text()
    assert (await r.json())["error"] == "upstream_message_too_large"
    assert await stored_ids(control) == []


async def test_an_innocent_request_sharing_a_batch_with_a_refused_one_is_stored_once(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    """The report: a first request holds the sender (store latency), an innocent single
    message and an oversized one wait and share the next micro-batch. The split stored
    `innocent`, then the oversized one was refused (a message fault), and the bisection sent
    `innocent` again: answers 201 and 413, queue `[first, innocent, innocent]`."""
    metrics = Metrics()
    gw = await gateway(LOOSE, metrics=metrics)
    await control.set_latency("primary", store_ms=500)  # the first send holds the sender

    def post(message_id: str, body: bytes) -> Any:
        props = orjson.dumps({"MessageId": message_id}).decode()
        return gw.post("/queues/orders/messages", data=body, headers={"BrokerProperties": props})

    first = asyncio.create_task(post("first", b"first"))

    async def first_is_sending() -> bool:
        return (metrics.registry.get_sample_value("sbgate_broker_sends_in_flight") or 0) > 0

    await eventually(first_is_sending, within=10)
    answers = await asyncio.gather(
        first, post("innocent", b"innocent"), post("big", b"x" * 300_000)
    )
    assert [a.status for a in answers] == [201, 201, 413], [await a.text() for a in answers]
    assert sorted(await stored_ids(control)) == ["first", "innocent"]
    splits = metrics.registry.get_sample_value("sbgate_batch_splits_total")
    assert splits is not None and splits > 0, "innocent and big shared a batch, then bisected"
