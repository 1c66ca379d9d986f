"""Syphon benchmarks (printed, not asserted).

* P8: syphon drain rate vs gateway ingest rate, same machine, same run (goal >= 0.5).
  A `gateway serve` process ingests N messages while the primary rejects every send, so they
  land in backlog queues; then a `gateway syphon` process drains them home.
* Idle cost: broker operations per simulated hour with 10 backlog queues and nothing failed
  over (goal <= 4; the old SDK: 10 queues x 4 fifteen-minute long polls = 40).

    .venv/bin/python -m bench.syphon_bench [--messages 5000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import parse_args
from gateway.config import LimitSettings, SyphonSettings, TimeoutSettings
from gateway.core.backlog import backlog_path
from gateway.core.dispatcher import Dispatcher
from gateway.state.memory import MemoryStateStore
from gateway.syphon.syphon import Syphon
from sblocal.testing import BrokerProcess, ControlClient
from tests.support.fakes import FakeClient
from tests.support.processes import GatewayProcess, broker_wiring, free_port
from tests.support.syphon import FakeBacklog, FakeClock
from tests.support.waiting import eventually

QUEUES = 10


def gateway_env(broker: BrokerProcess, **extra: str) -> dict[str, str]:
    """P8's gateway and syphon: one queue, failover at the first failed send, no pings, no
    SDK retries, then `extra`."""
    return {
        **broker_wiring(broker),
        "SBGATE_ENTITIES": "queue:orders",
        "SBGATE_LOG_LEVEL": "WARNING",
        "SBGATE_BACKLOG_QUEUE_COUNT": str(QUEUES),
        "SBGATE_FAILOVER_INTERVAL": "0",
        "SBGATE_PING_PRIMARY_INTERVAL": "3600",
        "SBGATE_SDK_RETRY_TOTAL": "0",
        **extra,
    }


async def depth(control: ControlClient, ns: str, path: str) -> int:
    return int((await control.entity(ns, path))["active"])


async def p8(n: int) -> dict[str, Any]:
    with BrokerProcess() as broker, tempfile.TemporaryDirectory(prefix="bench-syphon-") as logs:
        control = broker.control
        await control.add_fault("primary", "amqp:internal-error", operation="send")
        serve = GatewayProcess(
            "serve",
            gateway_env(broker, SBGATE_ENABLE_SYPHON="false"),
            port=free_port(),
            log_dir=Path(logs),
        )
        body = b"x" * 1024
        sem = asyncio.Semaphore(64)
        async with serve:
            async with aiohttp.ClientSession() as http:

                async def one(i: int) -> int:
                    async with (
                        sem,
                        http.post(
                            f"{serve.url}/queues/orders/messages",
                            data=body,
                            headers={"Idempotency-Key": f"p8-{i}"},
                        ) as r,
                    ):
                        return r.status

                t0 = time.perf_counter()
                statuses = await asyncio.gather(*(one(i) for i in range(n)))
                ingest_s = time.perf_counter() - t0
            backlogged = sum(
                [
                    await depth(control, "secondary", backlog_path("primary", i))
                    for i in range(QUEUES)
                ]
            )
            await control.clear_faults("primary")
            syphon = GatewayProcess(
                "syphon",
                gateway_env(
                    broker, SBGATE_RECEIVE_WAIT="0.5", SBGATE_WORKERS="10", SBGATE_MAX_BATCH="100"
                ),
                port=free_port(),
                log_dir=Path(logs),
                command="syphon",
            )
            t0 = time.perf_counter()
            async with syphon:

                async def home() -> bool:
                    return await depth(control, "primary", "orders") >= backlogged

                await eventually(home, within=600, every=0.1)
                drain_s = time.perf_counter() - t0
    return {
        "accepted_202": statuses.count(202),
        "ingest_rate": n / ingest_s,
        "drain_rate": backlogged / drain_s,
        "ratio": (backlogged / drain_s) / (n / ingest_s),
    }


async def idle_ops() -> int:
    clock = FakeClock()
    port = FakeBacklog()
    store = MemoryStateStore("bench")
    await store.start()
    syphon = Syphon(
        backlog=port,
        queues=[backlog_path("primary", i) for i in range(QUEUES)],
        dispatcher=Dispatcher(LimitSettings(), TimeoutSettings()),
        primary=FakeClient(),
        entities=["orders"],
        store=store,
        settings=SyphonSettings(),
        timeouts=TimeoutSettings(),
        clock=clock,
    )
    syphon.start()
    try:
        await eventually(lambda: bool(port.ops))
        before = len(port.ops)
        while clock.t < 3600:
            await clock.advance()
        await eventually(clock.parked)
        return len(port.ops) - before
    finally:
        await syphon.close(grace=1)
        await store.close()


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    args = parse_args(parser, argv, {"messages": 1000})
    n = args.messages
    ops = await idle_ops()
    print(
        f"idle: {ops} broker operations per simulated hour with {QUEUES} backlog queues "
        f"(goal <= 4; old SDK 40) -> {'met' if ops <= 4 else 'NOT met'}"
    )
    r = await p8(n)
    print(
        f"P8: ingest to backlog {r['ingest_rate']:.0f} msgs/s ({r['accepted_202']} answered 202), "
        f"syphon drain {r['drain_rate']:.0f} msgs/s, ratio {r['ratio']:.2f} "
        f"(goal >= 0.5) -> {'met' if r['ratio'] >= 0.5 else 'NOT met'}"
    )


if __name__ == "__main__":
    asyncio.run(main())
