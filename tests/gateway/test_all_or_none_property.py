"""Every request all or none, never stored twice (issue 33 item 8): a property test against
the local broker over real AMQP.

Hypothesis mixes near-limit, oversized, many-property and ordinary requests, single messages
and JSON batches, sent concurrently behind one sender (so they share micro-batches, and a
refused batch is bisected), with and without an injected broker fault: a rejected send
(nothing stored), or a lost outcome (the message stored, its transfer never settled). Two
gateways: one whose limits are the broker's (the size bound decides at the edge) and one
whose limits are above the link's (only the link can refuse). The properties, per request:

* a 2xx request's messages are each stored exactly once;
* a 4xx request stored nothing;
* a 503 request stored all of its messages once, or none of them (one request is one
  transfer: a lost outcome may have stored it, nothing ever stores part of it);
* a message is stored twice only through a source docs/failover.md names — none of them is
  reachable here (no failover, no client retry, the SDK's own retries off), so never.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_all_or_none import LOOSE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LIMIT = 256 * 1024
BATCH = "application/vnd.microsoft.servicebus.json"
BASE = {
    "SBGATE_ENABLE_FAILOVER": "false",
    "SBGATE_SENDERS_PER_ENTITY": "1",
    "SBGATE_SDK_RETRY_TOTAL": "0",
    "SBGATE_SEND_TIMEOUT": "2",
    "SBGATE_MAX_BODY_BYTES": str(4 * 1024 * 1024),
}
_ids = itertools.count()


@dataclass
class Request:
    ids: list[str]
    data: bytes
    headers: dict[str, str]


def _item(kind: str, n: int) -> dict[str, Any]:
    """One message of `kind`; `n` varies its size."""
    mid = f"m{next(_ids)}"
    if kind == "ordinary":
        return {"Body": "o" * (n % 2000), "BrokerProperties": {"MessageId": mid}}
    if kind == "many_properties":  # long names and values: str32 on the wire
        props = {f"{i:03d}" + "n" * 250: "v" * (256 + n % 50) for i in range(20 + n % 100)}
        return {"Body": "p", "BrokerProperties": {"MessageId": mid}, "UserProperties": props}
    if kind == "near_limit":  # around the limit: some fit, some do not, by a few bytes
        props = {f"{i:03d}" + "n" * 243: "v" * 256 for i in range(n % 60)}
        overhead = 120 + len(props) * (5 + 246 + 5 + 256) + 12
        body = LIMIT - overhead + (n % 4000) - 2000
        return {
            "Body": "b" * max(0, body),
            "BrokerProperties": {"MessageId": mid},
            "UserProperties": props,
        }
    assert kind == "oversize"
    return {"Body": "x" * (LIMIT + 1 + n), "BrokerProperties": {"MessageId": mid}}


def build(items: list[tuple[str, int]], batch: bool) -> Request:
    parts = [_item(kind, n) for kind, n in items]
    ids = [p["BrokerProperties"]["MessageId"] for p in parts]
    if batch:
        return Request(ids, orjson.dumps(parts), {"Content-Type": BATCH})
    (part,) = parts[:1]
    headers = {"BrokerProperties": orjson.dumps(part["BrokerProperties"]).decode()}
    if "UserProperties" in part:
        headers.update({k: orjson.dumps(v).decode() for k, v in part["UserProperties"].items()})
    return Request(ids[:1], part["Body"].encode(), headers)


_KINDS = st.sampled_from(["ordinary", "ordinary", "many_properties", "near_limit", "oversize"])
_ITEMS = st.lists(st.tuples(_KINDS, st.integers(0, 10_000)), min_size=1, max_size=4)
requests = st.lists(st.tuples(_ITEMS, st.booleans()), min_size=2, max_size=10)
faults = st.sampled_from([None, "reject", "lose-outcome"])


async def check(
    gw: Any,
    control: ControlClient,
    plan: list[tuple[list[tuple[str, int]], bool]],
    fault: str | None,
) -> None:
    reqs = [build(items, batch) for items, batch in plan]
    await control.set_latency("primary", store_ms=200)  # the first send holds the sender
    if fault == "reject":
        await control.add_fault(
            "primary", "amqp:internal-error", entity="orders", operation="send", count=1
        )
    elif fault == "lose-outcome":
        await control.add_fault(
            "primary",
            "amqp:internal-error",
            entity="orders",
            operation="send",
            count=1,
            mode="lose-outcome",
        )

    async def one(r: Request) -> tuple[Request, int, str]:
        resp = await gw.post("/queues/orders/messages", data=r.data, headers=r.headers)
        return r, resp.status, await resp.text()

    answers = await asyncio.gather(*(one(r) for r in reqs))
    stored = Counter(
        m["message_id"] for m in await control.messages("primary", "orders", limit=1000)
    )
    for r, status, text in answers:
        counts = [stored[i] for i in r.ids]
        if 200 <= status < 300:
            assert counts == [1] * len(r.ids), (status, text, counts)
        elif 400 <= status < 500:
            assert counts == [0] * len(r.ids), (status, text, counts)
        else:
            assert status == 503, (status, text)
            assert counts in ([0] * len(r.ids), [1] * len(r.ids)), (text, counts)
    ours = {i for r in reqs for i in r.ids}
    assert set(stored) <= ours and max(stored.values(), default=1) == 1, stored


@pytest.mark.timeout(300)
@pytest.mark.parametrize("limits", ["broker", "above-the-link"])
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=requests, fault=faults)
async def test_every_request_is_stored_all_or_none_and_never_twice(
    gateway: GatewayFactory,
    control: ControlClient,
    limits: str,
    plan: list[tuple[list[tuple[str, int]], bool]],
    fault: str | None,
) -> None:
    await control.reset()
    env = {**BASE, **(LOOSE if limits == "above-the-link" else {})}
    gw = await gateway({**env, "SBGATE_SDK_RETRY_TOTAL": "0", "SBGATE_SENDERS_PER_ENTITY": "1"})
    try:
        await check(gw, control, plan, fault)
    finally:
        await gw.close()
