"""Overload: a request waits at most `admission_timeout` for room *and* for a sender.

Requests that pile up behind busy senders (a slow or unreachable broker) are refused with
503 + Retry-After once their wait is over, and never sent; what the gateway holds in memory is
then bounded by the arrival rate times `admission_timeout`, not by how long the broker stays
away. (bench/outage_bench.py and bench/overload_bench.py measure the memory.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.message import OutboundMessage
from gateway.errors import Saturated
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.fakes import FakeClient, FakeSender, msg
from tests.support.waiting import eventually, no_hang


@pytest.fixture
async def dispatcher():
    made: list[Dispatcher] = []

    def factory(limits: LimitSettings, timeouts: TimeoutSettings) -> Dispatcher:
        d = Dispatcher(limits, timeouts)
        made.append(d)
        return d

    yield factory
    for d in made:
        await d.close(grace=0.5)


async def test_a_request_no_sender_takes_in_time_is_refused_and_never_sent(dispatcher):
    release = asyncio.Event()

    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await release.wait()  # the broker does not answer until told to

    client = FakeClient(behaviour=behaviour)
    d = dispatcher(
        LimitSettings(max_in_flight=1, senders_per_entity=1, admission_timeout=0.05),
        TimeoutSettings(send_timeout=60),
    )
    dest = Destination(client, "orders")
    first = asyncio.create_task(d.send(dest, [msg("first")]))
    await eventually(lambda: bool(client.batches))
    # The byte budget has plenty of room: only the busy sender keeps these waiting.
    waiting = [asyncio.create_task(d.send(dest, [msg(f"w{i}")])) for i in range(5)]
    async with no_hang("requests waiting behind a sender that never finishes"):
        results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, Saturated) for r in results), results
    assert {r.status for r in results} == {503}  # type: ignore[union-attr]
    assert all(r.retry_after for r in results)  # type: ignore[union-attr]
    assert d.pending_messages() == 0, "the refused requests left the queue"
    release.set()
    await first
    # `first` was taken before the others and outlived their deadline: not refused.
    assert client.sent_ids() == ["first"], "a refused request is never sent"
    assert d.gate.used == 0


class _SlowToOpen(FakeClient):
    """A namespace whose senders open only when `opened_ok` is set (one that is away)."""

    def __init__(self) -> None:
        super().__init__()
        self.opening = asyncio.Event()
        self.opened_ok = asyncio.Event()

    async def open_sender(self, path: str) -> FakeSender:
        self.opening.set()
        await self.opened_ok.wait()
        return await super().open_sender(path)


async def test_requests_are_refused_in_time_while_a_sender_is_still_opening(dispatcher):
    client = _SlowToOpen()
    d = dispatcher(
        LimitSettings(max_in_flight=1, senders_per_entity=1, admission_timeout=0.05),
        TimeoutSettings(send_timeout=60, connect_timeout=60),
    )
    dest = Destination(client, "orders")
    early = [asyncio.create_task(d.send(dest, [msg(f"e{i}")])) for i in range(3)]
    await client.opening.wait()
    async with no_hang("requests waiting for a sender that is still opening"):
        results = await asyncio.gather(*early, return_exceptions=True)
    assert all(isinstance(r, Saturated) for r in results), results
    assert client.batches == [], "nothing was taken, so nothing was sent"
    client.opened_ok.set()
    await d.send(dest, [msg("later")])
    assert client.sent_ids() == ["later"]
    assert d.gate.used == 0


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
    assert (await gw.post("/orders/messages", data=b"warm")).status == 201
    await control.set_latency("primary", round_trip_ms=1000, store_ms=0)
    first = asyncio.create_task(gw.post("/orders/messages", data=b"first"))
    await eventually(lambda: _sending(gw), what="the first request is with the broker")
    async with no_hang("requests behind a sender busy with a slow broker"):
        resps = await asyncio.gather(*(gw.post("/orders/messages", data=b"x") for _ in range(10)))
        assert (await first).status == 201
    assert {r.status for r in resps} == {503}
    assert [(await r.json())["error"] for r in resps] == ["saturated"] * 10
    assert all(int(r.headers["Retry-After"]) >= 1 for r in resps)
    stored = (await control.entity("primary", "orders"))["active"]
    assert stored == 2, "exactly the accepted requests were stored"


async def _sending(gw) -> bool:
    text = await (await gw.get("/metrics")).text()
    return "sbgate_broker_sends_in_flight 1.0" in text
