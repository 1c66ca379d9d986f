"""Graceful shutdown with a real process and a real SIGTERM, under load: readiness fails at
once, requests keep being served during the drain delay, and no accepted request is cut.

"Cut" is checked the way Jepsen checks a queue: every message the broker stored must have
been answered 201, and every 201 must be stored. Connections still in the kernel's accept
backlog when the listener closes are reset without reaching the gateway (in Kubernetes the
drain delay lets the endpoints drop the pod first); they store nothing, so they cannot hide
a cut request from this check."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import aiohttp
import pytest

from sblocal.testing import BrokerProcess, ControlClient
from tests.support.processes import free_port, start_gateway, wait_ready
from tests.support.waiting import eventually

# A `gateway serve` subprocess under load, then SIGTERM.
pytestmark = pytest.mark.slow


async def test_sigterm_under_load_cuts_no_accepted_request(
    broker: BrokerProcess, control: ControlClient
):
    port = free_port()
    proc = await start_gateway(
        broker,
        port,
        SBGATE_DRAIN_DELAY="1",
        SBGATE_SHUTDOWN_TIMEOUT="10",
        SBGATE_LOG_LEVEL="WARNING",
    )
    base = f"http://127.0.0.1:{port}"
    outcomes: Counter[str] = Counter()
    accepted: set[str] = set()
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            await wait_ready(http, base)

            async def client(n: int) -> None:
                i = 0
                while not stop.is_set() and i < 2000:
                    mid = f"sd-{n}-{i}"
                    i += 1
                    try:
                        async with http.post(
                            f"{base}/queues/orders/messages",
                            data=b"x",
                            headers={"BrokerProperties": f'{{"MessageId": "{mid}"}}'},
                        ) as r:
                            outcomes[str(r.status)] += 1
                            if r.status == 201:
                                accepted.add(mid)
                    except aiohttp.ClientConnectorError:
                        outcomes["refused"] += 1  # never reached the server: not accepted
                        await asyncio.sleep(0.01)  # pacing a closed port, not waiting on state
                    except aiohttp.ClientError as exc:
                        outcomes[f"reset:{type(exc).__name__}"] += 1

            clients = [asyncio.create_task(client(n)) for n in range(16)]
            await eventually(lambda: len(accepted) >= 200, within=30)
            proc.send_signal(signal.SIGTERM)
            signalled_at = len(accepted)

            async def not_ready() -> bool:
                try:
                    async with http.get(f"{base}/readyz") as r:
                        return r.status == 503
                except aiohttp.ClientError:
                    return False

            await eventually(not_ready, within=2, every=0.02)
            async with asyncio.timeout(30):
                assert await proc.wait() == 0
            stop.set()
            await asyncio.gather(*clients)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert len(accepted) > signalled_at, "requests were still served during the drain delay"
    assert outcomes["refused"] > 0, f"the listener closed in the end: {dict(outcomes)}"
    assert not {k for k in outcomes if k.startswith("5")}, (
        f"no 5xx while draining: {dict(outcomes)}"
    )
    stored = {m["message_id"] for m in await control.messages("primary", "orders", limit=100_000)}
    assert stored - accepted == set(), "a stored message was never answered 201: a request was cut"
    assert accepted - stored == set(), "an accepted message is missing"
