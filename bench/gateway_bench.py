"""Gateway benchmarks P1-P4 and P7: ratios measured in one run, printed; nothing asserted.

    .venv/bin/python -m bench.gateway_bench            # all of them, ~4 minutes
    .venv/bin/python -m bench.gateway_bench --quick    # short windows, one round, under a minute
    .venv/bin/python -m bench.gateway_bench p1 p7      # a selection

* **P1** — the gateway with the null sink vs a bare aiohttp handler (same server set-up, same
  load generator), with request logging at WARNING (goal ≥ 0.65) and at INFO, the default
  (goal ≥ 0.60).
* **P2** — the gateway end to end (HTTP → SDK → local broker, 1 KB messages, many concurrent
  clients) vs a naive client awaiting one SDK send per message on one sender. Goal ≥ 3x.
* **P3** — the same gateway run vs the SDK's batch ceiling without HTTP (batches of 100 on 4
  senders, one asyncio process). Goal ≥ 0.60.
* **P4** — seed 003's table, broker latency 70 ms round trip + 10 ms store: 100 sequential
  awaited SDK sends (expect ≥ 8 s) vs 100 concurrent requests through the gateway (< 1 s).
* **P7** — the gateway's hot path (null sink, failover on) with Redis configured vs with the
  in-memory store. Goal ≥ 0.95.

Every party runs in its own process and is pinned: the gateway — or the SDK client it is
compared with — on the first CPU, the load generator, the broker and redis on the second.
HTTP load comes from h2load (`bench.native`, `make bench-tools`), closed loop, a fraction
of the CPU per request of the Python generator (``--generator python`` still uses
`bench.loadgen`, as does P4's fixed burst).
Runs alternate between the compared parties within each round and the median of the
per-round ratios is reported, because a shared 2-core machine drifts between runs; P1 and P7
also load all their servers at once in one window per round (CPU cost per request measured
at the same moments, the steadiest of the three figures). Next to every rate: CPU
microseconds per message of each process, read from /proc around the window, and how busy
the subject kept its CPU (a CPU-bound subject under 85% flags a busy machine). Traffic goes
to 127.0.0.1 only; every run is bounded in time and count. docs/performance.md explains the
figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness import (
    Cores,
    GatewayOnBroker,
    Server,
    Window,
    cpu_seconds,
    gateway_on_broker,
    run_child,
    run_together,
    start_redis,
)
from bench.loadgen import make_body
from bench.native import H2Load, run_h2load

# -- settings -------------------------------------------------------------------------------

ENTITY_URL_PATH = "/queues/orders/messages"
BODY = make_body(1024)  # the body bench.loadgen sends, for h2load
BENCHMARKS = ("p1", "p2", "p3", "p4", "p7")

# Stand-in namespaces for the null sink: never contacted (the null sink replaces the SDK).
_NULL_NAMESPACES = {
    "SBGATE_PRIMARY_CONNECTION_STRING": (
        "Endpoint=sb://primary.invalid/;SharedAccessKeyName=bench;SharedAccessKey=bench"
    ),
    "SBGATE_PRIMARY_NAME": "primary",
    "SBGATE_SECONDARY_CONNECTION_STRING": (
        "Endpoint=sb://secondary.invalid/;SharedAccessKeyName=bench;SharedAccessKey=bench"
    ),
    "SBGATE_SECONDARY_NAME": "secondary",
}
_COMMON = {
    "SBGATE_ENTITIES": "queue:orders,topic:events",
    "SBGATE_REPLICA_ID": "bench",
    "SBGATE_LOG_LEVEL": "WARNING",
}


@dataclass(frozen=True)
class Params:
    duration: float  # seconds per measured window
    warmup: float  # seconds of load before each window
    rounds: int  # alternating rounds; the median of the per-round ratios is reported
    connections: int  # concurrent HTTP connections for the null-sink benchmarks
    e2e_connections: int  # ... and end to end through the broker
    burst: int  # P4: sequential sends and concurrent requests
    quick: bool
    generator: str = "h2load"  # HTTP load: h2load (native) or python (bench.loadgen)

    @property
    def child_timeout(self) -> float:
        return self.warmup + self.duration + 60.0


# -- results --------------------------------------------------------------------------------


@dataclass
class Rate:
    """One party's figures over its windows: medians of rate and CPU µs per message.

    `subject` names the process on the first CPU (the gateway, the bare server or the SDK
    client); its busy share of that CPU tells whether the run was CPU-bound or starved by
    other work on the machine."""

    label: str
    unit: str
    subject: str
    cpu_bound: bool = True  # should keep its CPU busy; if it does not, the machine is busy
    rates: list[float] = field(default_factory=list)
    cpu_us: dict[str, list[float]] = field(default_factory=dict)
    shares: list[float] = field(default_factory=list)
    together_us: list[float] = field(default_factory=list)  # CPU µs/msg, all loaded at once
    notes: list[str] = field(default_factory=list)

    def add(self, window: Window, messages: int) -> None:
        self.rates.append(messages / window.wall if window.wall > 0 else 0.0)
        for who, seconds in window.cpu.items():
            per = seconds / messages * 1e6 if messages else float("nan")
            self.cpu_us.setdefault(who, []).append(per)
        self.shares.append(window.cpu.get(self.subject, 0.0) / window.wall)

    @property
    def share(self) -> float:
        return statistics.median(self.shares) if self.shares else float("nan")

    @property
    def rate(self) -> float:
        return statistics.median(self.rates) if self.rates else float("nan")

    def cpu(self, who: str) -> float:
        values = self.cpu_us.get(who)
        return statistics.median(values) if values else float("nan")

    def describe(self) -> str:
        cpu = ", ".join(f"{who} {self.cpu(who):.0f}" for who in self.cpu_us)
        return (
            f"{self.label}: {self.rate:,.0f} {self.unit} (CPU µs/msg: {cpu}; "
            f"{self.subject} busy {self.share:.0%} of its CPU)"
        )


@dataclass
class Row:
    name: str
    title: str
    goal: str
    ratio: float | None = None
    ratio_text: str = ""
    cpu_ratio_text: str = ""
    together: float | None = None
    together_text: str = ""
    met: bool | None = None
    rates: list[Rate] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def starved(self) -> list[Rate]:
        """CPU-bound parties that got under 85% of their CPU: other work ran there."""
        return [r for r in self.rates if r.cpu_bound and r.share < 0.85]

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "goal": self.goal,
            "ratio": self.ratio,
            "ratio_text": self.ratio_text,
            "cpu_ratio_text": self.cpu_ratio_text,
            "together": self.together,
            "together_text": self.together_text,
            "met": self.met,
            "starved": [r.label for r in self.starved],
            "error": self.error,
            "detail": self.detail,
            "rates": [
                {
                    "label": r.label,
                    "unit": r.unit,
                    "rate": r.rate,
                    "rates": r.rates,
                    "cpu_us_per_msg": {w: r.cpu(w) for w in r.cpu_us},
                    "subject": r.subject,
                    "subject_busy": r.share,
                    "together_cpu_us_per_msg": r.together_us,
                    "notes": r.notes,
                }
                for r in self.rates
            ],
        }


def _ratios(num: Rate, den: Rate) -> list[float]:
    return [a / b for a, b in zip(num.rates, den.rates, strict=True) if b > 0]


def _median_ratio(num: Rate, den: Rate) -> tuple[float, str]:
    values = _ratios(num, den)
    if not values:
        return float("nan"), "n/a"
    med = statistics.median(values)
    spread = f" (rounds {min(values):.2f}..{max(values):.2f})" if len(values) > 1 else ""
    return med, f"{med:.2f}{spread}"


def _cpu_ratio(num: Rate, den: Rate) -> str:
    """The same comparison by CPU cost on the first CPU: den's µs/msg over num's, per round.

    When both sides are CPU-bound on one core this estimates the throughput ratio, and it is
    much less disturbed by other work on the machine than the rates are."""
    a, b = num.cpu_us.get(num.subject, []), den.cpu_us.get(den.subject, [])
    values = [y / x for x, y in zip(a, b, strict=True) if x > 0]
    if not values:
        return ""
    spread = f" (rounds {min(values):.2f}..{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"


def _together_ratio(num: Rate, den: Rate) -> tuple[float | None, str]:
    """den's CPU µs/msg over num's, both measured in the same simultaneous windows."""
    values = [
        y / x for x, y in zip(num.together_us, den.together_us, strict=True) if x > 0 and y > 0
    ]
    if not values:
        return None, ""
    med = statistics.median(values)
    spread = f" (rounds {min(values):.2f}..{max(values):.2f})" if len(values) > 1 else ""
    return med, f"{med:.2f}{spread}"


def _ok_count(window: Window) -> int:
    statuses: dict[str, int] = window.result["statuses"]
    return sum(v for k, v in statuses.items() if k.startswith("2"))


def _check_statuses(rate: Rate, window: Window) -> None:
    statuses: dict[str, int] = window.result["statuses"]
    errors: dict[str, int] = window.result["errors"]
    bad = {k: v for k, v in statuses.items() if not k.startswith("2")}
    if bad or errors:
        rate.notes.append(f"non-2xx answers {bad}, client errors {errors}")


# -- load -----------------------------------------------------------------------------------


async def http_load(
    server: Server,
    cores: Cores,
    p: Params,
    watch: Mapping[str, int | None],
    *,
    connections: int,
    count: int | None = None,
    who: str = "gateway",
) -> Window:
    """Closed-loop HTTP load on `server`: h2load (no warm-up: the servers are warm after the
    first round) unless `p.generator` is python or a fixed `count` is asked for."""
    if p.generator == "h2load" and count is None:
        load = H2Load(
            [server.url + ENTITY_URL_PATH], p.duration, connections=connections, body=BODY
        )
        return await run_h2load(load, cpus=cores.rest, watch={who: server.pid, **watch})
    args = [
        "--url",
        server.url + ENTITY_URL_PATH,
        "--connections",
        str(connections),
        "--duration",
        str(p.duration if count is None else 30.0),
        "--warmup",
        str(p.warmup),
    ]
    if count is not None:
        args += ["--count", str(count)]
    return await run_child(
        "loadgen",
        "bench.loadgen",
        args,
        watch={who: server.pid, **watch},
        cpus=cores.rest,
        within=p.child_timeout,
    )


Party = tuple[Rate, Callable[[], Awaitable[tuple[Window, int]]]]


async def together(
    servers: Sequence[tuple[Server, Rate]],
    cores: Cores,
    p: Params,
    log: Callable[[str], None],
    *,
    connections: int,
) -> None:
    """Load every server at once (all pinned to the first CPU, so they share it), each with
    its own load generator, in one window: CPU µs per request of each, measured at the same
    moments. Frequency changes, steal time and neighbours then hit every server alike."""
    if p.generator == "h2load":
        await _together_native(servers, cores, p, log, connections=connections)
        return
    children = [
        (
            f"loadgen-{server.label}",
            "bench.loadgen",
            [
                "--url",
                server.url + ENTITY_URL_PATH,
                "--connections",
                str(connections),
                "--duration",
                str(p.duration),
                "--warmup",
                str(p.warmup),
                "--sync",
            ],
        )
        for server, _ in servers
    ]
    results, cpu, wall = await run_together(
        children,
        watch={server.label: server.pid for server, _ in servers},
        cpus=cores.rest,
        within=p.child_timeout,
    )
    parts = []
    for server, rate in servers:
        result = results[f"loadgen-{server.label}"]
        statuses: dict[str, int] = result["statuses"]
        ok = sum(v for k, v in statuses.items() if k.startswith("2"))
        per = cpu[server.label] / ok * 1e6 if ok else float("nan")
        rate.together_us.append(per)
        parts.append(f"{server.label} {per:.0f}")
    log(f"  simultaneous ({wall:.1f} s)  CPU µs/req: " + ", ".join(parts))


async def _together_native(
    servers: Sequence[tuple[Server, Rate]],
    cores: Cores,
    p: Params,
    log: Callable[[str], None],
    *,
    connections: int,
) -> None:
    """`together` with one h2load per server, started at once."""
    cpu0 = {s.label: cpu_seconds(s.pid) for s, _ in servers}
    started = time.monotonic()
    loads = [
        H2Load([s.url + ENTITY_URL_PATH], p.duration, connections=connections, body=BODY)
        for s, _ in servers
    ]
    windows = await asyncio.gather(*(run_h2load(load, cpus=cores.rest, watch={}) for load in loads))
    wall = time.monotonic() - started
    parts = []
    for (server, rate), window in zip(servers, windows, strict=True):
        ok = _ok_count(window)
        per = (cpu_seconds(server.pid) - cpu0[server.label]) / ok * 1e6 if ok else float("nan")
        rate.together_us.append(per)
        parts.append(f"{server.label} {per:.0f}")
    log(f"  simultaneous ({wall:.1f} s, h2load)  CPU µs/req: " + ", ".join(parts))


async def alternate(
    parties: Sequence[Party],
    rounds: int,
    log: Callable[[str], None],
    each_round: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run every party once per round, rotating the order so no party always goes first;
    then `each_round` (the simultaneous window), if given."""
    for r in range(rounds):
        shift = r % len(parties)
        for rate, run in [*parties[shift:], *parties[:shift]]:
            window, messages = await run()
            rate.add(window, messages)
            log(
                f"  round {r + 1}/{rounds} {rate.label:32s} {messages / window.wall:9,.0f} "
                f"{rate.unit}  cpu s: " + ", ".join(f"{k} {v:.2f}" for k, v in window.cpu.items())
            )
        if each_round is not None:
            await each_round()


def _null_env(**extra: str) -> dict[str, str]:
    return {**_NULL_NAMESPACES, **_COMMON, **extra}


# -- P1 -------------------------------------------------------------------------------------


async def bench_p1(p: Params, cores: Cores, log: Callable[[str], None]) -> list[Row]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(label: str, mode: str, env: dict[str, str]) -> Server:
            server = await Server.start(label, mode, env, cpus=cores.subject)
            stack.push_async_callback(server.close)
            return server

        bare = await start("bare", "bare", {})
        warn = await start("gw-warning", "gateway", _null_env(SBGATE_LOG_LEVEL="WARNING"))
        info = await start("gw-info", "gateway", _null_env(SBGATE_LOG_LEVEL="INFO"))
        rates = {
            s.label: Rate(label, "req/s", subject)
            for s, label, subject in (
                (bare, "bare aiohttp handler", "server"),
                (warn, "gateway, null sink, log WARNING", "gateway"),
                (info, "gateway, null sink, log INFO", "gateway"),
            )
        }

        def party(server: Server) -> Party:
            rate = rates[server.label]

            async def run() -> tuple[Window, int]:
                who = "server" if server is bare else "gateway"
                window = await http_load(server, cores, p, {}, connections=p.connections, who=who)
                _check_statuses(rate, window)
                return window, _ok_count(window)

            return rate, run

        async def at_once() -> None:
            trio = [(s, rates[s.label]) for s in (bare, warn, info)]
            await together(trio, cores, p, log, connections=p.connections)

        await alternate([party(bare), party(warn), party(info)], p.rounds, log, at_once)

    base = rates["bare"]
    rows = []
    for key, level, goal in (("gw-warning", "WARNING", 0.65), ("gw-info", "INFO", 0.60)):
        ratio, text = _median_ratio(rates[key], base)
        sim, sim_text = _together_ratio(rates[key], base)
        rows.append(
            Row(
                name=f"P1 ({level})",
                title=f"gateway (null sink, log {level}) / bare aiohttp handler",
                goal=f"≥ {goal:.2f}",
                ratio=ratio,
                ratio_text=text,
                cpu_ratio_text=_cpu_ratio(rates[key], base),
                together=sim,
                together_text=sim_text,
                met=ratio >= goal,
                rates=[rates[key], base],
            )
        )
    info_rate, warn_rate = rates["gw-info"], rates["gw-warning"]
    info_cost = info_rate.cpu("gateway") - warn_rate.cpu("gateway")
    if info_rate.together_us and warn_rate.together_us:
        info_cost = statistics.median(info_rate.together_us) - statistics.median(
            warn_rate.together_us
        )
    rows[1].detail.append(f"request logging at INFO costs {info_cost:.0f} µs of CPU per request")
    return rows


# -- P2 and P3 ------------------------------------------------------------------------------


async def bench_p2_p3(
    p: Params, cores: Cores, e2e: GatewayOnBroker, log: Callable[[str], None], which: set[str]
) -> list[Row]:
    broker_pid = e2e.broker.pid
    gw = Rate(f"gateway end to end, {p.e2e_connections} clients", "msg/s", "gateway")
    naive = Rate("SDK naive: 1 sender, awaited sends", "msg/s", "client", cpu_bound=False)
    batch = Rate("SDK ceiling: 4 senders x batches of 100", "msg/s", "client")
    stored: list[str] = []

    async def run_gateway() -> tuple[Window, int]:
        await e2e.control.reset()
        window = await http_load(
            e2e.gateway, cores, p, {"broker": broker_pid}, connections=p.e2e_connections
        )
        _check_statuses(gw, window)
        counters = await e2e.control.counters("primary")
        stored.append(f"{counters['messages_received']}/{window.result['total_ok']}")
        return window, _ok_count(window)

    def sdk(rate: Rate, args: list[str]) -> Callable[[], Awaitable[tuple[Window, int]]]:
        async def run() -> tuple[Window, int]:
            await e2e.control.reset()
            window = await run_child(
                "client",
                "bench.sdk_clients",
                [*args, "--conn", e2e.conn, "--queue", "orders", "--duration", str(p.duration)],
                watch={"broker": broker_pid},
                cpus=cores.subject,
                within=p.child_timeout,
            )
            return window, int(window.result["messages"])

        return run

    parties: list[Party] = [(gw, run_gateway)]
    if "p2" in which:
        parties.append((naive, sdk(naive, ["naive"])))
    if "p3" in which:
        parties.append((batch, sdk(batch, ["batch", "--senders", "4", "--batch", "100"])))
    await alternate(parties, p.rounds, log)
    gw.notes.append(f"broker stored / gateway 2xx (incl. warm-up) per run: {', '.join(stored)}")

    rows = []
    if "p2" in which:
        ratio, text = _median_ratio(gw, naive)
        rows.append(
            Row(
                name="P2",
                title="gateway end to end / naive SDK client (1 sender, awaited sends)",
                goal="≥ 3",
                ratio=ratio,
                ratio_text=text,
                met=ratio >= 3.0,
                rates=[gw, naive],
            )
        )
    if "p3" in which:
        ratio, text = _median_ratio(gw, batch)
        rows.append(
            Row(
                name="P3",
                title="gateway end to end / SDK batch ceiling (4 senders x 100), no HTTP",
                goal="≥ 0.60",
                ratio=ratio,
                ratio_text=text,
                cpu_ratio_text=_cpu_ratio(gw, batch),
                met=ratio >= 0.60,
                rates=[gw, batch],
            )
        )
    return rows


# -- P4 -------------------------------------------------------------------------------------


async def bench_p4(
    p: Params, cores: Cores, e2e: GatewayOnBroker, log: Callable[[str], None]
) -> Row:
    n = p.burst
    await e2e.control.reset()
    await e2e.control.set_latency("primary", round_trip_ms=70, store_ms=10)
    try:
        seq = await run_child(
            "client",
            "bench.sdk_clients",
            ["naive", "--conn", e2e.conn, "--queue", "orders", "--count", str(n)],
            watch={"broker": e2e.broker.pid},
            cpus=cores.subject,
            within=n * 0.2 + 60,
        )
        log(f"  {n} sequential awaited SDK sends: {seq.result['elapsed']:.2f} s")
        burst = await http_load(
            e2e.gateway, cores, p, {"broker": e2e.broker.pid}, connections=n, count=n
        )
        log(
            f"  {n} concurrent requests through the gateway: {burst.result['elapsed']:.3f} s "
            f"(p50 {burst.result['p50_ms']:.0f} ms, max {burst.result['max_ms']:.0f} ms)"
        )
    finally:
        await e2e.control.reset()
    seq_s = float(seq.result["elapsed"])
    gw_s = float(burst.result["elapsed"])
    gw_rate = Rate(f"gateway: {n} concurrent requests", "msg/s", "gateway", cpu_bound=False)
    gw_rate.add(burst, n)
    _check_statuses(gw_rate, burst)
    seq_rate = Rate(f"SDK: {n} sequential awaited sends", "msg/s", "client", cpu_bound=False)
    seq_rate.add(seq, n)
    ok = _ok_count(burst)
    met = gw_s < 1.0 and ok == n
    return Row(
        name="P4",
        title="70 ms + 10 ms broker latency: 100 sequential SDK sends vs 100 concurrent "
        "gateway requests",
        goal="gateway < 1 s (sequential ≥ 8 s)",
        ratio=seq_s / gw_s,
        ratio_text=f"{seq_s:.2f} s vs {gw_s:.3f} s ({seq_s / gw_s:.0f}x)",
        met=met,
        rates=[gw_rate, seq_rate],
        detail=[f"{ok}/{n} answered 201; gateway p50 {burst.result['p50_ms']:.0f} ms"],
    )


# -- P7 -------------------------------------------------------------------------------------


async def bench_p7(p: Params, cores: Cores, log: Callable[[str], None]) -> Row:
    async with contextlib.AsyncExitStack() as stack:
        redis = await start_redis(cores.rest)
        stack.push_async_callback(asyncio.to_thread, redis.close)

        async def start(label: str, env: dict[str, str]) -> Server:
            server = await Server.start(label, "gateway", env, cpus=cores.subject)
            stack.push_async_callback(server.close)
            return server

        with_redis = await start("redis", _null_env(SBGATE_REDIS_URL=redis.url))
        memory = await start("memory", _null_env())
        no_failover = await start("off", _null_env(SBGATE_ENABLE_FAILOVER="false"))
        rates = {
            "redis": Rate("gateway, failover on, Redis store", "req/s", "gateway"),
            "memory": Rate("gateway, failover on, memory store", "req/s", "gateway"),
            "off": Rate("gateway, failover off", "req/s", "gateway"),
        }

        def party(server: Server) -> Party:
            rate = rates[server.label]

            async def run() -> tuple[Window, int]:
                window = await http_load(
                    server, cores, p, {"redis": redis.pid}, connections=p.connections
                )
                _check_statuses(rate, window)
                return window, _ok_count(window)

            return rate, run

        async def at_once() -> None:
            trio = [(s, rates[s.label]) for s in (with_redis, memory, no_failover)]
            await together(trio, cores, p, log, connections=p.connections)

        await alternate(
            [party(with_redis), party(memory), party(no_failover)], p.rounds, log, at_once
        )

    ratio, text = _median_ratio(rates["redis"], rates["memory"])
    sim, sim_text = _together_ratio(rates["redis"], rates["memory"])
    _, off_sim = _together_ratio(rates["memory"], rates["off"])
    _, off_text = _median_ratio(rates["memory"], rates["off"])
    return Row(
        name="P7",
        title="gateway hot path (null sink) with Redis configured / without (memory store)",
        goal="≥ 0.95",
        ratio=ratio,
        ratio_text=text,
        cpu_ratio_text=_cpu_ratio(rates["redis"], rates["memory"]),
        together=sim,
        together_text=sim_text,
        met=ratio >= 0.95,
        rates=[rates["redis"], rates["memory"], rates["off"]],
        detail=[
            f"failover on (memory store) / failover off: {off_text} alternating, "
            f"{off_sim or 'n/a'} simultaneous (CPU cost)"
        ],
    )


# -- driver ---------------------------------------------------------------------------------


def _fmt_met(row: Row) -> str:
    if row.error:
        return "error"
    return "yes" if row.met else "NO"


def render_table(rows: Sequence[Row]) -> str:
    """The results as a Markdown table (also what docs/performance.md shows)."""
    out = [
        "| benchmark | throughput ratio | CPU-cost ratio | CPU-cost ratio, simultaneous | goal "
        "| met? | rates, alternating (CPU µs per message, by process) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.error:
            rates = f"error: {row.error.splitlines()[-1][:120]}"
        else:
            rates = "<br>".join(r.describe() for r in row.rates)
        met = _fmt_met(row) + (" (busy machine)" if row.starved else "")
        out.append(
            f"| {row.name} | {row.ratio_text or 'n/a'} | {row.cpu_ratio_text or '-'} "
            f"| {row.together_text or '-'} | {row.goal} | {met} | {rates} |"
        )
    return "\n".join(out)


def _log(line: str) -> None:
    print(line, flush=True)


def _report(row: Row) -> None:
    """Print one result row: its ratio, its rates and their notes, and starvation warnings."""
    cpu_text = f"  (CPU-cost ratio {row.cpu_ratio_text})" if row.cpu_ratio_text else ""
    if row.together_text:
        cpu_text += f"  (simultaneous CPU-cost ratio {row.together_text})"
    _log(
        f"-> {row.name}: {row.ratio_text or 'n/a'}{cpu_text}  goal {row.goal}  met: {_fmt_met(row)}"
    )
    for r in row.rates:
        _log(f"   {r.describe()}")
        for note in r.notes:
            _log(f"     note: {note}")
    for d in row.detail:
        _log(f"   {d}")
    for r in row.starved:
        _log(
            f"   WARNING: {r.label}: the {r.subject} kept its CPU only {r.share:.0%} busy "
            "while CPU-bound: other work is running on this machine, and rates (more "
            "than the CPU-cost ratio) are unreliable. Rerun when it is quiet."
        )


async def _guarded(
    names: Sequence[str], title: str, job: Callable[[], Awaitable[list[Row]]]
) -> list[Row]:
    """Run one benchmark group and report its rows; a failure becomes rows that say so."""
    _log(f"\n== {title}")
    started = time.monotonic()
    try:
        got = await job()
    except Exception as exc:  # report the failure in the table and go on with the rest
        traceback.print_exc()
        got = [Row(name=n.upper(), title=title, goal="", error=repr(exc)) for n in names]
    for row in got:
        _report(row)
    _log(f"   ({time.monotonic() - started:.0f} s)")
    return got


async def main_async(p: Params, which: set[str], cores: Cores) -> list[Row]:
    rows: list[Row] = []
    log = _log

    async def guarded(
        names: Sequence[str], title: str, job: Callable[[], Awaitable[list[Row]]]
    ) -> None:
        rows.extend(await _guarded(names, title, job))

    if "p1" in which:

        async def p1() -> list[Row]:
            return await bench_p1(p, cores, log)

        await guarded(["p1"], "P1: gateway (null sink) vs bare aiohttp", p1)
    e2e_which = which & {"p2", "p3", "p4"}
    if e2e_which:

        async def e2e_jobs() -> list[Row]:
            out: list[Row] = []
            async with gateway_on_broker(cores, {}) as e2e:
                if e2e_which & {"p2", "p3"}:
                    log("-- P2/P3: gateway end to end vs the SDK alone (local broker)")
                    out += await bench_p2_p3(p, cores, e2e, log, e2e_which)
                if "p4" in e2e_which:
                    log("-- P4: seed 003's latency table")
                    out.append(await bench_p4(p, cores, e2e, log))
            return out

        await guarded(sorted(e2e_which), "P2-P4: end to end through the local broker", e2e_jobs)
    if "p7" in which:

        async def p7() -> list[Row]:
            return [await bench_p7(p, cores, log)]

        await guarded(["p7"], "P7: Redis configured vs not (null sink)", p7)
    return rows


def parse_args(argv: list[str] | None) -> tuple[Params, set[str], argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("which", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default all)")
    parser.add_argument("--quick", action="store_true", help="short windows, one round")
    parser.add_argument("--duration", type=float, help="seconds per window (3; quick 1.5)")
    parser.add_argument("--warmup", type=float, help="seconds of load first (0.5; quick 0.3)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (5; quick 1)")
    parser.add_argument("--connections", type=int, default=64, help="clients, null sink")
    parser.add_argument("--e2e-connections", type=int, default=128, help="clients, end to end")
    parser.add_argument(
        "--generator",
        choices=("h2load", "python"),
        default="h2load",
        help="HTTP load from h2load (make bench-tools) or bench.loadgen (h2load)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    which = {w.lower() for w in args.which} or set(BENCHMARKS)
    unknown = which - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHMARKS}")
    p = Params(
        duration=args.duration or (1.5 if args.quick else 3.0),
        warmup=args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5),
        rounds=args.rounds or (1 if args.quick else 5),
        connections=args.connections,
        e2e_connections=args.e2e_connections,
        burst=100,
        quick=args.quick,
        generator=args.generator,
    )
    return p, which, args


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p, which, args = parse_args(argv)
    cores = Cores.split()
    if cores.rest:
        os.sched_setaffinity(0, cores.rest)  # the orchestrator stays off the gateway's CPU
    print(
        f"gateway benchmarks {sorted(which)}: {p.rounds} round(s) x {p.duration:g} s windows "
        f"(+{p.warmup:g} s warm-up); {cores.describe}; python {sys.version.split()[0]}",
        flush=True,
    )
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C: every child server, broker and redis is stopped on the way.
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = _loadavg()
    try:
        rows = asyncio.run(main_async(p, which, cores))
    except KeyboardInterrupt:
        print("\ninterrupted: every child process was stopped", file=sys.stderr)
        return 130
    print(
        f"\n== summary ({time.monotonic() - started:.0f} s; load average {load_before} before, "
        f"{_loadavg()} after, on {os.cpu_count()} CPUs)\n"
    )
    print(render_table(rows))
    if args.json:
        with open(args.json, "wb") as fh:
            fh.write(
                orjson.dumps(
                    {"params": dataclasses.asdict(p), "rows": [r.as_json() for r in rows]},
                    option=orjson.OPT_INDENT_2,
                )
            )
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
