"""Where the gateway's CPU goes per request: the real app, in process, with parts switched off.

    .venv/bin/python -m bench.gateway_profile                  # every variant, best of 3 x 12
    .venv/bin/python -m bench.gateway_profile full metrics uuid # a selection
    .venv/bin/python -m bench.gateway_profile --access-line     # the access line alone
    .venv/bin/python -m bench.gateway_profile --layers [info]   # the full path's CPU by layer
    .venv/bin/python -m bench.gateway_profile --instructions    # P1 in instructions (callgrind)

The app (`create_app` with the null sink), its runner (`HardenedAppRunner`, as `gateway
serve`) and aiohttp's HTTP/1.1 protocol run on fake in-memory transports: 64 connections,
one request in flight on each, each answer triggering the next request. No sockets, no load
generator: the figure is the Python work per request, `time.process_time()` over 10,000
requests, the best of several runs (noise on a shared machine only ever adds). Each variant
runs in a fresh interpreter because some switch parts off by patching modules.

Variants (combine with ``+``, e.g. ``router+metrics``):

* ``bare`` — aiohttp's plain runner and a handler that reads the body and answers 201;
* ``full`` — the gateway as configured (failover on, memory store, log WARNING);
* ``handler`` — the message routes answered by the bare handler (the gateway's frame only);
* ``router`` — `submit` returns at once (no dispatcher hop);
* ``metrics`` — the per-request Prometheus metrics are no-ops;
* ``middlewares`` — no edge frame (`handlers.edge`, around every route: path guard, errors,
  request id) and no middleware (the serving app has none with tracing off);
* ``runner`` — aiohttp's plain `AppRunner` instead of `HardenedAppRunner`;
* ``info`` — request logging at INFO, the default (the access line on every request);
* ``auth`` — SAS rules configured, every request with the same token (the verified-token
  cache answers); ``auth+nocache`` verifies the token on every request;
* ``ledger`` — the event ledger on, written to files in a temporary directory (its writer
  thread's work included: it runs in this process).

``--layers`` profiles the ``full`` variant (or ``info``) with `cProfile` over 20,000
requests and prints the share of the CPU under each layer of the path (aiohttp's protocol,
the app's routing and middleware, the message route's parts, the answer's writing): the
inclusive time of one function per layer (the outermost of that name), so an inner layer is
also counted in the outer one.
`cProfile` adds the same cost to every Python call, so the shares are close to, not exactly,
those of an unprofiled run.

``--instructions`` counts what a request costs in **instructions** instead of seconds
(valgrind's callgrind, ``make bench-tools`` installs it): each variant (``bare``, ``full``
and ``info`` unless named: P1 at WARNING and at INFO) runs under callgrind twice, with one
measured run of `--requests` and with three, and the difference over the 2 x `--requests`
more is the count a request. Start-up, imports and the warm-up are in both and cancel out. A
count barely moves with what else the machine runs (two runs here agreed within 0.5 %, where
seconds drift by a third), so this is the P1 figure to compare two versions of the code, or
two Pythons, by; timer-driven work (loop-lag samples, flushes) still grows when a run under
valgrind goes slower (one beside the test suite once read ~8 % higher), so compare runs taken
together. It leaves out the kernel's share (sockets, system calls), which is the same for both
variants and would bring the ratio closer to one.
Six runs under callgrind, two at a time: about four minutes.

It reaches into the gateway's internals (route handlers, app state keys, module globals) to
switch parts off: a variant that no longer applies after a refactoring fails loudly.
Nothing here is part of `make test`; `python -m bench` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.harness import IN_MEMORY_ENV, child_output, cpu_per_request, pin_self_from_env, run_fast
from bench.loadgen import build_request, make_body

VARIANTS = (
    "bare",
    "full",
    "handler",
    "router",
    "metrics",
    "middlewares",
    "runner",
    "router+metrics+middlewares+runner",
    "info",
    "auth",
    "auth+nocache",
    "ledger",
)
_URL = "http://127.0.0.1:1/queues/orders/messages"
_REQUEST = build_request(_URL, make_body(1024), {})
_AUTH_KEY = "cHJvZmlsZS1rZXktZm9yLXRoZS1iZW5jaC0wMDAwMDAwMA=="
_AUTH_ENV = {
    "SBGATE_AUTH_RULES": (
        '[{"name": "bench", "primary_key": "' + _AUTH_KEY + '", "rights": ["Send"], '
        '"entities": ["*"]}]'
    ),
    "SBGATE_PUBLIC_HOSTS": "127.0.0.1",
}


def _request(parts: set[str]) -> bytes:
    """The request every connection sends (with a SAS token for ``auth``)."""
    if "auth" not in parts:
        return _REQUEST
    from gateway.auth import mint_token, resource_uri

    token = mint_token(resource_uri("127.0.0.1", "orders"), "bench", _AUTH_KEY, 3600)
    return build_request(_URL, make_body(1024), {"Authorization": token})


def _build(parts: set[str]) -> tuple[web.AppRunner, Callable[[], None]]:
    """The runner to measure, and what to do once it is set up."""
    from bench.gateway_server import _bare_post, bare_app, gateway_app, gateway_runner

    if "bare" in parts:
        return web.AppRunner(bare_app(), access_log=None), lambda: None
    app, settings = gateway_app("null")
    from gateway.core.router import Delivery
    from gateway.web.handlers import EDGE, ROUTER, edge

    if "handler" in parts:  # the bare handler inside the edge's frame
        for resource in app.router.resources():
            for route in resource:
                if route.method == "POST":
                    route._handler = edge(_bare_post)  # type: ignore[assignment]
    if "middlewares" in parts:  # no edge frame: each route's own handler, unwrapped
        app._middlewares = type(app._middlewares)([])
        for route in app.router.routes():
            route._handler = getattr(route._handler, "__wrapped__", route._handler)
    if "metrics" in parts:

        def _noop(*args: Any) -> None:
            return None

        metrics: Any = app[EDGE].observer
        metrics.request_answered = _noop
    runner: web.AppRunner
    if "runner" in parts:
        runner = web.AppRunner(app, access_log=None)
    else:
        runner = gateway_runner(app, settings)

    def after_setup() -> None:
        if "router" in parts:

            class _Instant:
                async def submit(self, entity: Any, messages: Any) -> Delivery:
                    return Delivery("primary", entity.path)

            app._state[ROUTER] = _Instant()

    return runner, after_setup


async def _measure(variant: str, requests: int, runs: int) -> list[float]:
    parts = set(variant.split("+"))
    runner, after_setup = _build(parts)
    await runner.setup()
    after_setup()
    if "bare" not in parts:
        from gateway.cli import tune_gc

        tune_gc()  # as `gateway serve` does once started
    server = runner.server
    assert server is not None
    request = _request(parts)
    costs: list[float] = []
    try:
        for run in range(runs + 1):  # the first run warms up
            cost = await cpu_per_request(server, requests, request)
            if run:
                costs.append(cost)
    finally:
        await runner.cleanup()
    return costs


def _environ(parts: set[str]) -> None:
    """The settings of a variant, in this process's environment."""
    os.environ.update(IN_MEMORY_ENV)
    if "info" in parts:
        os.environ["SBGATE_LOG_LEVEL"] = "INFO"
    if "auth" in parts:
        os.environ.update(_AUTH_ENV)
    if "nocache" in parts:
        os.environ["SBGATE_AUTH_TOKEN_CACHE_SIZE"] = "0"
    if "ledger" in parts:
        root = tempfile.mkdtemp(prefix="sbgate-profile-ledger-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        os.environ["SBGATE_LEDGER"] = root


def _child(variant: str, requests: int, runs: int) -> None:
    _environ(set(variant.split("+")))
    costs = run_fast(lambda: _measure(variant, requests, runs))
    print(" ".join(f"{c:.2f}" for c in costs), flush=True)


async def _access_line(lines: int) -> float:
    """CPU µs of one access line (`log_outcome` at INFO, the writer's flush to /dev/null
    included), 64 lines per loop turn as with 64 busy connections."""
    import logging

    from gateway.core.message import OutboundMessage
    from gateway.ingest import Outcome as _Outcome
    from gateway.ingest import log_outcome as _log_outcome
    from gateway.logs import ACCESS_LOGGER, AccessLog

    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
    outcome = _Outcome(os.urandom(16).hex())
    messages = [OutboundMessage(body=b"x", message_id=os.urandom(16).hex())]
    with open(os.devnull, "w") as sink:  # noqa: ASYNC230  # /dev/null never blocks
        access_log = AccessLog("json", sink)
        access_log.bind(asyncio.get_running_loop())
        started = time.process_time()
        for _ in range(lines // 64):
            for _ in range(64):
                _log_outcome(access_log, outcome, "orders", 201, "primary", messages, 1e-3, None)
            await asyncio.sleep(0)  # one loop turn: the writer flushes
        access_log.close()
        return (time.process_time() - started) / lines * 1e6


# (label, file name suffix, function name): the layers `--layers` reports, outermost first.
LAYERS = (
    (
        "protocol: bytes in, with the head deadline and size cap",
        "gateway/web/protocol.py",
        "data_received",
    ),
    ("  aiohttp's part: the head parsed", "aiohttp/web_protocol.py", "data_received"),
    ("request task: handle, answer, keep-alive", "aiohttp/web_protocol.py", "_handle_request"),
    ("  app: route, middleware, handler", "aiohttp/web_app.py", "_handle"),
    ("    route resolution", "aiohttp/web_urldispatcher.py", "resolve"),
    ("    the edge's frame with the message route", "gateway/web/handlers.py", "_send_request"),
    ("      message route", "gateway/web/handlers.py", "_send"),
    ("        read and parse the request", "gateway/web/handlers.py", "_read_messages"),
    ("          read the body", "gateway/web/handlers.py", "_buffered_body"),
    ("          build the message", "gateway/web/rest.py", "build_message"),
    ("        router and dispatcher hop", "gateway/core/failover.py", "submit"),
    ("        metrics, ledger, access line", "gateway/ingest.py", "record_outcome"),
    ("          access line", "gateway/ingest.py", "log_outcome"),
    ("        the 2xx answer built", "gateway/web/handlers.py", "_accepted"),
    ("  answer written", "aiohttp/web_protocol.py", "finish_response"),
    ("dispatcher worker (null sink)", "gateway/core/dispatcher.py", "_worker"),
)


async def _layers(variant: str, requests: int) -> list[tuple[str, float]]:
    """`cProfile` over `requests` answers: each layer's share of the profiled CPU."""
    import cProfile
    import pstats

    parts = set(variant.split("+"))
    runner, after_setup = _build(parts)
    await runner.setup()
    after_setup()
    from gateway.cli import tune_gc

    tune_gc()
    server = runner.server
    assert server is not None
    request = _request(parts)
    try:
        await cpu_per_request(server, requests, request)  # warm up
        profile = cProfile.Profile()
        profile.enable()
        started = time.process_time()
        await cpu_per_request(server, requests, request)
        total = time.process_time() - started
        profile.disable()
    finally:
        await runner.cleanup()
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out: list[tuple[str, float]] = []
    for label, suffix, name in LAYERS:
        # The outermost of the functions so named (aiohttp's `resolve`s call one another).
        cumulative = max(
            (
                row[3]
                for (file, _line, func), row in stats.items()
                if func == name and file.endswith(suffix)
            ),
            default=0.0,
        )
        out.append((label, cumulative / total))
    return out


def _instructions(variant: str, requests: int, runs: int, scratch: Path) -> int:
    """Instructions a fresh interpreter runs for `variant` with `runs` measured runs of
    `requests` (callgrind's total: user space, every thread)."""
    out = scratch / f"{variant}.{runs}.callgrind"
    child_output(
        "bench.gateway_profile",
        ["--child", variant, "--requests", str(requests), "--runs", str(runs)],
        timeout=1800,
        wrapper=("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"),
    )
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def instructions_per_request(variants: list[str], requests: int) -> dict[str, float]:
    """Each variant's instructions a request: the difference between three measured runs and
    one, over the 2 x `requests` requests between them (see the module docstring)."""
    jobs = [(v, runs) for v in variants for runs in (1, 3)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        totals = pool.map(lambda j: _instructions(j[0], requests, j[1], Path(tmp)), jobs)
        counts = dict(zip(jobs, totals, strict=True))
    return {v: (counts[(v, 3)] - counts[(v, 1)]) / (2 * requests) for v in variants}


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("variants", nargs="*", help=f"default: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--requests", type=int, help="requests a measured run (10,000; --instructions 1,000)"
    )
    parser.add_argument("--runs", type=int, default=12, help="measured runs per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per variant")
    parser.add_argument(
        "--access-line", action="store_true", help="only the access line's cost (best of 5)"
    )
    parser.add_argument(
        "--layers", action="store_true", help="the CPU share of each layer (cProfile, in process)"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instructions a request, by callgrind (bare, full and info unless named)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instructions:
        if shutil.which("valgrind") is None:
            print("valgrind is not installed: make bench-tools (Debian's valgrind package)")
            return 2
        variants = args.variants or ["bare", "full", "info"]
        requests = args.requests or 1000
        per = instructions_per_request(variants, requests)
        print(f"{'variant':58s} instructions a request (callgrind, in process, no sockets)")
        for v in variants:
            print(f"{v:58s} {per[v]:12,.0f}")
        for v in variants:
            if v != "bare" and "bare" in per:
                print(f"P1 by instructions, bare / {v}: {per['bare'] / per[v]:.3f}")
        return 0
    if args.access_line:
        best = min(asyncio.run(_access_line(100_000)) for _ in range(5))
        print(f"access line at INFO: {best:.2f} µs of CPU a request (best of 5 x 100,000)")
        return 0
    if args.layers:
        variant = "+".join(args.variants) or "full"
        _environ(set(variant.split("+")))
        shares = run_fast(lambda: _layers(variant, 20_000))
        print(f"{variant}: share of the gateway's CPU per request, by layer (cProfile, in process)")
        for label, share in shares:
            print(f"  {label:58s} {share:6.1%}")
        return 0
    if args.requests is None:
        args.requests = 10_000
    if args.child:
        _child(args.child, args.requests, args.runs)
        return 0
    variants = args.variants or list(VARIANTS)
    best: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.processes):  # interleaved, so drift hits every variant alike
        for v in variants:
            out = child_output(
                "bench.gateway_profile",
                ["--child", v, "--requests", str(args.requests), "--runs", str(args.runs)],
                timeout=600,
            )
            best[v].extend(float(x) for x in out.split())
    base = min(best["full"]) if best.get("full") else None
    print(f"{'variant':58s} {'best':>7s} {'median':>7s}  µs/request (Python work, no sockets)")
    for v in variants:
        b, m = min(best[v]), statistics.median(best[v])
        delta = f"  ({b - base:+.1f} vs full)" if base is not None and v != "full" else ""
        print(f"{v:58s} {b:7.1f} {m:7.1f}{delta}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
