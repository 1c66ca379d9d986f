"""P9: the gateway at 2x, 5x and 10x its sustainable request rate, as clients meet it.

    make bench-tools                                    # h2load and wrk (apt), once
    .venv/bin/python -m bench.overload_bench            # ~2 minutes
    .venv/bin/python -m bench.overload_bench --quick    # 6 s per load, one rate window
    .venv/bin/python -m bench.overload_bench --sink null   # the gateway alone, no broker
    .venv/bin/python -m bench.overload_bench --broker-latency-ms 20  # broker slowed mid-run
    .venv/bin/python -m bench.overload_bench --env SBGATE_ADAPTIVE_ADMISSION=true

The gateway runs pinned to the first CPU, with the real SDK against the local broker
(`sblocal`) on the second (``--sink null``: a sink that stores nothing, to isolate the gateway
from the broker). The load comes from `h2load` (Debian's nghttp2-client, `bench.native`),
pinned to the second CPU: a C event loop, a fraction of the CPU per request a Python
generator spent (which, on the same CPU as the broker, was the bottleneck: at 2x that CPU was
97-99 % busy). Traffic goes to 127.0.0.1 only; every phase is bounded in time (h2load is
killed past its duration + 30 s) and prints what it measured.

1. **Sustainable rate**: h2load closed loop (``--connections`` keep-alive clients) for a few
   windows; the median rate answered 2xx is what the gateway sustains here and now.
2. **Unloaded**: open loop at 0.5x that rate: the 2xx p99 the loaded runs are compared with,
   and the RSS baseline.
3. **The ladder**: open loop at each ``--factors`` multiple, ``--max-connections`` clients
   each pacing its share of the rate (``--rps``).

Printed, in one table, per load: goodput as a share of the sustainable rate; the 2xx p50/p99;
the excess (due, not answered 2xx) and how much of it was refused fast (a ``503`` or a
connection failure within ``--fast``, 50 ms, of being sent); arrivals the generator could not
send within the run (client-shed); the RSS growth; the CPU of the gateway, the broker and the
generator, each as a share of one CPU. The goals (issue #38), judged at 2x, 5x and 10x, each
marked met or not: goodput >= 90 %, >= 90 % of the excess refused within 50 ms, 2xx p99 <=
100 ms, RSS growth <= 64 MiB. And whether the broker stored exactly the messages answered
2xx. Latency is from when a request was sent (h2load's), not from when it was due.

On a shared machine absolute figures mean little and ratios are noisy: the header prints the
load average, and a figure is only as good as the quiet it was measured in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import IN_MEMORY_ENV, Cores, Server, gateway_on_broker
from bench.loadgen import make_body
from bench.memwatch import OUT_DIR, MiB, RssSampler, run_bench, stored_vs_ok, write_json
from bench.native import H2Load, loadavg, run_h2load

ENTITY_URL_PATH = "/queues/orders/messages"
BODY = make_body(1024)  # the body bench.loadgen sends
GOAL_GOODPUT = 0.90  # of the sustainable rate
GOAL_FAST = 0.90  # share of the excess refused within --fast
GOAL_P99_MS = 100.0  # 2xx p99
GOAL_RSS = 64 * MiB
GOALS_AT = (2.0, 5.0, 10.0)


def _ok(statuses: dict[str, int]) -> int:
    return sum(v for k, v in statuses.items() if k.startswith("2"))


class Stack:
    """What the ladder runs against: the gateway, and the broker unless the sink is null."""

    def __init__(self, gateway: Server, e2e: Any | None) -> None:
        self.gateway = gateway
        self.e2e = e2e

    @property
    def watch(self) -> dict[str, int | None]:
        return {
            "gateway": self.gateway.pid,
            "broker": self.e2e.broker.pid if self.e2e is not None else None,
        }

    async def reset(self) -> None:
        if self.e2e is not None:
            await self.e2e.control.reset()

    async def check(self, total_ok: int, abandoned: int) -> str:
        if self.e2e is None:
            return "null sink: nothing stored to compare"
        return await stored_vs_ok(self.e2e.control, total_ok, ("primary",), abandoned)


async def sustainable_rate(
    args: argparse.Namespace, cores: Cores, stack: Stack, log: Any
) -> tuple[float, list[float]]:
    """Closed-loop windows; returns the median 2xx rate and every window's."""
    rates: list[float] = []
    for i in range(args.rounds):
        await stack.reset()
        load = H2Load(
            [stack.gateway.url + ENTITY_URL_PATH],
            args.window,
            connections=args.connections,
            body=BODY,
        )
        window = await run_h2load(load, cpus=cores.rest, watch=stack.watch)
        r = window.result
        rate = _ok(r["statuses"]) / window.wall
        rates.append(rate)
        check = await stack.check(int(r["total_ok"]), int(r["unanswered_at_end"]))
        log(
            f"  window {i + 1}/{args.rounds}: {rate:,.0f} req/s 2xx ({_cpu(window)}; 2xx p99 "
            f"{r['latency_ms'].get('201', {}).get('p99', float('nan')):.0f} ms, "
            f"statuses {r['statuses']}); {check}"
        )
    return statistics.median(rates), rates


def _cpu(window: Any) -> str:
    wall = window.wall or 1.0
    parts = [f"{k} {v / wall:.0%}" for k, v in window.cpu.items() if v or k == "h2load"]
    return "CPU " + ", ".join(parts)


async def _slow_broker(stack: Stack, after: float, ms: float) -> None:
    await asyncio.sleep(after)
    if stack.e2e is not None:
        await stack.e2e.control.set_latency("primary", round_trip_ms=ms)


async def phase(
    args: argparse.Namespace,
    cores: Cores,
    stack: Stack,
    rss: RssSampler,
    rate: float,
    factor: float,
) -> dict[str, Any]:
    """One open-loop run at `factor` x `rate`: its answers, latencies, CPU and RSS peak."""
    await stack.reset()
    await asyncio.sleep(1.0)  # let the previous run's connections close
    offered = rate * factor
    load = H2Load(
        [stack.gateway.url + ENTITY_URL_PATH],
        args.duration,
        connections=min(args.max_connections, max(32, round(offered / args.client_rate))),
        rate=offered,
        body=BODY,
        timeout=args.timeout,
        fast=args.fast,
    )
    slow = None
    if args.broker_latency_ms and factor != 0.5:
        slow = asyncio.create_task(_slow_broker(stack, args.duration / 2, args.broker_latency_ms))
    started = time.monotonic()
    try:
        window = await run_h2load(load, cpus=cores.rest, watch=stack.watch)
    finally:
        if slow is not None:
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow
    ended = time.monotonic()
    limit = await adaptive_limit(stack.gateway.url)
    r = window.result
    abandoned = sum(int(v) for v in r["errors"].values()) + int(r["unanswered_at_end"])
    check = await stack.check(int(r["total_ok"]), abandoned)
    return {
        "factor": factor,
        "offered": offered,
        "result": {k: v for k, v in r.items() if k != "series"},
        "series": r["series"],
        "peak": max(rss.between(started, ended + 1.0), default=0),
        "span": (started, ended),
        "correctness": check,
        "cpu": {k: v / window.wall for k, v in window.cpu.items()},
        "adaptive": limit,
    }


_ADAPTIVE = re.compile(
    r'^sbgate_admission_limit(_baseline_seconds|_refused_total)?\{namespace="primary"\} (\S+)$',
    re.M,
)


async def adaptive_limit(url: str) -> dict[str, float]:
    """The primary namespace's adaptive limit, baseline and refusals from the gateway's
    /metrics at the end of a phase (empty when adaptive admission is off)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    names = {"": "limit", "_baseline_seconds": "baseline_s", "_refused_total": "refused"}
    return {names[m.group(1) or ""]: float(m.group(2)) for m in _ADAPTIVE.finditer(text)}


def summarize(p: dict[str, Any], rate: float, baseline: int) -> dict[str, Any]:
    """The figures of one phase that the table prints, against the goals."""
    r = p["result"]
    ok = _ok(r["statuses"])
    excess = max(0, int(r["due"]) - ok)
    shed = int(r["shed"])
    fast = int(r["unavailable_fast"]) + sum(int(v) for v in r["failed_fast"].values())
    # The share refused fast is of the excess the gateway was sent: what h2load never sent
    # (client-shed) the gateway could not refuse. A run whose client-shed is over a tenth of
    # the arrivals is generator-bound there (too few connections for the latency): judged
    # on what was sent, and flagged.
    sent_excess = max(0, excess - shed)
    ok_lat = [v for k, v in r["latency_ms"].items() if k.startswith("2") and v]
    p50 = max((x["p50"] for x in ok_lat), default=float("nan"))
    p99 = max((x["p99"] for x in ok_lat), default=float("nan"))
    goodput = ok / float(r["wall"]) / rate if rate else float("nan")
    fast_share = fast / sent_excess if sent_excess else 1.0
    growth = p["peak"] - baseline
    judged = p["factor"] in GOALS_AT
    met = {
        "goodput": goodput >= GOAL_GOODPUT,
        "p99": p99 <= GOAL_P99_MS,
        "fast": fast_share >= GOAL_FAST,
        "rss": growth <= GOAL_RSS,
    }
    return {
        "factor": p["factor"],
        "offered": p["offered"],
        "goodput_share": goodput,
        "p50_ms": p50,
        "p99_ms": p99,
        "excess": excess,
        "refused_fast": fast,
        "statuses": r["statuses"],
        "client_shed": shed,
        "shed_share": shed / int(r["due"]) if int(r["due"]) else 0.0,
        "errors": r["errors"],
        "fast_share": fast_share,
        "rss_growth": growth,
        "judged": judged,
        "met": met if judged else None,
        "correctness": p["correctness"],
        "cpu": p["cpu"],
        "adaptive": p["adaptive"],
    }


def _yes(ok: bool | None) -> str:
    return "" if ok is None else (" met" if ok else " NOT met")


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| load | offered req/s | goodput / sustainable | 2xx p50 / p99 ms | excess "
        "| of it sent, refused <= fast | client-shed (of arrivals) | RSS growth "
        "| CPU: gateway / broker / h2load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = row["met"] or {}
        cpu = row["cpu"]
        lines.append(
            f"| {row['factor']:g}x | {row['offered']:,.0f} | {row['goodput_share']:.0%}"
            f"{_yes(met.get('goodput'))} | {row['p50_ms']:,.0f} / {row['p99_ms']:,.0f}"
            f"{_yes(met.get('p99'))} | {row['excess']:,} | {row['fast_share']:.0%}"
            f"{_yes(met.get('fast'))} | {row['client_shed']:,} ({row['shed_share']:.0%})"
            f"{' generator-bound' if row['shed_share'] > 0.1 else ''} | "
            f"{row['rss_growth'] / MiB:+.1f} MiB{_yes(met.get('rss'))} | "
            f"{cpu.get('gateway', 0):.0%} / {cpu.get('broker', 0):.0%} / "
            f"{cpu.get('h2load', 0):.0%} |"
        )
    return lines


async def _stack(args: argparse.Namespace, cores: Cores) -> Any:
    """The gateway on the broker, or (``--sink null``) alone: an async context manager."""

    @contextlib.asynccontextmanager
    async def null() -> Any:
        env = {**IN_MEMORY_ENV, **dict(args.env)}
        gateway = await Server.start("gateway", "gateway", env, cpus=cores.subject, sink="null")
        try:
            yield Stack(gateway, None)
        finally:
            await gateway.close()

    @contextlib.asynccontextmanager
    async def sdk() -> Any:
        async with gateway_on_broker(cores, dict(args.env)) as e2e:
            yield Stack(e2e.gateway, e2e)

    return null() if args.sink == "null" else sdk()


async def bench(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    async with await _stack(args, cores) as stack:
        rss = RssSampler(stack.gateway.pid, interval=0.5).start()
        try:
            first = rss.sample() or 0
            log(
                f"gateway up (pid {stack.gateway.pid}, sink {args.sink}), RSS {first / MiB:.1f} MiB"
            )
            log(f"\n== sustainable rate: {args.rounds} x {args.window:g} s, h2load closed loop")
            rate, rates = await sustainable_rate(args, cores, stack, log)
            spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
            log(f"-> sustainable: {rate:,.0f} req/s (median; windows {spread})")
            phases = []
            for factor in (0.5, *args.factors):
                log(f"\n== {factor:g}x: {rate * factor:,.0f} req/s offered for {args.duration:g} s")
                phases.append(await phase(args, cores, stack, rss, rate, factor))
                r = phases[-1]["result"]
                log(
                    f"   statuses {r['statuses']}, errors {r['errors']}, in flight at the end "
                    f"{r['unanswered_at_end']:,}, client-shed {r['shed']:,}; CPU "
                    + ", ".join(f"{k} {v:.0%}" for k, v in phases[-1]["cpu"].items())
                    + f"; {phases[-1]['correctness']}"
                )
            await asyncio.sleep(args.cooldown)
            after = rss.sample() or 0
        finally:
            await rss.close()
    baseline = phases[0]["peak"] or first
    unloaded = summarize(phases[0], rate, baseline)
    rows = [summarize(p, rate, baseline) for p in phases[1:]]
    slow = (
        f"; the broker's round trip set to {args.broker_latency_ms:g} ms half-way through each "
        "loaded phase"
        if args.broker_latency_ms
        else ""
    )
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"\n== P9 overload ladder ({now}, {loadavg()})")
    log(
        f"sink {args.sink}; sustainable {rate:,.0f} req/s (windows {spread}); unloaded (0.5x) "
        f"2xx p50 {unloaded['p50_ms']:.0f} ms, p99 {unloaded['p99_ms']:.0f} ms; RSS baseline "
        f"{baseline / MiB:.1f} MiB{slow}"
    )
    for line in table(rows):
        log(line)
    log(
        f"goals at {', '.join(f'{f:g}x' for f in GOALS_AT)}: goodput >= {GOAL_GOODPUT:.0%} of "
        f"sustainable; >= {GOAL_FAST:.0%} of the excess that was sent refused (503 or "
        f"connection failure) within {args.fast * 1000:g} ms; 2xx p99 <= {GOAL_P99_MS:.0f} ms; "
        "RSS growth <= 64 MiB. client-shed: arrivals h2load could not send within the run "
        "(each client holds one request at a time: every client's last one unanswered); "
        "over 10 % of the arrivals, the load was generator-bound (raise --max-connections "
        "or lower --client-rate). CPU: each process's share of one CPU (the gateway has the "
        "first CPU; the broker and h2load share the second); on a shared machine the shares "
        "need not add up to saturation."
    )
    for row in rows:
        a = row["adaptive"]
        limit = (
            f"; adaptive limit {a.get('limit', 0):.0f} (baseline "
            f"{a.get('baseline_s', float('nan')) * 1000:.1f} ms, {a.get('refused', 0):,.0f} "
            "refused so far)"
            if a
            else ""
        )
        log(f"  {row['factor']:g}x: {row['correctness']}{limit}")
    log(f"RSS {after / MiB:.1f} MiB after {args.cooldown:g} s of calm")
    out = {
        "sink": args.sink,
        "loadavg": loadavg(),
        "sustainable_rate": rate,
        "sustainable_windows": rates,
        "unloaded": unloaded,
        "rows": rows,
        "rss_first": first,
        "rss_after": after,
        "series": {f"{p['factor']:g}x": p["series"] for p in phases},
    }
    write_json(Path(args.out) / f"overload-{args.sink}.json", {**out, "rss": rss.samples})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overload_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="6 s per load, one rate window")
    parser.add_argument("--duration", type=float, help="seconds per load (15; quick 6)")
    parser.add_argument(
        "--factors", default="2,5,10", help="x the sustainable rate, comma-separated (2,5,10)"
    )
    parser.add_argument(
        "--fast", type=float, default=0.05, help="a refusal this soon after sending is fast"
    )
    parser.add_argument("--sink", choices=("sdk", "null"), default="sdk")
    parser.add_argument(
        "--broker-latency-ms",
        type=float,
        default=0.0,
        help="raise the broker's round trip to this half-way through each loaded phase",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=lambda kv: tuple(kv.split("=", 1)),
        help="NAME=value: a gateway setting (e.g. SBGATE_MAX_REQUESTS_IN_PROGRESS=0)",
    )
    parser.add_argument("--rounds", type=int, help="sustainable-rate windows (3; quick 1)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per rate window")
    parser.add_argument("--connections", type=int, default=128, help="clients, rate windows")
    parser.add_argument("--max-connections", type=int, default=4000, help="open-loop clients")
    parser.add_argument(
        "--client-rate",
        type=float,
        default=100.0,
        help="requests a second each open-loop client paces (h2load's timers fire together: "
        "many slow clients send in bursts)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline")
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds of calm after")
    parser.add_argument("--out", default=str(OUT_DIR), help="where the JSON goes")
    args = parser.parse_args(argv)
    args.duration = args.duration or (6.0 if args.quick else 15.0)
    args.factors = [float(f) for f in args.factors.split(",")]
    args.rounds = args.rounds or (1 if args.quick else 3)
    return run_bench("P9 overload", lambda cores, log: bench(args, cores, log))


if __name__ == "__main__":
    raise SystemExit(main())
