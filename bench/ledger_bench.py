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
  ``emit`` and an ``await asyncio.sleep(0)``; short chunks of requests alternate between one
  open ledger writing real files and a ``NullLedger``, each chunk's events flushed before
  the next; per CPU second of the process (writer thread included) and wall-clock. A real
  request costs several times 50 µs, so the same per-event cost is a larger share here.

    .venv/bin/python -m bench.ledger_bench [--workloads gateway handler spin] [--rounds 5]
        [--duration 3] [--requests 4000] [--pairs 25] [--work-us 50]

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


async def one_chunk(
    ledger: EventLedger, work: Callable[[int], int], reps: int, n: int
) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of `n` requests, the ledger's flush of their events included.

    CPU time is the whole process's (event loop and writer thread, user and system): on a
    machine shared with other work it is what throughput would be on a core of our own.
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    await serve(ledger, work, reps, n)
    await ledger.flush()
    return time.perf_counter() - started, time.process_time() - cpu_started


async def measure(name: str, args: argparse.Namespace, root: Path) -> tuple[float, float]:
    """(median wall-clock ratio, median CPU ratio) of throughput with the ledger on vs off.

    One ledger writing real files stays open for the whole measurement, as in a running
    gateway (its writer thread up, this hour's file open), and short chunks of requests
    alternate between it and a ``NullLedger``: the other work on a shared machine then falls
    on both sides alike.
    """
    work = WORKS[name]
    reps = calibrate(work, args.work_us)
    off = NullLedger()
    wall: list[float] = []
    cpu: list[float] = []
    starved = 0
    totals = {False: [0.0, 0.0], True: [0.0, 0.0]}
    async with Ledger(DirectorySink(root / name, "bench"), replica="bench") as on:
        await one_chunk(on, work, reps, 1000)  # warm-up: the file is open
        written = on.written
        for p in range(args.pairs):
            pair: dict[bool, tuple[float, float]] = {}
            for side in (False, True) if p % 2 == 0 else (True, False):
                pair[side] = await one_chunk(on if side else off, work, reps, args.requests)
                totals[side][0] += pair[side][0]
                totals[side][1] += pair[side][1]
                if pair[side][1] < 0.8 * pair[side][0]:
                    starved += 1  # got less than 80% of a CPU: other processes ran
            wall.append(pair[False][0] / pair[True][0])
            cpu.append(pair[False][1] / pair[True][1])
    if on.written - written != args.pairs * args.requests or on.dropped:
        raise RuntimeError(f"ledger wrote {on.written - written}, dropped {on.dropped}")
    w, c = statistics.median(wall), statistics.median(cpu)
    n = args.pairs * args.requests
    print(
        f"{name:8s} ~{args.work_us:.0f} µs/request: CPU µs/request off "
        f"{totals[False][1] / n * 1e6:.1f}, on {totals[True][1] / n * 1e6:.1f}; on/off ratio: "
        f"CPU {c:.3f} (pairs {min(cpu):.3f}..{max(cpu):.3f}), wall-clock {w:.3f} "
        f"({min(wall):.3f}..{max(wall):.3f}); {args.pairs} pairs of {args.requests} requests"
        + (f", {starved} of {2 * args.pairs} chunks starved by other processes" if starved else "")
    )
    return w, c


async def ledger_cost(root: Path, batches: int = 20, size: int = 4096) -> tuple[float, float]:
    """(``emit``, writing) CPU µs per event, each timed alone in a tight loop: the parts the
    on/off ratio is made of, measured without a neighbour's noise in between.

    ``emit`` is timed on the loop thread for `size` events of a gateway request's kind
    (message id, entity, route, size, latency); then ``flush`` of those events, by the
    process's CPU: stamping and encoding on the loop, the write in the writer thread. The
    median of `batches` rounds.
    """
    emit_us: list[float] = []
    write_us: list[float] = []
    async with Ledger(DirectorySink(root / "parts", "bench"), replica="bench") as ledger:
        emit = ledger.emit
        ledger.emit("accepted", message_id="warm-up")
        await ledger.flush()  # the writer thread is up and the file is open
        for b in range(batches):
            ids = [f"m-{b}-{i}" for i in range(size)]
            started = time.thread_time()
            for mid in ids:
                emit(
                    "accepted",
                    message_id=mid,
                    entity="orders",
                    route="primary",
                    size=1024,
                    latency_ms=0.25,
                )
            emit_us.append((time.thread_time() - started) / size * 1e6)
            started = time.process_time()
            await ledger.flush()
            write_us.append((time.process_time() - started) / size * 1e6)
    return statistics.median(emit_us), statistics.median(write_us)


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
            emit_us, write_us = await ledger_cost(Path(tmp))
            print(
                f"the ledger's own CPU per event, timed alone: emit {emit_us:.2f} µs, stamping, "
                f"encoding and writing {write_us:.2f} µs; at {args.work_us:.0f} µs a request "
                f"that is a ratio of {args.work_us / (args.work_us + emit_us + write_us):.3f}"
            )
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
    parser.add_argument("--requests", type=int, default=4000, help="in process: per chunk")
    parser.add_argument("--pairs", type=int, default=25, help="in process: on/off chunk pairs")
    parser.add_argument("--work-us", type=float, default=50.0, help="in process: CPU work")
    quick = {
        "rounds": 1,
        "duration": 1.5,
        "requests": 2000,
        "pairs": 5,
        "workloads": ["gateway", "handler"],
    }
    args = parse_args(parser, argv, quick)
    asyncio.run(main_async(args))
    return 0  # figures are printed, never asserted


if __name__ == "__main__":
    raise SystemExit(main())
