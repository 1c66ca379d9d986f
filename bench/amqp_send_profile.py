"""The gateway's cost of AMQP sends, in this process: CPU, cProfile, or instructions.

    .venv/bin/python -m bench.amqp_send_profile                      # SDK sink, 2,000 sends
    .venv/bin/python -m bench.amqp_send_profile --sink null --profile /tmp/null.prof
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.%p \\
        .venv/bin/python -m bench.amqp_send_profile --messages 1000 --callgrind

The local broker in a process of its own; the gateway built as `bench.gateway_server`
builds it (`--sink sdk`: it really sends to the broker; `--sink null`: every send settles at
once), in this process, on uvloop, with its AMQP port; the load from a child process, as
`bench.amqp_edge_bench` makes it: ``--client seq``, one Python SDK sender sending
`--messages` single messages of 1 KiB one at a time (its latencies are printed), or
``amqp`` / ``http``, that bench's CPU workloads (four senders). Printed: this process's
user and system CPU a message over the client's run, and how often it slept waiting for
work (voluntary context switches a message: each a wakeup the kernel pays for).
`--profile FILE` writes a cProfile of the run (cProfile slows what it sees alike: read
shares); `--callgrind` switches
callgrind's counting on for the run only, under ``valgrind --instr-atstart=no``: user-space
instructions, which a busy machine does not change, for an A/B of two checkouts one after
the other (each run with its own ``PYTHONPATH``). Nothing here is part of `make test`;
`python -m bench` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import resource
import subprocess
import time

import orjson

from bench.harness import bench_env, child_output
from tests.support.processes import BrokerProcess, free_port


async def _run(args: argparse.Namespace) -> None:
    from aiohttp import web

    broker = BrokerProcess()
    await broker.astart()
    try:
        port = free_port()
        os.environ.update(
            bench_env(
                broker,
                {
                    "SBGATE_ENTITIES": "queue:orders,topic:events",
                    "SBGATE_AMQP_PLAIN_PORT": str(port),
                },
            )
        )
        from bench.gateway_server import gateway_app, gateway_runner
        from gateway.cli import tune_gc

        app, settings = gateway_app(args.sink)
        runner = gateway_runner(app, settings)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            tune_gc()  # as `gateway serve` does once started
            await _measure(args, port, runner.addresses[0][1])
        finally:
            await runner.cleanup()
    finally:
        await broker.astop()


async def _measure(args: argparse.Namespace, amqp_port: int, http_port: int) -> None:
    if args.client == "seq":
        conn = (
            f"Endpoint=sb://localhost:{amqp_port};SharedAccessKeyName=bench;"
            "SharedAccessKey=YmVuY2g=;UseDevelopmentEmulator=true"
        )
        load = ["--e2e-client", "single", "--e2e-messages", str(args.messages), "--conn", conn]
    else:
        load = [
            "--client", args.client, "--http-port", str(http_port), "--amqp-port",
            str(amqp_port), "--messages", str(args.messages), "--senders", "4",
        ]  # fmt: skip
    profile = cProfile.Profile() if args.profile else None
    before = os.times()
    waits = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    if profile is not None:
        profile.enable()
    _callgrind(args, "on")
    out = await asyncio.to_thread(child_output, "bench.amqp_edge_bench", load, timeout=600)
    _callgrind(args, "off")
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    after = os.times()
    waits = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - waits
    user, system = (
        (b - a) / args.messages * 1e6 for a, b in zip(before[:2], after[:2], strict=True)
    )
    line = (
        f"{args.sink} sink, {args.client} client: gateway CPU {user:.0f} us user + "
        f"{system:.0f} us system a message; it slept {waits / args.messages:.2f} times a "
        "message (voluntary context switches: waits for work, each a kernel wakeup)"
    )
    if args.client == "seq":
        lat = sorted(orjson.loads(out.split("RESULT ", 1)[1])[0]["latencies"])
        line += (
            f"; {len(lat) / sum(lat):,.0f} sends/s, p50 {lat[len(lat) // 2] * 1e3:.2f} ms, "
            f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3:.2f} ms"
        )
    print(line, flush=True)


def _callgrind(args: argparse.Namespace, state: str) -> None:
    """Under `valgrind --tool=callgrind --instr-atstart=no`: count the client's run only."""
    if args.callgrind:
        subprocess.run(
            ["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sink", choices=("sdk", "null"), default="sdk")
    parser.add_argument("--client", choices=("seq", "amqp", "http"), default="seq")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--profile", default=None, help="write a cProfile of the run here")
    parser.add_argument("--callgrind", action="store_true", help="count the run only")
    args = parser.parse_args(argv)
    os.environ.setdefault("SBGATE_LOG_LEVEL", "WARNING")
    import uvloop

    started = time.monotonic()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_run(args))
    print(f"({time.monotonic() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
