"""P9: the gateway's memory and answers at 10x its sustainable request rate.

    .venv/bin/python -m bench.overload_bench            # ~2 minutes
    .venv/bin/python -m bench.overload_bench --quick    # 15 s of overload, one rate round

The gateway runs on the real SDK against the local broker (`sblocal`), as in P2, pinned to
the first CPU; the load generators and the broker share the second.

1. **Sustainable rate**: `bench.loadgen` (closed loop, 128 keep-alive clients) for a few
   windows; the median of the rates is what the gateway sustains here and now (the spread of
   the windows says how noisy the machine was).
2. **Overload**: `bench.openloop` offers 10x that rate for 60 s, open loop (arrivals follow
   the clock, answered or not), bounded at ``--max-connections`` requests in flight (an
   arrival with every connection busy is shed by the client and never sent), each request
   with a 30 s deadline. Traffic goes to 127.0.0.1 only.

Printed: the gateway's RSS (``VmRSS`` every 0.5 s) before, at its peak and after — goal: it
grows by at most 64 MB; the answers by status; the share of the excess requests (due and not
answered 2xx) that got ``503`` with ``Retry-After``; the time to each ``503`` (from the moment
its request was due) against ``admission_timeout`` — goal: every excess request answered
``503`` with ``Retry-After`` within it; and whether the broker stored exactly the messages
answered 2xx. The RSS curve goes to a PNG (path printed; ``bench/out/`` by default).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import Cores, cpu_seconds, run_child
from bench.memwatch import (
    OUT_DIR,
    MiB,
    RssSampler,
    gateway_on_broker,
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


async def bench(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    extra = {}
    if args.admission_timeout is not None:
        extra["SBGATE_ADMISSION_TIMEOUT"] = str(args.admission_timeout)
    limit = args.admission_timeout if args.admission_timeout is not None else 2.0
    async with gateway_on_broker(cores, extra) as e2e:
        rss = RssSampler(e2e.gateway.pid, interval=0.5).start()
        try:
            first = rss.sample() or 0
            log(f"gateway up (pid {e2e.gateway.pid}), RSS {first / MiB:.1f} MiB")
            log(f"\n== sustainable rate: {args.rounds} x {args.window:g} s, closed loop")
            rate, rates, checks = await sustainable_rate(args, cores, e2e, log)
            spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
            log(f"-> sustainable: {rate:,.0f} req/s (median; windows {spread})")

            offered = rate * args.factor
            await e2e.control.reset()
            await asyncio.sleep(1.0)  # let the last window's connections close
            baseline = rss.sample() or first
            log(
                f"\n== overload: {offered:,.0f} req/s offered ({args.factor:g}x) for "
                f"{args.duration:g} s, open loop, at most {args.max_connections} in flight; "
                f"RSS before {baseline / MiB:.1f} MiB"
            )
            cpu0 = cpu_seconds(e2e.gateway.pid)
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
                    str(limit),
                ],
            ) as load:
                result = await load.end(args.duration + args.timeout + 60)
            gateway_cpu = cpu_seconds(e2e.gateway.pid) - cpu0
            drained = time.monotonic()
            check = await stored_vs_ok(
                e2e.control, int(result["total_ok"]), ("primary",), sum(result["errors"].values())
            )
            await asyncio.sleep(args.cooldown)
            after = rss.sample() or 0
        finally:
            await rss.close()
        window = rss.between(load.started, load.ended)
        peak = max([*window, *rss.between(load.ended, drained)], default=baseline)

    statuses: dict[str, int] = result["statuses"]
    ok = _ok(statuses)
    due = int(result["due"])
    excess = due - ok
    with_ra = int(result["unavailable_with_retry_after"])
    n503 = statuses.get("503", 0)
    over = int(result["unavailable_over_limit"])
    growth = peak - baseline
    out = {
        "sustainable_rate": rate,
        "sustainable_windows": rates,
        "sustainable_checks": checks,
        "offered_rate": offered,
        "arrival_rate": due / float(result["wall"]),
        "load": {k: v for k, v in result.items() if k != "series"},
        "excess": excess,
        "unavailable_with_retry_after": with_ra,
        "rss_first": first,
        "rss_baseline": baseline,
        "rss_peak": peak,
        "rss_after": after,
        "rss_growth": growth,
        "gateway_cpu_s": gateway_cpu,
        "correctness": check,
    }

    log(f"\n== P9 results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    log(
        f"sustainable rate {rate:,.0f} req/s (windows {spread}); offered {offered:,.0f} req/s, "
        f"arrivals achieved {out['arrival_rate']:,.0f} req/s ({due:,} due in "
        f"{result['wall']:.1f} s)"
    )
    log(
        f"sent {result['sent']:,}, shed by the client bound {result['shed']:,} (never sent), "
        f"max in flight {result['max_in_flight']:,}"
    )
    log(f"answers by status: {statuses}; client-side failures: {result['errors'] or 'none'}")
    for status, pct in result["latency_ms"].items():
        log(f"  time to answer {status} (from when it was due): {_ms(pct)}")
    share = with_ra / excess if excess > 0 else float("nan")
    log(
        f"excess requests (due, not answered 2xx): {excess:,}; answered 503 with Retry-After: "
        f"{with_ra:,} = {share:.1%} (503 without Retry-After: {n503 - with_ra:,})"
    )
    if n503:
        slowest = result["unavailable_over_limit_max_ms"]
        log(
            f"503s later than admission_timeout ({limit:g} s): {over:,} of {n503:,}"
            + (f", the slowest {slowest:,.0f} ms" if slowest else "")
        )
    met_503 = excess > 0 and with_ra == excess and over == 0
    log(
        f"-> every excess request answered 503 + Retry-After within {limit:g} s: "
        f"{'yes' if met_503 else 'NO'}"
    )
    log(
        f"-> RSS: {first / MiB:.1f} MiB at start, {baseline / MiB:.1f} before the overload, peak "
        f"{peak / MiB:.1f}, {after / MiB:.1f} after {args.cooldown:g} s of calm: growth "
        f"{growth / MiB:+.1f} MiB (goal ≤ 64): {'yes' if growth <= GOAL_RSS else 'NO'}"
    )
    log(
        f"gateway CPU {gateway_cpu:.1f} s over {result['wall']:.1f} s of arrivals + drain; "
        f"load generator CPU {result['cpu_s']:.1f} s"
    )
    log(f"-> correctness: {check}")

    png = Path(args.out) / "overload_rss.png"
    plot(
        png,
        f"P9: gateway at {args.factor:g}x its sustainable rate ({rate:,.0f} req/s) for "
        f"{args.duration:g} s",
        rss.samples,
        rss.samples[0][0],
        [(load.started - rss.samples[0][0], load.ended - rss.samples[0][0], "overload")],
        series_by_kind(result),
        float(result["t0"]),
    )
    log(f"RSS curve: {png}")
    out["png"] = str(png)
    write_json(Path(args.out) / "overload.json", {**out, "rss": rss.samples})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overload_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="15 s of overload, one round")
    parser.add_argument("--duration", type=float, help="seconds of overload (60; quick 15)")
    parser.add_argument("--factor", type=float, default=10.0, help="x the sustainable rate")
    parser.add_argument("--rounds", type=int, help="sustainable-rate windows (3; quick 1)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per rate window")
    parser.add_argument("--connections", type=int, default=128, help="clients, rate windows")
    parser.add_argument("--max-connections", type=int, default=4000, help="open-loop bound")
    parser.add_argument("--timeout", type=float, default=30.0, help="client deadline")
    parser.add_argument("--cooldown", type=float, default=10.0, help="seconds of calm after")
    parser.add_argument(
        "--admission-timeout", type=float, help="set SBGATE_ADMISSION_TIMEOUT (default: 2)"
    )
    parser.add_argument("--out", default=str(OUT_DIR), help="where the PNG and JSON go")
    args = parser.parse_args(argv)
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return run_bench("P9 overload", lambda cores, log: bench(args, cores, log))


if __name__ == "__main__":
    raise SystemExit(main())
