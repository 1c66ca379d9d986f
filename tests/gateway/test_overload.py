"""Overload: a request waits at most `admission_timeout` for room *and* for a sender.

Requests that pile up behind busy senders (a slow or unreachable broker) are refused with
503 + Retry-After once their wait is over, and never sent; what the gateway holds in memory is
then bounded by the arrival rate times `admission_timeout`, not by how long the broker stays
away. (tests/gateway/test_dispatcher.py has the dispatcher's side; bench/outage_bench.py and
bench/overload_bench.py measure the memory.)
"""

from __future__ import annotations

import asyncio

from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually, no_hang


async def test_a_slow_broker_gets_503s_with_retry_after_for_what_waits_and_stores_the_rest(
    gateway: GatewayFactory, control: ControlClient
):
    gw = await gateway(
        {
            "SBGATE_MAX_IN_FLIGHT": "1",
            "SBGATE_SENDERS_PER_ENTITY": "1",
            "SBGATE_ADMISSION_TIMEOUT": "0.05",
            "SBGATE_SEND_TIMEOUT": "30",
        }
    )

    async def warm() -> bool:
        return (await gw.post("/orders/messages", data=b"warm")).status == 201

    # The sender opens on first use (a request may expire while it opens): once one request
    # is stored, the requests below wait for a busy sender, not for an opening one.
    await eventually(warm)
    warmed = (await control.entity("primary", "orders"))["active"]
    await control.set_latency("primary", round_trip_ms=1000, store_ms=0)
    first = asyncio.create_task(gw.post("/orders/messages", data=b"first"))
    await eventually(lambda: _sending(gw), what="the first request is with the broker")
    async with no_hang("requests behind a sender busy with a slow broker"):
        resps = await asyncio.gather(*(gw.post("/orders/messages", data=b"x") for _ in range(10)))
        assert (await first).status == 201
    assert {r.status for r in resps} == {503}
    assert [(await r.json())["error"] for r in resps] == ["saturated"] * 10
    assert all(int(r.headers["Retry-After"]) >= 1 for r in resps)
    stored = (await control.entity("primary", "orders"))["active"] - warmed
    assert stored == 1, "exactly the accepted requests were stored"


async def _sending(gw) -> bool:
    text = await (await gw.get("/metrics")).text()
    return "sbgate_broker_sends_in_flight 1.0" in text
