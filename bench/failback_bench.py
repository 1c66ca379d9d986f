"""Failback -> backlog empty, with backlog writes racing the failback (printed, not asserted).

The gateway (in this process, with its real SDK clients and built-in syphon, syphon and
timeout settings at their defaults) in front of the local broker. Each round: an operator
fails `orders` over, a client sends 4 requests at once, and somewhere between 0 and 150 ms
later the operator marks the entity healthy, while the writes are still on their way: the
backlog link is slowed by 300 ms at the client port, as a backlog sender still opening was
in the field report. The time measured is from the later of the failback and the last 202
to the moment every message answered 202 has left the backlog and is at home.

docs/failover.md states the bound ``1 s + receive_wait + send_timeout`` (16 s at the defaults);
the goal is p99 within it, and <= 2 s at the defaults. Without the wake-ups these rounds
wait for the safety check (`idle_check_interval`, 15 min): they show as "not home".

    .venv/bin/python -m bench.failback_bench [--rounds 40] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence

import aiohttp
import orjson
from aiohttp import web

from bench.harness import parse_args
from gateway.app import (
    create_app,
    default_backlog_factory,
    default_client_factory,
    shared_credential,
)
from gateway.config import NamespaceSettings, SyphonSettings, TimeoutSettings, load_settings
from gateway.core.backlog import is_backlog_path
from gateway.core.message import OutboundMessage
from gateway.core.ports import BacklogPort, NamespaceClient, Sender
from gateway.syphon.syphon import MIN_CHECK_SPACING
from sblocal.testing import BrokerProcess, ControlClient
from tests.support.processes import broker_wiring, free_port

BOUND = MIN_CHECK_SPACING + SyphonSettings().receive_wait + TimeoutSettings().send_timeout
SLOW_LINK = 0.3  # seconds a backlog write spends on its way to the broker


class _SlowSender:
    def __init__(self, inner: Sender) -> None:
        self._inner = inner

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        await asyncio.sleep(SLOW_LINK)
        await self._inner.send(messages)

    async def close(self) -> None:
        await self._inner.close()


class _SlowBacklogLink:
    """The secondary's client, with backlog sends delayed on their way out."""

    def __init__(self, inner: NamespaceClient) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    async def open_sender(self, path: str) -> Sender:
        sender = await self.inner.open_sender(path)
        return _SlowSender(sender) if is_backlog_path(path) else sender

    async def close(self) -> None:
        await self.inner.close()


async def _home(control: ControlClient, ids: set[str]) -> bool:
    home = {m["message_id"] for m in await control.messages("primary", "orders", limit=1000)}
    return ids <= home


async def one_round(
    http: aiohttp.ClientSession, base: str, control: ControlClient, n: int, rng: random.Random
) -> float | None:
    await control.reset("primary")
    async with http.post(f"{base}/admin/entities/orders/failover") as r:
        assert r.status == 200
    ids = [f"r{n}-{i}" for i in range(4)]

    async def send(mid: str) -> tuple[int, float]:
        headers = {"BrokerProperties": orjson.dumps({"MessageId": mid}).decode()}
        async with http.post(f"{base}/orders/messages", data=b"x", headers=headers) as r:
            return r.status, time.monotonic()

    sends = [asyncio.ensure_future(send(i)) for i in ids]
    await asyncio.sleep(rng.uniform(0.0, 0.15))  # the race: writes still in flight
    async with http.post(f"{base}/admin/entities/orders/healthy") as r:
        assert r.status == 200
    failback = time.monotonic()
    results = await asyncio.gather(*sends)
    backlogged = {i for i, (status, _) in zip(ids, results, strict=True) if status == 202}
    if not backlogged:
        return None  # the failback won the race for every request: nothing to move
    start_at = max([failback, *(t for s, t in results if s == 202)])
    deadline = start_at + 60
    while not await _home(control, backlogged):
        if time.monotonic() > deadline:
            return float("inf")
        await asyncio.sleep(0.02)
    return time.monotonic() - start_at


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    args = parse_args(parser, argv, {"rounds": 8})
    rng = random.Random(7)
    times: list[float] = []
    with BrokerProcess() as broker:
        control = broker.control
        port = free_port()
        # One queue, ten backlog queues, failover at the first failed send, no SDK retries,
        # the built-in syphon; every other setting (syphon and timeouts) at its default.
        env = {
            **broker_wiring(broker),
            "SBGATE_ENTITIES": "queue:orders",
            "SBGATE_LISTEN_PORT": str(port),
            "SBGATE_LOG_LEVEL": "ERROR",
            "SBGATE_BACKLOG_QUEUE_COUNT": "10",
            "SBGATE_FAILOVER_INTERVAL": "0",
            "SBGATE_SDK_RETRY_TOTAL": "0",
            "SBGATE_ENABLE_SYPHON": "true",
        }
        settings = load_settings(env)
        make = default_client_factory(settings, shared_credential(settings))

        def clients(ns: NamespaceSettings) -> NamespaceClient:
            return _SlowBacklogLink(make(ns))

        def backlogs(ns: NamespaceSettings, client: NamespaceClient) -> BacklogPort | None:
            assert isinstance(client, _SlowBacklogLink)
            return default_backlog_factory(ns, client.inner)

        app = create_app(settings, client_factory=clients, backlog_factory=backlogs)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as http:
                for n in range(args.rounds):
                    took = await one_round(http, f"http://127.0.0.1:{port}", control, n, rng)
                    if took is not None:
                        times.append(took)
        finally:
            await runner.cleanup()
    if not times:
        print("failback: no round had a backlog write racing the failback")
        return
    times.sort()
    p50 = statistics.median(times)
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    lost = sum(1 for t in times if t == float("inf"))
    print(
        f"failback -> backlog empty ({len(times)} rounds with writes racing the failback, "
        f"defaults): p50 {p50:.2f} s, p99 {p99:.2f} s, max {times[-1]:.2f} s; "
        f"bound {BOUND:g} s, p99/bound {p99 / BOUND:.2f}; "
        f"goal p99 <= bound and <= 2 s -> {'met' if p99 <= min(2.0, BOUND) else 'NOT met'}"
        + (f"; {lost} round(s) not home within 60 s" if lost else "")
    )


if __name__ == "__main__":
    asyncio.run(main())
