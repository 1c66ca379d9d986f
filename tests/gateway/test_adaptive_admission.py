"""Adaptive admission against the local broker: the limit follows the broker.

A gateway with adaptive admission on (a small initial limit) is kept busy by more concurrent
clients than the limit will allow once the broker slows down; the broker's latency is raised
and lowered (`ControlClient.set_latency`) and a server-busy fault added and removed, and the
namespace's limit, read from /metrics as an operator would, falls and recovers. Nothing is
timed: each step waits (`eventually`) for the limit to move in the expected direction.
The limiter's arithmetic is tested on a fake clock in tests/gateway/test_limiter.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = 24  # concurrent requests kept going: more than the limit once the broker slows
_LIMIT = re.compile(r'^sbgate_admission_limit\{namespace="primary"\} (\S+)$', re.M)
_BASELINE = re.compile(
    r'^sbgate_admission_limit_baseline_seconds\{namespace="primary"\} (\S+)$', re.M
)
_REFUSED = re.compile(r'^sbgate_admission_limit_refused_total\{namespace="primary"\} (\S+)$', re.M)
# With adaptive admission on, the HTTP edge's in-progress limit is the namespaces' limits
# summed, so most refusals over the limit happen at the request head, before the namespace's
# own limiter sees the request.
_SHED_AT_HEAD = re.compile(r'^sbgate_http_shed_total\{reason="in_progress"\} (\S+)$', re.M)


async def _metric(gw: Any, pattern: re.Pattern[str]) -> float:
    async with asyncio.timeout(10):
        text = await (await gw.get("/metrics")).text()
    found = pattern.search(text)
    return float(found.group(1)) if found else math.nan


@contextlib.asynccontextmanager
async def _load(gw: Any) -> AsyncIterator[dict[str, int]]:
    """CLIENTS clients posting one request after another until the block ends (cancelled and
    awaited then); a client answered 503 backs off briefly, as Retry-After asks (scaled
    down), so refusals do not spin the loop the gateway shares with this test."""
    statuses: dict[str, int] = {}
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            async with asyncio.timeout(30):
                resp = await gw.post("/orders/messages", data=b"m")
                await resp.read()
            key = str(resp.status)
            statuses[key] = statuses.get(key, 0) + 1
            if resp.status != 201:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        await stop.wait()

    tasks = [asyncio.create_task(client()) for _ in range(CLIENTS)]
    try:
        yield statuses
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if not isinstance(r, asyncio.CancelledError | type(None))]
        assert not errors, f"a load client failed: {errors[0]!r}"


async def test_the_limit_falls_when_the_broker_slows_and_recovers_when_it_is_fast_again(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway(
        {
            "SBGATE_ADAPTIVE_ADMISSION": "true",
            "SBGATE_ADAPTIVE_INITIAL_LIMIT": "32",
            "SBGATE_ADAPTIVE_MIN_LIMIT": "2",
            "SBGATE_SEND_TIMEOUT": "30",
            "SBGATE_ADMISSION_TIMEOUT": "30",
        }
    )
    async with _load(gw) as statuses:
        await eventually(
            lambda: _learned(gw), within=30, what="the baseline is learned from live traffic"
        )
        fast = await _metric(gw, _LIMIT)
        # Tenfold the latency the gateway learned (on a busy machine that baseline is the
        # CPU's queueing, not the broker's: a fixed 150 ms was within its tolerance there).
        baseline_ms = await _metric(gw, _BASELINE) * 1000
        slow_ms = round(min(1500.0, max(150.0, 10 * baseline_ms)))
        await control.set_latency("primary", round_trip_ms=slow_ms)
        await eventually(
            lambda: _below(gw, fast / 2), within=60, what="the limit falls with the broker slow"
        )
        # The limit can fall while every client's request is still in flight (admitted
        # under the higher limit); the refusals come as those settle and the clients retry.
        await eventually(
            lambda: _refused(gw), within=30, what="over the limit, requests were refused"
        )
        slow = await _metric(gw, _LIMIT)
        await control.set_latency("primary", round_trip_ms=0)
        await eventually(
            lambda: _above(gw, slow * 2), within=60, what="the limit recovers with the broker fast"
        )
    assert statuses.get("201", 0) > 0
    assert set(statuses) <= {"201", "503"}, statuses


async def test_server_busy_cuts_the_limit_and_it_recovers_when_the_broker_stops_refusing(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway(
        {
            "SBGATE_ADAPTIVE_ADMISSION": "true",
            "SBGATE_ADAPTIVE_INITIAL_LIMIT": "32",
            "SBGATE_ADAPTIVE_MIN_LIMIT": "2",
            "SBGATE_ENABLE_FAILOVER": "false",
        }
    )
    async with _load(gw) as statuses:
        await eventually(lambda: _learned(gw), within=30, what="the baseline is learned")
        before = await _metric(gw, _LIMIT)
        fault = await control.add_fault(
            "primary", "com.microsoft:server-busy", operation="send", entity="orders"
        )
        await eventually(
            lambda: _below(gw, before / 4), within=60, what="server-busy cuts the limit"
        )
        cut = await _metric(gw, _LIMIT)
        await control.remove_fault("primary", fault)
        await eventually(
            lambda: _above(gw, cut * 2), within=60, what="the limit grows back once stored again"
        )
    assert statuses.get("503", 0) > 0 and statuses.get("201", 0) > 0


async def _refused(gw: Any) -> bool:
    counts = [await _metric(gw, _REFUSED), await _metric(gw, _SHED_AT_HEAD)]
    return sum(0 if math.isnan(n) else n for n in counts) > 0


async def _learned(gw: Any) -> bool:
    return not math.isnan(await _metric(gw, _BASELINE))


async def _below(gw: Any, value: float) -> bool:
    return await _metric(gw, _LIMIT) < value


async def _above(gw: Any, value: float) -> bool:
    return await _metric(gw, _LIMIT) > value


_HEAD_LATENCY = re.compile(r"^sbgate_http_request_latency_seconds (\S+)$", re.M)
_HEAD_GOAL = re.compile(r"^sbgate_http_request_latency_goal_seconds (\S+)$", re.M)


async def test_the_heads_latency_and_its_goal_follow_a_slower_broker(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    """The in-progress limit at the head follows the requests' own latency: /metrics shows
    the last window's mean (head to answer) and the goal, which a slower broker raises
    (tolerance x its fastest send) so that its latency is not cut as the gateway's own."""
    gw = await gateway(
        {
            "SBGATE_ADAPTIVE_ADMISSION": "true",
            "SBGATE_ADAPTIVE_LATENCY_GOAL": "0.025",
            "SBGATE_SEND_TIMEOUT": "30",
        }
    )
    await control.set_latency("primary", round_trip_ms=80)

    async def measured() -> bool:
        return await _metric(gw, _HEAD_LATENCY) >= 0.08 and await _metric(gw, _HEAD_GOAL) >= 0.12

    async with _load(gw) as statuses:
        await eventually(
            measured, within=60, what="the head's latency and the goal raised by the broker"
        )
    assert statuses.get("201", 0) > 0
