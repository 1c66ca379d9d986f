"""The ledger's cost: the same run with the ledger on and off, by gateway CPU per message.

Two kinds of measurement, both alternating on/off within one run (medians of the rounds):

- ``gateway`` (the goal's own terms): two real gateway servers (`bench.gateway_server`, the
  null sink: every send settled at once, so the gateway's own work is all there is), one
  writing its ledger to a real directory and one with it off, pinned to the first CPU and
  loaded in turn by h2load (closed loop, 1 KB messages, one ledger event each) from the
  other; then both at once in one window. Printed: the throughput ratio, the ratio of CPU
  microseconds per message (read from /proc around each window) alternating, and the same
  measured simultaneously — the steadiest of the three on a shared machine. The ledger's
  lines are counted afterwards: every 2xx must have its ``accepted`` event.
- ``handler`` and ``spin`` (in process, a pessimistic bound): a simulated request handler
  doing ~50 µs of CPU work (``handler``: JSON parse, HMAC, dicts — a gateway request's kinds
  of work; ``spin``: a cache-resident arithmetic loop that any other work slows) plus one
  ``emit`` and an ``await asyncio.sleep(0)``, against a ``NullLedger``; per CPU second of the
  process (writer thread included) and wall-clock. A real request costs several times 50 µs,
  so the same per-event cost is a larger share here.

    .venv/bin/python -m bench.ledger_bench [--workloads gateway handler spin] [--rounds 5]
        [--duration 3] [--requests 20000] [--pairs 9] [--work-us 50] [--cold]

Goal: with the ledger on, the gateway's throughput (CPU per message, the figure a shared
machine does not distort) >= 0.95 of the same run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

# P7's machinery (one comparison of two gateway configurations), reused as it is.
from bench.gateway_bench import (
    Params,
    Rate,
    _cpu_ratio,
    _median_ratio,
    _null_env,
    _ok_count,
    _together_ratio,
    alternate,
    http_load,
    together,
)
from bench.harness import Cores, Server, Window, parse_args
from gateway.ledger import DirectorySink, EventLedger, Ledger, NullLedger

WORKLOADS = ("gateway", "handler", "spin")
GOAL = 0.95

_BODY = orjson.dumps(
    {
        "order": "o-1",
        "items": [{"sku": f"s{i}", "qty": i, "price": i * 1.5} for i in range(20)],
        "note": "x" * 200,
    }
)
_KEY = b"k" * 32


def handler_work(i: int) -> int:
    """One request's CPU work in the gateway, roughly."""
    doc = orjson.loads(_BODY)
    sig = hmac.new(_KEY, b"sb://ns/orders\n%d" % i, hashlib.sha256).digest()
    headers = {
        "BrokerProperties": orjson.dumps({"MessageId": f"m-{i}", "TimeToLive": 60}).decode(),
        "x-tenant": "t1",
        "Content-Type": "application/json",
    }
    props = {k.lower(): v for k, v in headers.items() if k.startswith("x-")}
    message = {"body": _BODY, "id": f"m-{i}", "props": props, "sig": sig, "n": len(doc["items"])}
    return len(orjson.dumps({"status": 201, "id": message["id"]}))


def spin_work(i: int) -> int:
    acc = i
    for k in range(100):
        acc = (acc + k * k) % 1_000_003
    return acc


WORKS: dict[str, Callable[[int], int]] = {"handler": handler_work, "spin": spin_work}


def calibrate(work: Callable[[int], int], work_us: float) -> int:
    """Repetitions of ``work`` that take about ``work_us`` microseconds."""
    calls = 2000
    started = time.perf_counter()
    for i in range(calls):
        work(i)
    per_call = (time.perf_counter() - started) / calls
    return max(1, round(work_us * 1e-6 / per_call))


async def serve(ledger: EventLedger, work: Callable[[int], int], reps: int, requests: int) -> None:
    emit = ledger.emit
    for i in range(requests):
        for _ in range(reps):
            work(i)
        emit(
            "accepted",
            message_id=f"m-{i}",
            entity="orders",
            route="primary",
            size=1024,
            latency_ms=0.05,
        )
        await asyncio.sleep(0)  # a handler awaits I/O: the writer task gets its turns


async def one_run(
    on: bool, work: Callable[[int], int], reps: int, n: int, root: Path, cold: bool = False
) -> tuple[float, float]:
    """(requests per second, requests per CPU second), including the ledger's final flush.

    CPU time is the whole process's (event loop and writer thread, user and system): on a
    machine shared with other work it is what throughput would be on a core of our own.
    """
    ledger: EventLedger = (
        Ledger(DirectorySink(root, "bench"), replica="bench") if on else NullLedger()
    )
    async with ledger:
        # Steady state, as in a running gateway: the writer thread is up and this hour's file
        # is open. Opening it (mkdir, open: a dozen syscalls, each a GIL hand-off with a busy
        # loop) costs ~0.1 s of CPU once per file, i.e. once an hour per replica in
        # production, but once per run here; it is reported separately (`--cold`).
        if not cold:
            ledger.emit("accepted", message_id="warm-up")
            await ledger.flush()
        warm = ledger.written
        started, cpu_started = time.perf_counter(), time.process_time()
        await serve(ledger, work, reps, n)
        await ledger.flush()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    if on and (ledger.written - warm != n or ledger.dropped):
        raise RuntimeError(f"ledger wrote {ledger.written - warm}/{n}, dropped {ledger.dropped}")
    return n / elapsed, n / cpu


async def measure(name: str, args: argparse.Namespace, root: Path) -> tuple[float, float]:
    """(median wall-clock ratio, median CPU ratio) of throughput with the ledger on vs off."""
    work = WORKS[name]
    reps = calibrate(work, args.work_us)
    await one_run(True, work, reps, 2000, root / "warmup")
    wall: list[float] = []
    cpu: list[float] = []
    starved = 0
    rates: dict[bool, list[float]] = {False: [], True: []}
    for p in range(args.pairs):
        order = (False, True) if p % 2 == 0 else (True, False)  # cancel drift within pairs
        pair: dict[bool, tuple[float, float]] = {}
        for on in order:
            pair[on] = await one_run(on, work, reps, args.requests, root / f"{name}-{p}", args.cold)
            rates[on].append(pair[on][0])
            if pair[on][0] < 0.8 * pair[on][1]:
                starved += 1  # got less than 80% of a CPU: other processes ran
        wall.append(pair[True][0] / pair[False][0])
        cpu.append(pair[True][1] / pair[False][1])
    w, c = statistics.median(wall), statistics.median(cpu)
    print(
        f"{name:8s} ~{args.work_us:.0f} µs/request: off {statistics.median(rates[False]):7.0f} "
        f"req/s, on {statistics.median(rates[True]):7.0f} req/s; on/off ratio: wall-clock "
        f"{w:.3f} (min {min(wall):.3f}, max {max(wall):.3f}), CPU {c:.3f} "
        f"(min {min(cpu):.3f}, max {max(cpu):.3f}); {args.pairs} pairs"
        + (f", {starved} of {2 * args.pairs} runs starved by other processes" if starved else "")
    )
    return w, c


async def emit_cost(events: int) -> float:
    """Microseconds per ``emit`` alone (buffered, writer not started)."""
    ledger = Ledger(
        DirectorySink(Path(tempfile.gettempdir()), "unused"), replica="b", capacity=events
    )
    started = time.perf_counter()
    for i in range(events):
        ledger.emit("accepted", message_id="m", entity="orders", route="primary", size=i)
    return (time.perf_counter() - started) / events * 1e6


# -- the real gateway ----------------------------------------------------------------------


def count_lines(root: Path) -> int:
    """Ledger lines under `root` (plain files: the bench's gateway does not compress)."""
    total = 0
    for path in root.rglob("*.jsonl"):
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                total += chunk.count(b"\n")
    return total


async def measure_gateway(args: argparse.Namespace, root: Path) -> float | None:
    """The gateway with the ledger on / off: (simultaneous CPU-cost ratio) or None."""
    cores = Cores.split()
    if cores.rest:
        os.sched_setaffinity(0, cores.rest)  # this process stays off the gateway's CPU
    p = Params(
        duration=args.duration,
        warmup=0.5,
        rounds=args.rounds,
        connections=args.connections,
        e2e_connections=args.connections,
        burst=0,
        quick=args.quick,
    )
    answered = {"on": 0, "off": 0}
    async with contextlib.AsyncExitStack() as stack:

        async def start(label: str, env: dict[str, str]) -> Server:
            server = await Server.start(label, "gateway", env, cpus=cores.subject)
            stack.push_async_callback(server.close)
            return server

        on = await start("on", _null_env(SBGATE_LEDGER=str(root)))
        off = await start("off", _null_env())
        rates = {
            "on": Rate("gateway, ledger on (directory)", "req/s", "gateway"),
            "off": Rate("gateway, ledger off", "req/s", "gateway"),
        }

        def party(server: Server) -> tuple[Rate, Callable[[], Awaitable[tuple[Window, int]]]]:
            rate = rates[server.label]

            async def run() -> tuple[Window, int]:
                window = await http_load(server, cores, p, {}, connections=p.connections)
                ok = _ok_count(window)
                answered[server.label] += ok
                return window, ok

            return rate, run

        async def at_once() -> None:
            await together(
                [(on, rates["on"]), (off, rates["off"])], cores, p, print, connections=p.connections
            )

        await alternate([party(on), party(off)], p.rounds, print, at_once)
        await on.close()  # its ledger is flushed and closed on SIGTERM
    lines = count_lines(root)
    _, thr = _median_ratio(rates["on"], rates["off"])
    sim, sim_text = _together_ratio(rates["on"], rates["off"])
    for rate in rates.values():
        print(f"  {rate.describe()}")
    alternating = _cpu_ratio(rates["on"], rates["off"])
    print(
        f"gateway  on/off: throughput {thr}, CPU per message {alternating}"
        f" alternating, {sim_text or 'n/a'} simultaneous; ledger lines {lines:,} for "
        f"{answered['on']:,}+ answers of the ledger-on gateway"
    )
    if lines < answered["on"]:
        print(f"  WARNING: {answered['on'] - lines:,} accepted requests without a ledger line")
    return sim


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


async def main_async(args: argparse.Namespace) -> float | None:
    print(
        f"ledger bench {args.workloads}: python {sys.version.split()[0]}, load average "
        f"{loadavg()} on {os.cpu_count()} CPUs",
        flush=True,
    )
    headline: float | None = None
    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        if "gateway" in args.workloads:
            headline = await measure_gateway(args, Path(tmp) / "gateway")
        if {"handler", "spin"} & set(args.workloads):
            print(f"emit alone: {await emit_cost(200_000):.2f} µs/event")
        for name in ("handler", "spin"):
            if name in args.workloads:
                _, cpu = await measure(name, args, Path(tmp))
                headline = cpu if headline is None else headline
    if headline is not None:
        what = "gateway CPU per message, simultaneous" if "gateway" in args.workloads else "CPU"
        print(
            f"ledger on/off ({what}): {headline:.3f} (goal >= {GOAL}; "
            f"{'met' if headline >= GOAL else 'not met'}); load average {loadavg()}"
        )
    return headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The ledger's cost, on vs off in one run.")
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="what to run"
    )
    parser.add_argument("--rounds", type=int, default=5, help="gateway: alternating rounds")
    parser.add_argument("--duration", type=float, default=3.0, help="gateway: s per window")
    parser.add_argument("--connections", type=int, default=64, help="gateway: h2load clients")
    parser.add_argument("--requests", type=int, default=20_000, help="in process: per run")
    parser.add_argument("--pairs", type=int, default=9, help="in process: on/off pairs")
    parser.add_argument("--work-us", type=float, default=50.0, help="in process: CPU work")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="time each run from a ledger whose file is not open yet (once an hour in production)",
    )
    quick = {
        "rounds": 1,
        "duration": 1.5,
        "requests": 5000,
        "pairs": 3,
        "workloads": ["gateway", "handler"],
    }
    args = parse_args(parser, argv, quick)
    asyncio.run(main_async(args))
    return 0  # figures are printed, never asserted


if __name__ == "__main__":
    raise SystemExit(main())
