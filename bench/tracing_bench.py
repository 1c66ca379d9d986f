"""What tracing costs per request: off (the default), off with the propagation taken out
(the gateway before tracing), and on at 100% sampling.

    .venv/bin/python -m bench.tracing_bench            # every variant, 3 processes x 8 runs
    .venv/bin/python -m bench.tracing_bench --quick

The real app and runner on the in-memory transports of bench/harness.py (64
connections, the null sink, no sockets): the figure is the Python work per request,
`time.process_time()` over N requests (every thread of the process, so the span exporter's
thread counts too), the best and the median of several runs.

Variants, in two families. Each family runs on one app in one process, its variants
alternating run by run, so the machine's drift (it is shared and noisy) hits them alike; the
families run in fresh processes, interleaved.

* ``baseline`` — tracing off and the propagation switched off (`request_properties` answers
  None at once): the per-request work as it was before tracing;
* ``off`` — tracing off, as shipped (one header lookup per request);
* ``off+traceparent`` — tracing off, each request with a ``traceparent``: its messages get
  the ``Diagnostic-Id``/``traceparent`` properties;
* ``on`` / ``on+traceparent`` — tracing on, every trace sampled, spans through the batch
  processor to an exporter that drops them (the cost up to the wire).

Printed: µs/request, each variant's ratio to ``baseline`` (best and median), and for the
first family the median of the ratios of runs made side by side ("paired", the least noisy
figure). Then the work tracing off adds to a request without a ``traceparent``, timed alone
with `timeit`, as a share of the baseline: "unchanged with tracing off" means that share is
far below the noise, and the paired ``off`` ratio is 1.00 within it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import timeit
from collections.abc import Sequence
from typing import Any

from bench.harness import IN_MEMORY_ENV, child_output, cpu_per_request, pin_self_from_env, run_fast
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


FAMILIES = {"off": ("baseline", "off", "off+traceparent"), "on": ("on", "on+traceparent")}


async def _measure(family: str, requests: int, runs: int) -> dict[str, list[float]]:
    """Each variant of `family` on one app in this process, alternating run by run (so the
    machine's drift hits them alike); µs of CPU per request, per run."""
    from bench.gateway_server import gateway_runner
    from bench.null_sink import NullNamespaceClient
    from gateway.app import create_app
    from gateway.config import NamespaceSettings, load_settings
    from gateway.logs import setup_logging
    from gateway.tracing import request_properties
    from gateway.web import handlers

    def without_propagation(headers: Any, tracer: Any) -> None:
        return None

    settings = load_settings(os.environ)
    setup_logging(settings.log_format, settings.log_level)

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        return list(paths)

    app = create_app(
        settings,
        client_factory=lambda ns: NullNamespaceClient(ns.name),
        provisioner=provision,
        tracer=_tracer({family}),
    )
    runner = gateway_runner(app, settings)
    await runner.setup()
    server = runner.server
    assert server is not None
    url = "http://127.0.0.1:1/queues/orders/messages"
    plain = build_request(url, make_body(1024), {})
    traced = build_request(url, make_body(1024), {"traceparent": TRACEPARENT})
    variants = FAMILIES[family]
    costs: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for run in range(runs + 1):  # the first round warms up
            for v in variants[run % len(variants) :] + variants[: run % len(variants)]:
                parts = set(v.split("+"))
                propagation = without_propagation if "baseline" in parts else request_properties
                setattr(handlers, "request_properties", propagation)  # noqa: B010
                request = traced if "traceparent" in parts else plain
                cost = await cpu_per_request(server, requests, request)
                if run:
                    costs[v].append(cost)
    finally:
        await runner.cleanup()
    return costs


def _child(family: str, requests: int, runs: int) -> None:
    os.environ.update(IN_MEMORY_ENV)
    costs = run_fast(lambda: _measure(family, requests, runs))
    print(json.dumps(costs), flush=True)


def _added_work_off() -> float:
    """µs per request of what tracing off adds to a request without a traceparent, timed
    alone: the propagation's header lookup (the rest of the path is the same code)."""
    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway.core.ports import Tracer
    from gateway.tracing import request_properties

    headers = CIMultiDictProxy(CIMultiDict(_HEADERS))
    tracer = Tracer()
    n = 200_000
    best = min(timeit.repeat(lambda: request_properties(headers, tracer), number=n, repeat=5))
    empty = min(timeit.repeat(lambda: None, number=n, repeat=5))  # the lambda's own call
    return max(best - empty, 0.0) / n * 1e6


# The headers of the benchmark's requests (bench/loadgen.build_request).
_HEADERS = {"Host": "127.0.0.1:1", "Content-Type": "application/json", "Content-Length": "1024"}


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=8, help="measured rounds per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per family")
    parser.add_argument("--quick", action="store_true", help="2,000 requests x 3 runs x 1")
    parser.add_argument(
        "--families",
        nargs="+",
        choices=list(FAMILIES),
        default=list(FAMILIES),
        help="default: both",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.runs, args.processes = 2000, 3, 1
    if args.child:
        _child(args.child, args.requests, args.runs)
        return 0
    families = [f for f in FAMILIES if f in args.families]
    costs: dict[str, list[float]] = {v: [] for f in families for v in FAMILIES[f]}
    for _ in range(args.processes):  # interleaved, so drift hits both families alike
        for family in families:
            out = child_output(
                "bench.tracing_bench",
                ["--child", family, "--requests", str(args.requests), "--runs", str(args.runs)],
                timeout=900,
            )
            for v, values in json.loads(out.splitlines()[-1]).items():
                costs[v].extend(values)
    base = costs.get("baseline")
    if base is None:
        for v, values in costs.items():
            print(f"{v:18s} best {min(values):8.1f} µs  median {statistics.median(values):8.1f} µs")
        return 0
    base_best, base_median = min(base), statistics.median(base)
    print(
        f"tracing cost per request ({args.requests} requests x {args.runs} rounds x "
        f"{args.processes} processes; Python work, no sockets)"
    )
    print(
        f"{'variant':18s} {'best µs':>8s} {'median µs':>10s} "
        f"{'best/base':>10s} {'median/base':>12s} {'paired':>8s}"
    )
    for v, values in costs.items():
        b, m = min(values), statistics.median(values)
        # Same process, same round: the run right next to the baseline's (off family only).
        paired = (
            f"{statistics.median(x / y for x, y in zip(values, base, strict=True)):8.3f}"
            if v in FAMILIES["off"]
            else f"{'':8s}"
        )
        print(f"{v:18s} {b:8.1f} {m:10.1f} {b / base_best:10.2f} {m / base_median:12.2f} {paired}")
    spread = (statistics.quantiles(base, n=4)[2] - statistics.quantiles(base, n=4)[0]) / base_median
    added = _added_work_off()
    print(f"(the baseline's runs: interquartile range {spread:.0%} of their median)")
    print(
        f"tracing off, no traceparent: the added work timed alone is {added:.2f} µs/request, "
        f"{added / base_best:.2%} of the baseline's best"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
