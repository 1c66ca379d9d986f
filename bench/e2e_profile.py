"""Where the gateway's CPU goes end to end: cProfile over the real app with the SDK sink.

    .venv/bin/python -m bench.e2e_profile                # 128 clients, 8 s profiled
    .venv/bin/python -m bench.e2e_profile --connections 64 --seconds 5 --top 60
    .venv/bin/python -m bench.e2e_profile --entities 1000 --connections 64  # E1's load

Starts the local broker (`sblocal`, a subprocess), builds the gateway app in this process as
`gateway serve` does (SDK sink, failover and syphon off, log WARNING, uvloop), serves it on
127.0.0.1 and drives it with `bench.loadgen` in a subprocess for `--seconds` + 4 s. The
gateway (this process) is pinned to the first CPU, the load generator and the broker to the
second, as in `bench.gateway_bench`. After 3 s of warm-up, `cProfile` records `--seconds` of
the gateway's work; the report gives the share of profiled time in the parts that matter
(HTTP edge, the dispatcher, encoding the messages, the SDK's send) and the top functions by
cumulative time. cProfile slows everything it sees alike: read shares, not microseconds.
`--entities N`: the broker has queues q0..q<N-1>, the gateway declares them all and the load
goes round-robin over them (unbatched sends, as in `bench.entities_bench`).

Nothing here is part of `make test`; `python -m bench` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from bench.harness import ROOT, pin, write_many_queues
from sblocal.testing import BrokerProcess

# Functions whose cumulative time is reported as a share of the profiled time.
_PARTS = {
    "HTTP edge (aiohttp protocol, middleware, handler)": ("web_protocol.py", "_handle_request"),
    "the dispatcher (micro-batching, workers, the sender's whole send)": (
        "dispatcher.py",
        "_worker",
    ),
    "encoding each message once (encoding.encode)": ("encoding.py", "encode"),
    "the SDK's encoder (encode_payload), in encode and in the send": (
        "_encode.py",
        "encode_payload",
    ),
    "adding the encoded bytes to the batch (encoding.add)": ("encoding.py", "add"),
    "the SDK's path, single messages (to_amqp)": ("client.py", "to_amqp"),
    "the SDK's path, ServiceBusMessageBatch.add_message": ("message.py", "add_message"),
    "the SDK's send (link I/O, settlement)": ("_servicebus_sender_async.py", "send_messages"),
}


async def _profile(
    broker: BrokerProcess,
    connections: int,
    seconds: float,
    many: tuple[Path, int] | None,
    generator: str = "python",
    warmup: float = 3.0,
) -> cProfile.Profile:
    ns = broker.info["namespaces"]
    path, extra = "/queues/orders/messages", []
    os.environ["SBGATE_ENTITIES"] = "queue:orders"
    if many is not None:
        os.environ["SBGATE_CONFIG"] = str(many[0])
        del os.environ["SBGATE_ENTITIES"]
        path, extra = "/q{i}/messages", ["--entities", str(many[1])]
    os.environ.update(
        {
            "SBGATE_PRIMARY_CONNECTION_STRING": ns["primary"]["connection_string"],
            "SBGATE_SECONDARY_CONNECTION_STRING": ns["secondary"]["connection_string"],
            "SBGATE_PRIMARY_NAME": "primary",
            "SBGATE_SECONDARY_NAME": "secondary",
            "SBGATE_LOG_LEVEL": "WARNING",
            "SBGATE_ENABLE_FAILOVER": "false",
            "SBGATE_ENABLE_SYPHON": "false",
        }
    )
    from bench.gateway_server import gateway_app, gateway_runner

    app, settings = gateway_app("sdk")
    runner = gateway_runner(app, settings)
    await runner.setup()
    profiler = cProfile.Profile()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        from gateway.cli import tune_gc

        tune_gc()  # as `gateway serve` does once started
        port = runner.addresses[0][1]
        if generator == "h2load":
            await _under_h2load(profiler, port, path, many, connections, seconds, warmup)
            return profiler
        port = runner.addresses[0][1]
        loadgen = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.loadgen",
            "--url",
            f"http://127.0.0.1:{port}{path}",
            *extra,
            "--connections",
            str(connections),
            "--duration",
            str(seconds + warmup + 1),
            env={**os.environ, "BENCH_CPUS": "1", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.sleep(warmup)  # warm-up: senders open, batches settle into their size
            profiler.enable()
            await asyncio.sleep(seconds)
            profiler.disable()
            async with asyncio.timeout(seconds + 30):
                out, _ = await loadgen.communicate()
        finally:
            if loadgen.returncode is None:
                loadgen.kill()
                await loadgen.wait()
        result = [line for line in out.decode().splitlines() if line.startswith("RESULT")]
        print(result[-1] if result else "load generator: no RESULT line")
    finally:
        await runner.cleanup()
    return profiler


async def _under_h2load(
    profiler: cProfile.Profile,
    port: int,
    path: str,
    many: tuple[Path, int] | None,
    connections: int,
    seconds: float,
    warmup: float,
) -> None:
    """The load of `bench.entities_bench`: h2load on the second CPU, each connection cycling
    through every entity's URL."""
    from bench.loadgen import make_body
    from bench.native import H2Load, run_h2load

    count = many[1] if many is not None else 1
    urls = [f"http://127.0.0.1:{port}{path}".replace("{i}", str(i)) for i in range(count)]
    load = H2Load(urls, seconds + warmup, connections=connections, body=make_body(1024))
    cpus = frozenset({1}) if len(os.sched_getaffinity(0)) > 1 else frozenset()
    running = asyncio.create_task(run_h2load(load, cpus=cpus, watch={"gateway": os.getpid()}))
    try:
        await asyncio.sleep(warmup)
        profiler.enable()
        await asyncio.wait({running}, timeout=seconds)
        profiler.disable()
        window = await running
    finally:
        running.cancel()
    result = window.result
    print(f"h2load: {result['rate']:,.0f} req/s, statuses {result['statuses']}")


def _report(profiler: cProfile.Profile, top: int) -> None:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    raw = stats.stats  # type: ignore[attr-defined]
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    print(f"\nprofiled: {total:.2f} s of the gateway's CPU (cProfile-inflated)")
    for label, (filename, func) in _PARTS.items():
        cum = sum(v[3] for (f, _, name), v in raw.items() if f.endswith(filename) and name == func)
        print(f"  {100 * cum / total:5.1f}%  {label}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    print(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=8.0, help="profiled seconds")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    parser.add_argument("--entities", type=int, default=0, help="queues q0..q<N-1> (0: orders)")
    parser.add_argument("--generator", choices=("python", "h2load"), default="python")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before profiling")
    parser.add_argument("--dump", type=Path, help="also write the raw profile here (pstats)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="e2e-profile-"))
    many: tuple[Path, int] | None = None
    broker_config: Path | None = None
    if args.entities:
        broker_config, gateway_config = work / "broker.toml", work / "gateway.toml"
        write_many_queues(broker_config, gateway_config, args.entities)
        many = (gateway_config, args.entities)
    with BrokerProcess(config=broker_config, startup_timeout=120) as broker:
        if len(os.sched_getaffinity(0)) > 1:
            pin(broker.pid, frozenset({1}))
            pin(os.getpid(), frozenset({0}))
        try:
            import uvloop
        except ImportError:
            profiler = asyncio.run(
                _profile(broker, args.connections, args.seconds, many, args.generator, args.warmup)
            )
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
                profiler = r.run(
                    _profile(
                        broker, args.connections, args.seconds, many, args.generator, args.warmup
                    )
                )
    _report(profiler, args.top)
    if args.dump:
        profiler.dump_stats(args.dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
