"""The AMQP edge's CPU per message against the HTTP edge's, in one run.

    .venv/bin/python -m bench.amqp_edge_bench            # 4,000 messages per workload
    .venv/bin/python -m bench.amqp_edge_bench --quick

The real app (`create_app`, the null sink: every send settles at once, so what is measured
is the edge, `gateway.ingest` and the dispatcher) in this process, on uvloop; the clients in
a child process, so that their CPU is not counted: `time.process_time()` of this process
over each workload, divided by its messages. Workloads:

* ``http`` — the HTTP edge, one message per request (`--senders` concurrent loops);
* ``amqp`` — the real Python SDK, one message per `send_messages` (`--senders` senders);
* ``amqp-batch`` — the SDK sending `ServiceBusMessageBatch`es of `--batch` messages.

Printed: µs of gateway CPU per message for each, and the AMQP ones as ratios of the HTTP
one (the issue's targets: at most 1x for single sends, 0.3x for batches of 100).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.harness import IN_MEMORY_ENV, parse_args, run_fast

WORKLOADS = ("http", "amqp", "amqp-batch")
CLIENT_DEADLINE = 600.0


async def _client(kind: str, http_port: int, amqp_port: int, messages: int, senders: int,
                  batch: int) -> None:  # fmt: skip
    """The load, in the child process: `messages` in all, over `senders` at once."""
    per = max(1, messages // senders)
    if kind == "http":
        import aiohttp

        async with aiohttp.ClientSession() as http:

            async def post_loop() -> None:
                for _ in range(per):
                    async with http.post(
                        f"http://127.0.0.1:{http_port}/queues/orders/messages", data=b"x" * 1024
                    ) as r:
                        assert r.status == 201, r.status

            await asyncio.gather(*(post_loop() for _ in range(senders)))
        return
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    conn = (
        f"Endpoint=sb://localhost:{amqp_port};SharedAccessKeyName=bench;"
        "SharedAccessKey=YmVuY2g=;UseDevelopmentEmulator=true"
    )
    async with ServiceBusClient.from_connection_string(conn) as sb:

        async def send_loop() -> None:
            async with sb.get_queue_sender("orders") as sender:
                if kind == "amqp":
                    for _ in range(per):
                        await sender.send_messages(ServiceBusMessage(b"x" * 1024))
                    return
                for _ in range(max(1, per // batch)):
                    b = await sender.create_message_batch()
                    for _ in range(batch):
                        b.add_message(ServiceBusMessage(b"x" * 1024))
                    await sender.send_messages(b)

        await asyncio.gather(*(send_loop() for _ in range(senders)))


async def _measure(args: argparse.Namespace) -> dict[str, float]:
    from aiohttp import web

    from bench.null_sink import NullNamespaceClient
    from gateway.app import create_app
    from gateway.config import NamespaceSettings, load_settings
    from tests.support.processes import free_port

    amqp_port = free_port()
    env = {
        **IN_MEMORY_ENV,
        "SBGATE_AMQP_PLAIN_PORT": str(amqp_port),
        "SBGATE_ENABLE_FAILOVER": "false",
        "SBGATE_ENABLE_SYPHON": "false",
        "SBGATE_MAX_HEAD_WAIT": "0",
    }

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        return list(paths)

    app = create_app(
        load_settings(env),
        client_factory=lambda ns: NullNamespaceClient(ns.name),
        provisioner=provision,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    http_port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", http_port)
    await site.start()
    costs: dict[str, float] = {}
    try:
        for kind in args.workloads:
            messages = args.messages
            started = time.process_time()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.amqp_edge_bench", "--client", kind,
                "--http-port", str(http_port), "--amqp-port", str(amqp_port),
                "--messages", str(messages), "--senders", str(args.senders),
                "--batch", str(args.batch),
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            async with asyncio.timeout(CLIENT_DEADLINE):
                code = await proc.wait()
            if code != 0:
                raise RuntimeError(f"the {kind} client failed (exit {code})")
            costs[kind] = (time.process_time() - started) / messages * 1e6
    finally:
        await runner.cleanup()
    return costs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--client", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--amqp-port", type=int, help=argparse.SUPPRESS)
    args = parse_args(parser, argv, {"messages": 400})
    if args.client:
        asyncio.run(
            _client(args.client, args.http_port, args.amqp_port, args.messages, args.senders,
                    args.batch)
        )  # fmt: skip
        return 0
    os.environ.setdefault("SBGATE_LOG_LEVEL", "WARNING")
    costs: dict[str, Any] = run_fast(lambda: _measure(args))
    http = costs.get("http")
    for kind, cost in costs.items():
        ratio = f"  {cost / http:.2f}x the HTTP edge's" if http and kind != "http" else ""
        print(f"{kind:<11} {cost:8.1f} us of gateway CPU per message{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
