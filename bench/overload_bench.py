"""P9: the gateway at 2x, 5x and 10x its sustainable request rate, as clients meet it.

    .venv/bin/python -m bench.overload_bench            # ~3 minutes
    .venv/bin/python -m bench.overload_bench --quick    # 8 s per load, one rate round
    .venv/bin/python -m bench.overload_bench --env SBGATE_MAX_REQUESTS_IN_PROGRESS=0  # no cap

The gateway runs on the real SDK against the local broker (`sblocal`), as in P2, pinned to
the first CPU; the load generators and the broker share the second. Traffic goes to
127.0.0.1 only, every run is bounded in time and count.

1. **Sustainable rate**: `bench.loadgen` (closed loop, 128 keep-alive clients) for a few
   windows; the median of the rates is what the gateway sustains here and now (the spread of
   the windows says how noisy the machine was).
2. **Unloaded**: `bench.openloop` at 0.5x that rate: the 2xx p99 the loaded runs are
   compared with, and the RSS baseline.
3. **The ladder**: open loop at each ``--factors`` multiple (arrivals follow the clock,
   answered or not), bounded at ``--max-connections`` requests in flight (an arrival with
   every connection busy is "client-shed": never sent), each request with a 30 s deadline.

Printed, in one table, per load: goodput as a share of the sustainable rate; the 2xx p50/p99
(from when each request was due) and the p99 against the unloaded one; the excess (due, not
answered 2xx) and how much of it **failed fast**, within ``--fast`` (1 s) of its due time,
counted apart: ``503`` answers, and connections refused or closed without an answer (the
gateway's connection cap); client-shed arrivals and client timeouts; the RSS growth over the
baseline. Goals at 2x and 5x: goodput >= 90%, 2xx p99 <= 1 s, >= 90% of the excess failed
fast, RSS growth <= 64 MiB (10x is reported against the same figures). And whether the
broker stored exactly the messages answered 2xx. The RSS curve goes to a PNG (path printed;
``bench/out/`` by default).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import Cores, cpu_seconds, cpu_ticks, gateway_on_broker, run_child
from bench.memwatch import (
    OUT_DIR,
    MiB,
    RssSampler,
    open_loop,
    plot,
    run_bench,
    series_by_kind,
    stored_vs_ok,
    write_json,
)

ENTITY_URL_PATH = "/queues/orders/messages"
GOAL_RSS = 64 * MiB


def _ok(statuses: dict[str, int]) -> int:
    return sum(v for k, v in statuses.items() if k.startswith("2"))


def _ms(values: dict[str, float]) -> str:
    if not values:
        return "n/a"
    return ", ".join(f"{k} {v:,.0f}" for k, v in values.items()) + " ms"


async def sustainable_rate(
    args: argparse.Namespace, cores: Cores, e2e: Any, log: Any
) -> tuple[float, list[float], list[str]]:
    """Closed-loop windows against the gateway; returns the median rate, every window's rate
    and the per-window correctness notes."""
    rates: list[float] = []
    checks: list[str] = []
    for i in range(args.rounds):
        await e2e.control.reset()
        window = await run_child(
            "loadgen",
            "bench.loadgen",
            [
                "--url",
                e2e.gateway.url + ENTITY_URL_PATH,
                "--connections",
                str(args.connections),
                "--duration",
                str(args.window),
                "--warmup",
                "1",
            ],
            watch={"gateway": e2e.gateway.pid, "broker": e2e.broker.pid},
            cpus=cores.rest,
            within=args.window + 60,
        )
        ok = _ok(window.result["statuses"])
        rate = ok / window.wall
        rates.append(rate)
        busy = window.cpu["gateway"] / window.wall
        check = await stored_vs_ok(
            e2e.control, int(window.result["total_ok"]), ("primary", "secondary")
        )
        checks.append(check)
        log(
            f"  window {i + 1}/{args.rounds}: {rate:,.0f} req/s (gateway busy {busy:.0%} of its "
            f"CPU, p99 {window.result['p99_ms']:.0f} ms); {check}"
        )
    return statistics.median(rates), rates, checks


GOAL_GOODPUT = 0.90  # of the sustainable rate, at 2x and 5x
GOAL_P99_MS = 1000.0  # 2xx p99, at 2x and 5x
GOAL_FAST = 0.90  # share of the excess that fails fast, at 2x and 5x
GOALS_AT = (2.0, 5.0)


async def phase(
    args: argparse.Namespace, cores: Cores, e2e: Any, rss: RssSampler, rate: float, factor: float
) -> dict[str, Any]:
    """One open-loop run at `factor` x `rate`; its answers, latencies and RSS peak."""
    await e2e.control.reset()
    await asyncio.sleep(1.0)  # let the previous run's connections close
    offered = rate * factor
    cpu0 = cpu_seconds(e2e.gateway.pid), cpu_ticks(cores.rest)
    async with open_loop(
        e2e.gateway.url + ENTITY_URL_PATH,
        cores,
        [
            "--rate",
            f"{offered:.1f}",
            "--duration",
            str(args.duration),
            "--max-connections",
            str(args.max_connections),
            "--timeout",
            str(args.timeout),
            "--limit",
            str(args.fast),
            "--fast",
            str(args.fast),
        ],
    ) as load:
        result = await load.end(args.duration + args.timeout + 60)
    drained = time.monotonic()
    wall = drained - load.started
    rest_busy, rest_total = (a - b for a, b in zip(cpu_ticks(cores.rest), cpu0[1], strict=True))
    check = await stored_vs_ok(
        e2e.control, int(result["total_ok"]), ("primary",), sum(result["errors"].values())
    )
    window = [*rss.between(load.started, load.ended), *rss.between(load.ended, drained)]
    return {
        "factor": factor,
        "offered": offered,
        "result": {k: v for k, v in result.items() if k != "series"},
        "series": result,
        "peak": max(window, default=0),
        "span": (load.started, load.ended),
        "correctness": check,
        # Whose CPU ran out: the gateway's own (its CPU) or the broker's and the load
        # generator's (the other one), from the load's start until it drained.
        "gateway_busy": (cpu_seconds(e2e.gateway.pid) - cpu0[0]) / wall if wall > 0 else 0.0,
        "rest_busy": rest_busy / rest_total if rest_total else float("nan"),
    }


def summarize(p: dict[str, Any], rate: float, baseline: int, unloaded_p99: float) -> dict[str, Any]:
    """The figures of one phase that the table prints, against the goals."""
    r = p["result"]
    statuses: dict[str, int] = r["statuses"]
    ok = _ok(statuses)
    due = int(r["due"])
    excess = max(0, due - ok)
    fast_503 = int(r["unavailable_fast"])
    fast_conn = sum(int(v) for v in r["failed_fast"].values())
    ok_lat = [r["latency_ms"][k] for k in r["latency_ms"] if k.startswith("2")]
    p50 = max((x["p50"] for x in ok_lat), default=float("nan"))
    p99 = max((x["p99"] for x in ok_lat), default=float("nan"))
    goodput = ok / float(r["wall"]) / rate if rate else float("nan")
    fast_share = (fast_503 + fast_conn) / excess if excess else 1.0
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
        "p99_vs_unloaded": p99 / unloaded_p99 if unloaded_p99 else float("nan"),
        "excess": excess,
        "failed_fast_503": fast_503,
        "failed_fast_connection": fast_conn,
        "client_shed": int(r["shed"]),
        "timeouts": int(r["errors"].get("timeout", 0)),
        "fast_share": fast_share,
        "rss_growth": growth,
        "judged": judged,
        "met": met if judged else None,
        "correctness": p["correctness"],
        "gateway_busy": p["gateway_busy"],
        "rest_busy": p["rest_busy"],
    }


def _yes(ok: bool | None) -> str:
    return "" if ok is None else (" ok" if ok else " NO")


async def bench(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    async with gateway_on_broker(cores, dict(args.env)) as e2e:
        rss = RssSampler(e2e.gateway.pid, interval=0.5).start()
        try:
            first = rss.sample() or 0
            log(f"gateway up (pid {e2e.gateway.pid}), RSS {first / MiB:.1f} MiB")
            log(f"\n== sustainable rate: {args.rounds} x {args.window:g} s, closed loop")
            rate, rates, checks = await sustainable_rate(args, cores, e2e, log)
            spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
            log(f"-> sustainable: {rate:,.0f} req/s (median; windows {spread})")
            phases = []
            for factor in (0.5, *args.factors):
                log(f"\n== {factor:g}x: {rate * factor:,.0f} req/s offered for {args.duration:g} s")
                phases.append(await phase(args, cores, e2e, rss, rate, factor))
                log(f"   {phases[-1]['correctness']}")
            await asyncio.sleep(args.cooldown)
            after = rss.sample() or 0
        finally:
            await rss.close()
    baseline = phases[0]["peak"] or first
    unloaded = summarize(phases[0], rate, baseline, 0.0)
    rows = [summarize(p, rate, baseline, unloaded["p99_ms"]) for p in phases[1:]]

    log(f"\n== P9 overload ladder ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    log(
        f"sustainable {rate:,.0f} req/s (windows {spread}); unloaded (0.5x, open loop) 2xx p50 "
        f"{unloaded['p50_ms']:.0f} ms, p99 {unloaded['p99_ms']:.0f} ms; RSS baseline "
        f"{baseline / MiB:.1f} MiB (peak of the unloaded run)"
    )
    log(
        "| load | offered req/s | goodput / sustainable | 2xx p50 / p99 ms (p99 / unloaded) "
        "| excess | 503 <= 1 s | refused/closed <= 1 s | failed fast | client-shed | timeouts "
        "| RSS growth | CPU busy: gateway / broker + client |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        met = row["met"] or {}
        log(
            f"| {row['factor']:g}x | {row['offered']:,.0f} | {row['goodput_share']:.0%}"
            f"{_yes(met.get('goodput'))} | {row['p50_ms']:,.0f} / {row['p99_ms']:,.0f} "
            f"({row['p99_vs_unloaded']:.1f}x){_yes(met.get('p99'))} | {row['excess']:,} | "
            f"{row['failed_fast_503']:,} | {row['failed_fast_connection']:,} | "
            f"{row['fast_share']:.0%}{_yes(met.get('fast'))} | {row['client_shed']:,} | "
            f"{row['timeouts']:,} | {row['rss_growth'] / MiB:+.1f} MiB{_yes(met.get('rss'))} "
            f"| {row['gateway_busy']:.0%} / {row['rest_busy']:.0%} |"
        )
    log(
        f"goals at {', '.join(f'{f:g}x' for f in GOALS_AT)}: goodput >= {GOAL_GOODPUT:.0%} of "
        f"sustainable, 2xx p99 <= {GOAL_P99_MS:.0f} ms, >= {GOAL_FAST:.0%} of the excess "
        f"failed fast (503 or refused/closed within {args.fast:g} s), RSS growth <= 64 MiB. "
        "client-shed: arrivals the load generator never sent (all its connections busy): "
        "counted in the excess, not as failed fast. CPU busy: the gateway process's share of "
        "its CPU, and how busy the other CPU (the broker and the load generator) was: a "
        "goodput short of the sustainable rate with the gateway under ~90% busy and the other "
        "CPU at ~100% was lost on the other CPU, not in the gateway."
    )
    for row in rows:
        log(f"  {row['factor']:g}x: {row['correctness']}")
    log(f"RSS {after / MiB:.1f} MiB after {args.cooldown:g} s of calm")

    png = Path(args.out) / "overload_rss.png"
    last = phases[-1]
    t_start = rss.samples[0][0]
    plot(
        png,
        f"P9: the gateway at {', '.join(f'{f:g}x' for f in args.factors)} its sustainable rate "
        f"({rate:,.0f} req/s)",
        rss.samples,
        t_start,
        [(p["span"][0] - t_start, p["span"][1] - t_start, f"{p['factor']:g}x") for p in phases],
        series_by_kind(last["series"]),
        float(last["series"]["t0"]),
    )
    log(f"RSS curve: {png}")
    out = {
        "sustainable_rate": rate,
        "sustainable_windows": rates,
        "sustainable_checks": checks,
        "unloaded": unloaded,
        "rows": rows,
        "rss_first": first,
        "rss_after": after,
        "png": str(png),
    }
    write_json(Path(args.out) / "overload.json", {**out, "rss": rss.samples})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overload_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="8 s per load, one rate round")
    parser.add_argument("--duration", type=float, help="seconds per load (20; quick 8)")
    parser.add_argument(
        "--factors", default="2,5,10", help="x the sustainable rate, comma-separated (2,5,10)"
    )
    parser.add_argument(
        "--fast", type=float, default=1.0, help="a failure this soon after its due time is fast"
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
    parser.add_argument("--max-connections", type=int, default=4000, help="open-loop bound")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline")
    parser.add_argument("--cooldown", type=float, default=10.0, help="seconds of calm after")
    parser.add_argument("--out", default=str(OUT_DIR), help="where the PNG and JSON go")
    args = parser.parse_args(argv)
    args.duration = args.duration or (8.0 if args.quick else 20.0)
    args.factors = [float(f) for f in args.factors.split(",")]
    args.rounds = args.rounds or (1 if args.quick else 3)
    return run_bench("P9 overload", lambda cores, log: bench(args, cores, log))


if __name__ == "__main__":
    raise SystemExit(main())
