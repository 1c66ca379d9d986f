"""The gateway's memory through a long total outage, and how soon it takes messages again.

    .venv/bin/python -m bench.outage_bench                 # a 10-minute outage, ~13 minutes
    .venv/bin/python -m bench.outage_bench --minutes 1 --ping-interval 10   # a short one

The gateway runs on the real SDK against the local broker (`sblocal`), failover on, with a
real ``redis-server`` on a free port as its state store (Redis stays up throughout; the
syphon is off, so the broker's counters compare directly with the answers). `bench.openloop`
offers a steady open-loop load (``--rate`` requests per second, bounded at
``--max-connections`` in flight, each with a ``--timeout`` deadline) for the whole run:

1. ``--warmup`` seconds with both namespaces up;
2. ``--minutes`` of **total outage**: both namespaces down (sblocal closes their AMQP
   listeners and connections);
3. both up again, and the load goes on for ``--after`` seconds (default one
   ``ping_primary_interval`` + 30 s).

Printed: the gateway's RSS (``VmRSS`` every 0.5 s) at the outage's start, its peak and at the
end — goal: it grows by at most 64 MB; what the requests got before, during and after the
outage (answers by status and route, client-side failures); **recovery**: the time from the
namespaces' return to the first ``201`` and to the last non-``2xx`` answer, against one
``ping_primary_interval`` — goal: 201s again within one ping interval; and whether the broker
stored exactly the messages answered 2xx. The RSS curve goes to a PNG (path printed;
``bench/out/`` by default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Cores, cpu_seconds, gateway_on_broker, parse_args, start_redis
from bench.memwatch import (
    OUT_DIR,
    MiB,
    RssSampler,
    compare_dumps,
    open_loop,
    plot,
    run_bench,
    series_by_kind,
    stored_vs_ok,
    write_json,
)

ENTITY_URL_PATH = "/queues/orders/messages"
GOAL_RSS = 64 * MiB
DEFAULT_PING_INTERVAL = 60.0  # the gateway's default ping_primary_interval
NAMESPACES = ("primary", "secondary")


def _counts(result: Mapping[str, Any], start: float, end: float) -> Counter[str]:
    """Answers (and client-side failures) by kind whose answer time lies in [start, end)."""
    t0, bucket = float(result["t0"]), float(result["bucket"])
    out: Counter[str] = Counter()
    for slot, counts in result["series"].items():
        at = t0 + int(slot) * bucket
        if start <= at < end:
            out.update(counts)
    return out


def _recovery(result: Mapping[str, Any], up: float) -> dict[str, float | None]:
    """Seconds from `up` to the first 2xx answer, to the first 201 from the primary, and to
    the end of the last step holding anything but 2xx answers (None: there was none)."""
    t0, bucket = float(result["t0"]), float(result["bucket"])
    out: dict[str, float | None] = {"first_2xx": None, "first_primary": None, "last_bad": None}
    for slot, counts in sorted(result["series"].items(), key=lambda kv: int(kv[0])):
        at = t0 + int(slot) * bucket
        if at + bucket <= up:
            continue
        if out["first_2xx"] is None and any(k.startswith("2") for k in counts):
            out["first_2xx"] = max(0.0, at - up)
        if out["first_primary"] is None and "201/primary" in counts:
            out["first_primary"] = max(0.0, at - up)
        if any(not k.startswith("2") for k in counts):
            out["last_bad"] = at + bucket - up
    return out


def _fmt(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "nothing"


async def _ride_out(
    down: float, outage: float, rss: RssSampler, log: Any, dump: int | None
) -> None:
    """Until the outage ends, log RSS every tenth of it (at least 10 s); with `dump` (the
    gateway's pid), have it dump its memory 20 s in, where RSS climbs (dump 2)."""
    step = max(10.0, outage / 10)
    mid = dump is not None
    while (left := down + outage - time.monotonic()) > 0:
        await asyncio.sleep(min(step, left, 20.0) if mid else min(step, left))
        if mid and dump is not None:
            mid = False
            os.kill(dump, signal.SIGUSR1)  # dump 2
        if left > step:
            now = rss.sample() or 0
            log(f"  {time.monotonic() - down:5.0f} s: RSS {now / MiB:.1f} MiB")


@dataclass
class _Run:
    """What one outage run measured, for the report."""

    ping: float
    after: float
    outage: float
    dumps: Path
    rss: RssSampler
    result: dict[str, Any]
    started: float  # when the load began
    down: float
    up: float
    end: float
    first: int  # RSS at start
    baseline: int  # RSS when the outage began
    last: int  # RSS at the end
    gateway_cpu: float
    check: str


async def bench(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    return _report(args, await _measure(args, cores, log), log)


async def _measure(args: argparse.Namespace, cores: Cores, log: Any) -> _Run:
    """Load the gateway, take both namespaces down for the outage, bring them back."""
    ping = args.ping_interval or DEFAULT_PING_INTERVAL
    after = args.after if args.after is not None else ping + 30.0
    outage = args.minutes * 60.0
    redis = await start_redis(cores.rest)
    try:
        extra = {"SBGATE_REDIS_URL": redis.url, "SBGATE_ENABLE_SYPHON": "false"}
        if args.ping_interval:
            extra["SBGATE_PING_PRIMARY_INTERVAL"] = str(args.ping_interval)
        dumps = Path(args.out) / "outage-memdump"
        if args.memdump or args.tracemalloc:
            dumps.parent.mkdir(parents=True, exist_ok=True)
            extra["BENCH_MEMDUMP"] = str(dumps)
            if args.tracemalloc:
                extra["BENCH_TRACEMALLOC"] = "1"
        async with gateway_on_broker(cores, extra) as e2e:
            rss = RssSampler(e2e.gateway.pid, interval=0.5).start()
            try:
                first = rss.sample() or 0
                log(
                    f"gateway up (pid {e2e.gateway.pid}, redis {redis.url}), RSS "
                    f"{first / MiB:.1f} MiB; {args.rate:g} req/s open loop; warm-up "
                    f"{args.warmup:g} s, outage {outage:g} s, then {after:g} s "
                    f"(ping_primary_interval {ping:g} s)"
                )
                total = args.warmup + outage + after
                cpu0 = cpu_seconds(e2e.gateway.pid)
                async with open_loop(
                    e2e.gateway.url + ENTITY_URL_PATH,
                    cores,
                    [
                        "--rate",
                        str(args.rate),
                        "--duration",
                        str(total),
                        "--max-connections",
                        str(args.max_connections),
                        "--timeout",
                        str(args.timeout),
                        "--bucket",
                        "0.1",
                    ],
                ) as load:
                    await asyncio.sleep(args.warmup)
                    baseline = rss.sample() or first
                    down = time.monotonic()
                    if "BENCH_MEMDUMP" in extra:
                        os.kill(e2e.gateway.pid, signal.SIGUSR1)  # dump 1
                    for ns in NAMESPACES:
                        await e2e.control.down(ns)
                    log(f"both namespaces down (RSS {baseline / MiB:.1f} MiB)")
                    dump = e2e.gateway.pid if "BENCH_MEMDUMP" in extra else None
                    await _ride_out(down, outage, rss, log, dump)
                    if "BENCH_MEMDUMP" in extra:
                        os.kill(e2e.gateway.pid, signal.SIGUSR1)  # dump 3
                        await asyncio.sleep(5.0)  # a dump takes a while
                    for ns in NAMESPACES:
                        await e2e.control.up(ns)
                    up = time.monotonic()
                    log(f"both namespaces up after {up - down:.0f} s")
                    result = await load.end(after + args.timeout + 60)
                end = time.monotonic()
                gateway_cpu = cpu_seconds(e2e.gateway.pid) - cpu0
                check = await stored_vs_ok(
                    e2e.control, int(result["total_ok"]), NAMESPACES, sum(result["errors"].values())
                )
                last = rss.sample() or 0
            finally:
                await rss.close()
    finally:
        await asyncio.to_thread(redis.close)
    return _Run(
        ping=ping,
        after=after,
        outage=outage,
        dumps=dumps,
        rss=rss,
        result=result,
        started=load.started,
        down=down,
        up=up,
        end=end,
        first=first,
        baseline=baseline,
        last=last,
        gateway_cpu=gateway_cpu,
        check=check,
    )


def _report(args: argparse.Namespace, run: _Run, log: Any) -> dict[str, Any]:
    """Print the outage's results, plot its RSS curve and write them as JSON."""
    ping, after, outage, dumps = run.ping, run.after, run.outage, run.dumps
    rss, result, down, up, end = run.rss, run.result, run.down, run.up, run.end
    first, baseline, last = run.first, run.baseline, run.last
    gateway_cpu, check = run.gateway_cpu, run.check
    peak = max(rss.between(down, end), default=baseline)
    growth = peak - baseline
    recovery = _recovery(result, up)
    first_ok, first_primary, last_bad = (
        recovery["first_2xx"],
        recovery["first_primary"],
        recovery["last_bad"],
    )
    before = _counts(result, run.started, down)
    during = _counts(result, down, up)
    after_counts = _counts(result, up, end)

    log(f"\n== outage results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    log(
        f"load: {result['due']:,} requests due at {args.rate:g}/s, {result['sent']:,} sent, "
        f"{result['shed']:,} shed by the client bound of {args.max_connections} in flight "
        f"(max in flight {result['max_in_flight']:,})"
    )
    log(f"before the outage: {_fmt(before)}")
    log(f"during the outage ({outage:g} s): {_fmt(during)}")
    log(f"after the return ({after:g} s): {_fmt(after_counts)}")
    codes = result.get("error_codes", {})
    log(f"non-2xx answers by error code: {_fmt(Counter(codes))}")
    for status, pct in result["latency_ms"].items():
        text = ", ".join(f"{k} {v:,.0f}" for k, v in pct.items())
        log(f"  time to answer {status} (from when it was due): {text} ms")

    def secs(value: float | None) -> str:
        return f"{value:.1f} s" if value is not None else "never"

    met = first_primary is not None and first_primary <= ping
    log(
        f"-> recovery after the namespaces returned: first 2xx {secs(first_ok)}, first 201 "
        f"from the primary {secs(first_primary)}, last non-2xx answer "
        f"{secs(last_bad) if last_bad is not None else 'none'}; 201s within one "
        f"ping_primary_interval ({ping:g} s): {'yes' if met else 'NO'}"
    )
    log(
        f"-> RSS: {first / MiB:.1f} MiB at start, {baseline / MiB:.1f} when the outage began, "
        f"peak {peak / MiB:.1f}, {last / MiB:.1f} at the end: growth {growth / MiB:+.1f} MiB "
        f"(goal ≤ 64): {'yes' if growth <= GOAL_RSS else 'NO'}"
    )
    log(f"gateway CPU {gateway_cpu:.1f} s over {end - run.started:.0f} s")
    log(f"-> correctness: {check}")
    if args.memdump or args.tracemalloc:
        log("what grew in the gateway from the outage's start to 20 s in:")
        for line in compare_dumps(dumps, 1, 2):
            log(f"  {line}")
        log("what grew in the gateway from the outage's start to its end:")
        for line in compare_dumps(dumps, 1, 3):
            log(f"  {line}")

    origin = rss.samples[0][0]
    png = Path(args.out) / "outage_rss.png"
    plot(
        png,
        f"Total outage of {args.minutes:g} min at {args.rate:g} req/s "
        f"(ping_primary_interval {ping:g} s)",
        rss.samples,
        origin,
        [(down - origin, up - origin, "both namespaces down")],
        series_by_kind({**result, "series": _coarse(result, 1.0), "bucket": 1.0}),
        float(result["t0"]),
    )
    log(f"RSS curve: {png}")
    out = {
        "rate": args.rate,
        "outage_s": outage,
        "ping_interval": ping,
        "first_2xx_s": first_ok,
        "first_201_primary_s": first_primary,
        "last_non_2xx_s": last_bad,
        "before": before,
        "during": during,
        "after": after_counts,
        "rss_first": first,
        "rss_baseline": baseline,
        "rss_peak": peak,
        "rss_last": last,
        "rss_growth": growth,
        "correctness": check,
        "load": result,
        "png": str(png),
    }
    write_json(Path(args.out) / "outage.json", {**out, "rss": rss.samples})
    return out


def _coarse(result: Mapping[str, Any], bucket: float) -> dict[str, dict[str, int]]:
    """The series re-bucketed to `bucket` seconds (for the plot)."""
    ratio = bucket / float(result["bucket"])
    out: dict[str, Counter[str]] = {}
    for slot, counts in result["series"].items():
        out.setdefault(str(int(int(slot) / ratio)), Counter()).update(counts)
    return {k: dict(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outage_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="outage length (10)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (200)")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the outage")
    parser.add_argument("--after", type=float, help="seconds after (ping interval + 30)")
    parser.add_argument(
        "--ping-interval", type=float, help="set SBGATE_PING_PRIMARY_INTERVAL (default: 60)"
    )
    parser.add_argument("--max-connections", type=int, default=4000, help="open-loop bound")
    parser.add_argument("--timeout", type=float, default=60.0, help="client deadline")
    parser.add_argument(
        "--memdump", action="store_true", help="count the gateway's objects by type"
    )
    parser.add_argument(
        "--tracemalloc", action="store_true", help="also trace its allocations (slow)"
    )
    parser.add_argument("--out", default=str(OUT_DIR), help="where the PNG and JSON go")
    # A one-minute outage with a 10 s ping interval (~2 minutes).
    args = parse_args(parser, argv, {"minutes": 1.0, "ping_interval": 10.0, "warmup": 10.0})
    return run_bench("outage", lambda cores, log: bench(args, cores, log))


if __name__ == "__main__":
    raise SystemExit(main())
