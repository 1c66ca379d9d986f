"""What tracing costs per request: off (the default), off with the propagation taken out
(the gateway before tracing), and on at 100% sampling.

    .venv/bin/python -m bench.tracing_bench            # every variant, 3 processes x 8 runs
    .venv/bin/python -m bench.tracing_bench --quick

The real app and runner on the in-memory transports of bench/gateway_profile.py (64
connections, the null sink, no sockets): the figure is the Python work per request,
`time.process_time()` over N requests (every thread of the process, so the span exporter's
thread counts too), the best and the median of several runs. Each variant runs in a fresh
interpreter, and the variants are interleaved, so drift on a shared machine hits them alike.

Variants:

* ``baseline`` — tracing off and the propagation switched off (`request_properties` answers
  None at once): the per-request work as it was before tracing;
* ``off`` — tracing off, as shipped (one header lookup per request);
* ``off+traceparent`` — tracing off, each request with a ``traceparent``: its messages get
  the ``Diagnostic-Id``/``traceparent`` properties;
* ``on`` / ``on+traceparent`` — tracing on, every trace sampled, spans through the batch
  processor to an exporter that drops them (the cost up to the wire).

Printed: µs/request and the ratio of each variant to ``baseline``. "Unchanged with tracing
off" means ``off`` / ``baseline`` is 1.00 within the noise (the spread of the baseline's own
runs is printed next to it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.gateway_profile import _ENV, _Driver
from bench.harness import ROOT, pin_self_from_env
from bench.loadgen import build_request, make_body

VARIANTS = ("baseline", "off", "off+traceparent", "on", "on+traceparent")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _tracer(parts: set[str]) -> Any:
    if "on" not in parts:
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from gateway.tracing.otel import OtelTracer

    class _Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    return OtelTracer.with_processor(BatchSpanProcessor(_Drop()))


async def _measure(variant: str, requests: int, runs: int) -> list[float]:
    from bench import gateway_profile
    from bench.gateway_server import gateway_runner
    from gateway.app import create_app
    from gateway.config import NamespaceSettings, load_settings
    from gateway.logs import setup_logging
    from gateway.servicebus.null import NullNamespaceClient
    from gateway.web import handlers

    parts = set(variant.split("+"))
    if "baseline" in parts:
        handlers.request_properties = lambda headers, tracer: None  # type: ignore[assignment]
    headers = {"traceparent": TRACEPARENT} if "traceparent" in parts else {}
    url = "http://127.0.0.1:1/queues/orders/messages"
    gateway_profile._REQUEST = build_request(url, make_body(1024), headers)  # the driver's

    settings = load_settings(os.environ)
    setup_logging(settings.log_format, settings.log_level)

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        return list(paths)

    app = create_app(
        settings,
        client_factory=lambda ns: NullNamespaceClient(ns.name),
        provisioner=provision,
        tracer=_tracer(parts),
    )
    runner = gateway_runner(app, settings)
    await runner.setup()
    server = runner.server
    assert server is not None
    costs: list[float] = []
    try:
        for run in range(runs + 1):  # the first run warms up
            driver = _Driver(server, 64, requests)
            started = time.process_time()
            driver.start()
            async with asyncio.timeout(120):
                await driver.finished
            elapsed = time.process_time() - started
            driver.close()
            if run:
                costs.append(elapsed / requests * 1e6)
    finally:
        await runner.cleanup()
    return costs


def _child(variant: str, requests: int, runs: int) -> None:
    os.environ.update(_ENV)
    try:
        import uvloop
    except ImportError:
        costs = asyncio.run(_measure(variant, requests, runs))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            costs = r.run(_measure(variant, requests, runs))
    print(" ".join(f"{c:.2f}" for c in costs), flush=True)


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("variants", nargs="*", help=f"default: {', '.join(VARIANTS)}")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=8, help="measured runs per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per variant")
    parser.add_argument("--quick", action="store_true", help="2,000 requests x 3 runs x 1")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.runs, args.processes = 2000, 3, 1
    if args.child:
        _child(args.child, args.requests, args.runs)
        return 0
    variants = args.variants or list(VARIANTS)
    if "baseline" not in variants:
        variants.insert(0, "baseline")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    costs: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.processes):  # interleaved, so drift hits every variant alike
        for v in variants:
            cmd = [sys.executable, "-m", "bench.tracing_bench", "--child", v]
            cmd += ["--requests", str(args.requests), "--runs", str(args.runs)]
            out = subprocess.run(
                cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
            ).stdout
            costs[v].extend(float(x) for x in out.split())
    base_best, base_median = min(costs["baseline"]), statistics.median(costs["baseline"])
    spread = (max(costs["baseline"]) - base_best) / base_median
    print(
        f"tracing cost per request ({args.requests} requests x {args.runs} runs x "
        f"{args.processes} processes; Python work, no sockets)"
    )
    print(
        f"{'variant':18s} {'best µs':>8s} {'median µs':>10s} "
        f"{'best/base':>10s} {'median/base':>12s}"
    )
    for v in variants:
        b, m = min(costs[v]), statistics.median(costs[v])
        print(f"{v:18s} {b:8.1f} {m:10.1f} {b / base_best:10.2f} {m / base_median:12.2f}")
    print(f"(the baseline's own runs spread over {spread:.0%} of its median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
