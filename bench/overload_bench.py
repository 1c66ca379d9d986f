"""P9: the gateway at 2x, 5x and 10x its sustainable request rate, as clients meet it.

    make bench-tools                                    # h2load, wrk (apt), sbload, once
    .venv/bin/python -m bench.overload_bench            # ~5 minutes: both ladders
    .venv/bin/python -m bench.overload_bench --quick    # 6 s per load, one rate window
    .venv/bin/python -m bench.overload_bench --sink null   # the gateway alone, no broker
    .venv/bin/python -m bench.overload_bench --ladders steady   # without the slow broker
    .venv/bin/python -m bench.overload_bench --adaptive off     # the fixed caps only
    .venv/bin/python -m bench.overload_bench --generator h2load # h2load's open loop

The gateway runs pinned to the first CPU, with the real SDK against the local broker
(`sblocal`) on the second (``--sink null``: a sink that stores nothing, to isolate the gateway
from the broker), with adaptive admission on (``--adaptive``; docs/admission.md). The load
comes from native generators pinned to the second CPU (`bench.native`), C event loops that
cost a fraction of the CPU per request a Python generator spent: the closed-loop windows from
`h2load` (Debian's nghttp2-client), the open-loop phases from `sbload` (``--generator``;
`bench/sbload.c`, which ``make bench-tools`` builds), whose clients behave as a fleet of real
ones under overload: each holds one request at a time and never pipelines, reconnects on its
own after a refused connect, a reset or a close (a jittered backoff, 50 ms doubling to
1 s), and sends what it owes one request after another once back, until its schedule ends.
``--generator h2load`` runs those phases with h2load, whose client refused at connect is
gone for the phase and which pipelines every request it owes after a server's close (both
measured: `bench.h2load_reconnect`, docs/performance-results.md). Traffic goes to
127.0.0.1 only; every phase is bounded in time (the generator is killed past its duration +
30 s) and prints what it measured.

0. **What a refusal costs**: a second gateway (null sink) with one request held in progress
   and ``max_requests_in_progress`` 1, so that every other request is refused at its head;
   h2load closed loop: the gateway's CPU per 503, against its CPU per 201 in the same kind of
   window with nothing held (and the SDK gateway's per 201 from step 1).
1. **Sustainable rate**: h2load closed loop (``--connections`` keep-alive clients) for a few
   windows; the median rate answered 2xx is what the gateway sustains here and now.
2. **Unloaded**: open loop at 0.5x that rate: the 2xx p99 the loaded runs are compared with,
   and the RSS baseline.
3. **The ladders**: open loop at each ``--factors`` multiple, each client pacing its share
   of the rate (``--rps``), as many clients as the rate needs at ``--client-rate`` each (a
   client holds one request at a time), the clients connecting evenly over ``--ramp``
   seconds and each then sending for the phase's duration. A client's timer starts when it
   connects, so the arrivals are a rate; h2load run for a duration connects every client at
   once and fires their timers in the same millisecond (a train of bursts, which earlier
   runs split among ``--spread`` processes out of phase), and the connects all at once met
   the listener's accept-queue pause, which refused clients h2load never brought back.
   Goodput is judged over the steady window, from the ramp's end to the duration, when
   every client sends. The gateway's listener pauses under overload (the kernel refuses
   connects at no cost to it; sbload's client tries again after its backoff, h2load's never
   does): each refused connect (``Tcp: AttemptFails``, machine-wide) counts as a refusal
   within 50 ms. So does each request sent on a connection the pause reset while it waited
   in the listener's queue: h2load counts those started and never done ("in flight at the
   end") and logs no line for them (sbload logs each one failed, within 50 ms when it was);
   the machine's ``Tcp: EstabResets`` (both ends of each, over loopback) bounds how many of
   the requests in flight at the end they are (measured 2026-11-30: 1,118 in flight at the
   end of a 10x phase, 2,234 resets). With ``--slice`` (h2load only), each process runs as
   successive h2load runs of that many seconds, so a refused client comes back at the next
   slice as a real client reconnects; off by default: measured (2026-11-29), each slice's
   reconnection of a process's clients at once held the listener closed by its accept-queue
   rule half of a quick phase, and goodput fell (docs/performance-results.md). ``steady``:
   the broker's round trip is ``--broker-base-ms`` throughout; ``broker-x10``: the same,
   raised tenfold half-way through each loaded phase (the adaptive limit must follow; it is
   read from /metrics just before and at the end).

Printed, in one table per ladder, per load: the rate offered and the rate the generator
managed to send (an arrival it could not send within the run is client-shed; over 10 % it is
flagged: with h2load the load was generator-bound, too few clients for the latency; with
sbload it is what refused clients owed and could not send before their schedule's end);
goodput as a share of the sustainable rate; the 2xx p50/p99; the excess (due, not answered
2xx) and how much of what was sent of it was refused fast (a ``503`` or a connection failure
within ``--fast``, 50 ms, of being sent); the RSS growth; the CPU of the gateway, the broker
and the generator, each as a share of one CPU. Each phase's log line also says where a
request's time in progress went when it was not the gateway's CPU: the broker sends of the
phase (how many, their mean time and batch, from /metrics before and after) and the event
loop's lag and requests in progress, sampled from /metrics every half second (median and
highest); and the clients the steady window held (the open connections) against the requests
in progress, which marks a phase **client-bound** (every held client busy: h2load never
brings back a client whose connect was refused, so goodput was at most those clients / the
latency) or **h2load pipelined** (more in progress than connections: see
`bench.h2load_reconnect`). ``BENCH_SAMPLES=<seconds>`` samples that often and keeps every
sample in the JSON beside the table. The goals (issue #38), judged at 2x, 5x and 10x in each
ladder, each marked met or not: goodput >= 90 %, >= 90 % of the excess refused within 50 ms,
2xx p99 <= 100 ms, RSS growth <= 64 MiB; and a last line with every goal's tally. And
whether the broker stored exactly the messages answered 2xx. Latency is from when a request
was sent (by the generator's clock), not from when it was due.

On a shared machine absolute figures mean little and ratios are noisy: the header and the
summary print the load average, and a figure is only as good as the quiet it was measured in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import IN_MEMORY_ENV, Cores, Server, Window, gateway_on_broker
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
GOALS = ("goodput", "fast", "p99", "rss")
LADDERS = ("steady", "broker-x10")
ADAPTIVE_ENV = "SBGATE_ADAPTIVE_ADMISSION"


def _ok(statuses: dict[str, int]) -> int:
    return sum(v for k, v in statuses.items() if k.startswith("2"))


class Stack:
    """What the ladder runs against: the gateway, and the broker unless the sink is null."""

    def __init__(self, gateway: Server, e2e: Any | None, base_ms: float) -> None:
        self.gateway = gateway
        self.e2e = e2e
        self.base_ms = base_ms

    @property
    def watch(self) -> dict[str, int | None]:
        return {
            "gateway": self.gateway.pid,
            "broker": self.e2e.broker.pid if self.e2e is not None else None,
        }

    async def reset(self) -> None:
        """The broker's messages and counters cleared, its round trip back to the base,
        after a second for the previous run's requests to settle: one the client abandoned
        at the end may still be stored, and must not count in the next run."""
        await asyncio.sleep(1.0)  # the bench's pacing, not a test's wait
        if self.e2e is not None:
            await self.e2e.control.reset()
            if self.base_ms:
                await self.e2e.control.set_latency("primary", round_trip_ms=self.base_ms)

    async def check(self, total_ok: int, abandoned: int) -> str:
        if self.e2e is None:
            return "null sink: nothing stored to compare"
        return await stored_vs_ok(self.e2e.control, total_ok, ("primary",), abandoned)


def _cpu(window: Window) -> str:
    wall = window.wall or 1.0
    parts = [f"{k} {v / wall:.0%}" for k, v in window.cpu.items() if v or k == "h2load"]
    return "CPU " + ", ".join(parts)


async def sustainable_rate(
    args: argparse.Namespace, cores: Cores, stack: Stack, log: Any
) -> tuple[float, list[float], float]:
    """Closed-loop windows; returns the median 2xx rate, every window's, and the gateway's
    CPU microseconds per 2xx (median)."""
    rates: list[float] = []
    costs: list[float] = []
    for i in range(args.rounds):
        await stack.reset()
        load = H2Load(
            [stack.gateway.url + ENTITY_URL_PATH],
            args.window,
            connections=args.connections,
            body=BODY,
            timeout=10.0,
        )
        try:
            window = await run_h2load(load, cpus=cores.rest, watch=stack.watch)
        except RuntimeError as exc:  # killed past its bound: the next window may do
            log(f"  window {i + 1}/{args.rounds}: {str(exc).splitlines()[0]}: no figures")
            continue
        r = window.result
        ok = _ok(r["statuses"])
        rate = ok / window.wall
        rates.append(rate)
        costs.append(window.cpu.get("gateway", 0.0) / ok * 1e6 if ok else math.nan)
        check = await stack.check(int(r["total_ok"]), int(r["unanswered_at_end"]))
        log(
            f"  window {i + 1}/{args.rounds}: {rate:,.0f} req/s 2xx ({_cpu(window)}; "
            f"{costs[-1]:.0f} us of gateway CPU a 2xx; 2xx p99 "
            f"{r['latency_ms'].get('201', {}).get('p99', float('nan')):.0f} ms, "
            f"statuses {r['statuses']}); {check}"
        )
    if not rates:
        raise RuntimeError("no sustainable-rate window gave figures")
    return statistics.median(rates), rates, statistics.median(costs)


async def refusal_cost(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    """Step 0 (module docstring): the gateway's CPU per 201 and per 503 refused at the head,
    on the null sink, closed loop, each on a gateway of its own."""
    out: dict[str, Any] = {}
    for held in (False, True):
        cap = {"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"} if held else {}
        env = {**IN_MEMORY_ENV, **dict(args.env), **cap}
        gateway = await Server.start("gateway", "gateway", env, cpus=cores.subject, sink="null")
        hold = None
        try:
            if held:
                # One request in progress, waiting for a body its client never finishes.
                hold = await asyncio.open_connection("127.0.0.1", int(gateway.info["port"]))
                hold[1].write(
                    f"POST {ENTITY_URL_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    "Content-Length: 100\r\n\r\nx".encode()
                )
                await hold[1].drain()
                await asyncio.sleep(0.5)  # the bench's pacing, not a test's wait
            load = H2Load(
                [gateway.url + ENTITY_URL_PATH],
                args.window,
                connections=args.connections,
                body=BODY,
            )
            window = await _h2load_retried(load, cores, gateway, log)
        finally:
            if hold is not None:
                hold[1].close()
            await gateway.close()
        kind = "503" if held else "201"
        if window is None:
            out[kind] = {"us": math.nan, "rate": math.nan, "statuses": {}}
            continue
        r = window.result
        n = int(r["statuses"].get(kind, 0))
        us = window.cpu["gateway"] / n * 1e6 if n else math.nan
        out[kind] = {"us": us, "rate": n / window.wall, "statuses": r["statuses"]}
        log(
            f"  {'every request refused at its head' if held else 'every request served'}: "
            f"{n / window.wall:,.0f} {kind}/s, {us:.1f} us of gateway CPU each "
            f"({_cpu(window)}; statuses {r['statuses']}, errors {r['errors']})"
        )
    return out


async def _h2load_retried(load: H2Load, cores: Cores, gateway: Server, log: Any) -> Window | None:
    """A closed-loop window of step 0, once more if h2load fails or outruns its bound (seen:
    h2load, at ~100,000 refusals a second, once in a few runs never ending its duration);
    None, said in the log, if it fails twice: the ladder goes on without the figure."""
    for attempt in (1, 2):
        try:
            return await run_h2load(load, cpus=cores.rest, watch={"gateway": gateway.pid})
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            log(f"  h2load failed ({first}){'; once more' if attempt == 1 else '; no figure'}")
    return None


_ADAPTIVE = re.compile(
    r'^sbgate_admission_limit(_baseline_seconds|_refused_total)?\{namespace="primary"\} (\S+)$',
    re.M,
)
_SHED = re.compile(r'^sbgate_http_shed_total\{reason="(\w+)"\} (\S+)$', re.M)
_PAUSED = re.compile(r'^sbgate_http_listener_paused_seconds_total\{reason="(\w+)"\} (\S+)$', re.M)
_HEAD_LIMIT = re.compile(r"^sbgate_http_requests_in_progress_limit (\S+)$", re.M)
# What a phase's broker sends were like: summed over their labels, differenced per phase.
_SENDS = re.compile(
    r"^sbgate_broker_(send_duration_seconds|batch_messages)_(sum|count)(?:\{[^}]*\})? (\S+)$",
    re.M,
)
_LOOP_LAG = re.compile(r"^sbgate_event_loop_lag_seconds (\S+)$", re.M)
_IN_PROGRESS = re.compile(r"^sbgate_http_requests_in_progress (\S+)$", re.M)
# What a time series of samples (``BENCH_SAMPLES``) adds: where requests wait, summed.
_GAUGES = {
    "open_connections": re.compile(r"^sbgate_http_open_connections(?:\{[^}]*\})? (\S+)$", re.M),
    "sends_in_flight": re.compile(r"^sbgate_broker_sends_in_flight(?:\{[^}]*\})? (\S+)$", re.M),
    "pending_bytes": re.compile(r"^sbgate_pending_bytes(?:\{[^}]*\})? (\S+)$", re.M),
    "admission_waiting": re.compile(
        r"^sbgate_admission_waiting_requests(?:\{[^}]*\})? (\S+)$", re.M
    ),
}


async def gateway_figures(url: str) -> dict[str, float]:
    """The primary namespace's adaptive limit, baseline and refusals, and the shed counts by
    reason, from the gateway's /metrics (the limit's figures absent when it is off)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    names = {"": "limit", "_baseline_seconds": "baseline_s", "_refused_total": "refused"}
    out = {names[m.group(1) or ""]: float(m.group(2)) for m in _ADAPTIVE.finditer(text)}
    out.update({f"shed_{m.group(1)}": float(m.group(2)) for m in _SHED.finditer(text)})
    out.update({f"shed_paused_s_{m.group(1)}": float(m.group(2)) for m in _PAUSED.finditer(text)})
    head = _HEAD_LIMIT.search(text)
    if head is not None:
        out["head_limit"] = float(head.group(1))
    for m in _SENDS.finditer(text):
        key = f"sends_{m.group(1)}_{m.group(2)}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    lag = _LOOP_LAG.search(text)
    if lag is not None:
        out["loop_lag_s"] = float(lag.group(1))
    in_progress = _IN_PROGRESS.search(text)
    if in_progress is not None:
        out["loop_in_progress"] = float(in_progress.group(1))
    for name, pattern in _GAUGES.items():
        out[f"loop_{name}"] = sum(float(m.group(1)) for m in pattern.finditer(text))
    return out


# ``BENCH_SAMPLES=<seconds>``: sample that often (default half a second) and keep every
# sample, stamped with the wall clock, in the phase's record (the JSON beside the table), to
# be laid beside the h2load logs (``BENCH_H2LOAD_LOGS``) when a phase is studied.
SAMPLE_EVERY = float(os.environ.get("BENCH_SAMPLES") or 0.5)
KEEP_SAMPLES = bool(os.environ.get("BENCH_SAMPLES"))


async def _sample_loop(url: str, started: float, into: list[dict[str, float]]) -> None:
    """The gateway's loop lag, requests in progress and open connections every half second
    of a phase (a scrape costs it about a millisecond), stamped with the seconds since the
    phase's start (``t``) and the wall clock (``at``), until cancelled."""
    while True:
        await asyncio.sleep(SAMPLE_EVERY)
        figures = await gateway_figures(url)
        if "loop_lag_s" in figures:
            into.append({"t": time.monotonic() - started, "at": time.time(), **figures})


def clients_held(
    samples: list[dict[str, float]], window: tuple[float, float] | None, generator: str = "h2load"
) -> str:
    """How many clients the phase's steady window held, and whether each was busy: the
    medians of the open connections and the requests in progress sampled in it. Every held
    client busy (in progress at 90 % or more of them) makes the load closed-loop: h2load's
    clients hold one request at a time and a client whose connect was refused is gone for
    the phase, so goodput is then at most the clients held / the latency, whatever the
    gateway could do (measured 2026-11-30: ~500 held after a 10x ramp). More in progress
    than connections means clients pipelining: h2load's ``--rps`` (1.52) sends every
    request a client owes in one write on the connection it opens after the server closed
    the last one (a 503 refused on the handler's path closes it), and those requests wait
    behind each other on that connection (measured: 10-17 deep, 0.1-0.8 s), which no
    client of one request at a time would do. sbload's clients reconnect, so with it every
    held client busy says only that the gateway took no more (its head's limit)."""
    inside = [s for s in samples if window is None or window[0] <= s.get("t", 0.0) < window[1]]
    if not inside:
        return ""
    held = statistics.median(s.get("loop_open_connections", 0.0) for s in inside)
    busy = statistics.median(s.get("loop_in_progress", 0.0) for s in inside)
    flags = []
    if held and busy >= 0.9 * held:
        flags.append(
            "every client busy: client-bound"
            if generator == "h2load"
            else "every client busy: as many as the gateway took"
        )
    if busy > held * PIPELINED_OVER:
        flags.append("more in progress than connections: h2load pipelined")
    return f"clients held {held:,.0f}, in progress {busy:,.0f}" + (
        f" ({'; '.join(flags)})" if flags else ""
    )


# In progress over this many times the open connections: some clients pipelined (above).
PIPELINED_OVER = 1.05


def loop_figures(samples: list[dict[str, float]]) -> str:
    """The median and the highest of a phase's loop-lag and in-progress samples."""
    if not samples:
        return "loop not sampled"
    lag = sorted(s["loop_lag_s"] * 1e3 for s in samples)
    held = sorted(s.get("loop_in_progress", 0.0) for s in samples)
    return (
        f"loop lag median {statistics.median(lag):.0f} / max {lag[-1]:.0f} ms, in progress "
        f"median {statistics.median(held):.0f} / max {held[-1]:.0f} ({len(samples)} samples)"
    )


def send_figures(before: dict[str, float], after: dict[str, float]) -> str:
    """The broker sends between two `gateway_figures`: how many, their mean time and batch
    (where a request's time in progress went when it was not the gateway's CPU)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    sends = delta("sends_send_duration_seconds_count")
    if sends <= 0:
        return "no broker sends"
    seconds = delta("sends_send_duration_seconds_sum")
    batch = delta("sends_batch_messages_sum") / max(1.0, delta("sends_batch_messages_count"))
    return (
        f"broker sends {sends:,.0f}, {seconds / sends * 1e3:.1f} ms and {batch:.1f} messages "
        f"each on average; loop lag at the end {after.get('loop_lag_s', 0.0) * 1e3:.0f} ms"
    )


async def _slow_broker(stack: Stack, after: float, ms: float, seen: dict[str, Any]) -> None:
    await asyncio.sleep(after)
    seen["before"] = await gateway_figures(stack.gateway.metrics_url)
    if stack.e2e is not None:
        await stack.e2e.control.set_latency("primary", round_trip_ms=ms)


def clients_for(args: argparse.Namespace, offered: float) -> int:
    """Clients an open-loop phase needs: each holds one request at a time, so it can send at
    most 1 / latency a second; at ``--client-rate`` each, a request may take 1 / that."""
    return int(min(args.max_connections, max(32, math.ceil(offered / args.client_rate))))


async def phase(
    args: argparse.Namespace,
    cores: Cores,
    stack: Stack,
    rss: RssSampler,
    rate: float,
    factor: float,
    ladder: str,
) -> dict[str, Any]:
    """One open-loop run at `factor` x `rate`: its answers, latencies, CPU and RSS peak."""
    await stack.reset()  # a second after the previous run: its connections closed too
    offered = rate * factor
    load = H2Load(
        [stack.gateway.url + ENTITY_URL_PATH],
        args.duration,
        connections=clients_for(args, offered),
        rate=offered,
        body=BODY,
        timeout=args.timeout,
        fast=args.fast,
        spread=args.spread,
        ramp=args.ramp,
        slice=args.slice,
        generator=args.generator,
    )
    shed_before = await gateway_figures(stack.gateway.metrics_url)
    seen: dict[str, Any] = {}
    slow = None
    if ladder == "broker-x10" and stack.e2e is not None:
        raised = stack.base_ms * 10
        # Half-way through the phase: the middle of the steady window when there is a ramp.
        middle = (load.ramp + args.duration) / 2
        slow = asyncio.create_task(_slow_broker(stack, middle, raised, seen))
    started = time.monotonic()
    samples: list[dict[str, float]] = []
    sampler = asyncio.create_task(_sample_loop(stack.gateway.metrics_url, started, samples))
    try:
        window = await run_h2load(load, cpus=cores.rest, watch=stack.watch)
    except RuntimeError as exc:  # killed past its bound: this phase has no figures
        return {
            "factor": factor,
            "offered": offered,
            "connections": load.connections,
            "failed": str(exc).splitlines()[0],
        }
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        if slow is not None:
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow
    ended = time.monotonic()
    after = await gateway_figures(stack.gateway.metrics_url)
    r = window.result
    abandoned = sum(int(v) for v in r["errors"].values()) + int(r["unanswered_at_end"])
    check = await stack.check(int(r["total_ok"]), abandoned)
    shed = {
        k[5:]: after.get(k, 0.0) - shed_before.get(k, 0.0) for k in after if k.startswith("shed_")
    }
    sends = send_figures(shed_before, after) + "; " + loop_figures(samples)
    held = clients_held(samples, load.steady, load.generator)
    return {
        "factor": factor,
        "offered": offered,
        "connections": load.connections,
        "result": {k: v for k, v in r.items() if k != "series"},
        "series": r["series"],
        "steady": load.steady,
        "length": load.duration if load.ramped else None,
        "peak": max(rss.between(started, ended + 1.0), default=0),
        "span": (started, ended),
        "correctness": check,
        "cpu": {k: v / window.wall for k, v in window.cpu.items()},
        "adaptive": {
            k: v for k, v in after.items() if not k.startswith(("shed_", "sends_", "loop_"))
        },
        "sends": sends,
        "held": held,
        "adaptive_before": {
            k: v
            for k, v in seen.get("before", {}).items()
            if not k.startswith(("shed_", "sends_", "loop_"))
        },
        "shed": shed,
        **({"samples": samples} if KEEP_SAMPLES else {}),
    }


def steady_ok_rate(p: dict[str, Any], r: dict[str, Any]) -> float:
    """The 2xx a second of a phase: over its steady window (every client sending) where it
    has one, by when each answer came (h2load's log, in `bucket`-second slots from the
    first request); else all its 2xx over its wall time."""
    steady, bucket = p.get("steady"), float(r.get("bucket") or 0.0)
    if steady and bucket:
        lo, hi = math.ceil(steady[0] / bucket), math.floor(steady[1] / bucket)
        if hi - lo >= 2:
            ok = sum(_ok(counts) for slot, counts in p["series"].items() if lo <= int(slot) < hi)
            return float(ok / ((hi - lo) * bucket))
    return _ok(r["statuses"]) / (float(r["wall"]) or 1.0)


def summarize(p: dict[str, Any], rate: float, baseline: int) -> dict[str, Any]:
    """The figures of one phase that the table prints, against the goals."""
    if "failed" in p:
        return {**p, "judged": p["factor"] in GOALS_AT, "met": dict.fromkeys(GOALS, False)}
    r = p["result"]
    ok = _ok(r["statuses"])
    wall = float(r["wall"]) or 1.0
    excess = max(0, int(r["due"]) - ok)
    shed = int(r["shed"])
    # A connect refused by a paused listener is a refusal at once (the kernel's reset), as
    # the issue counts one "refused at the connection cap": in the excess and refused fast.
    # The arrivals its client then owed until its next slice are client-shed.
    refused = int(r.get("refused_connects", 0))
    # A request sent on a connection reset in the listener's queue (the listener closed for
    # its accept queue with the connection in it) is refused by the kernel's reset as well:
    # h2load counts it started and never done ("in flight at the end"), without a log line.
    # Those requests in flight at the end that such resets account for count as refused
    # fast; the rest of them as not.
    reset = min(int(r.get("unanswered_at_end", 0)), int(r.get("reset_connections", 0)))
    fast = (
        int(r["unavailable_fast"])
        + sum(int(v) for v in r["failed_fast"].values())
        + refused
        + reset
    )
    # The share refused fast is of the excess the gateway was sent: what h2load never sent
    # (client-shed) the gateway could not refuse. A run whose client-shed is over a tenth of
    # the arrivals is generator-bound there (too few clients for the latency): judged on
    # what was sent, and flagged.
    sent_excess = max(0, excess - shed) + refused
    ok_lat = [v for k, v in r["latency_ms"].items() if k.startswith("2") and v]
    p50 = max((x["p50"] for x in ok_lat), default=float("nan"))
    p99 = max((x["p99"] for x in ok_lat), default=float("nan"))
    goodput = steady_ok_rate(p, r) / rate if rate else float("nan")
    fast_share = fast / sent_excess if sent_excess else 1.0
    growth = p["peak"] - baseline
    judged = p["factor"] in GOALS_AT
    met = {
        "goodput": goodput >= GOAL_GOODPUT,
        "fast": fast_share >= GOAL_FAST,
        "p99": p99 <= GOAL_P99_MS,
        "rss": growth <= GOAL_RSS,
    }
    return {
        "factor": p["factor"],
        "offered": p["offered"],
        "sent_rate": int(r["sent"]) / (p.get("length") or wall),
        "connections": p["connections"],
        "goodput_share": goodput,
        "p50_ms": p50,
        "p99_ms": p99,
        "excess": excess,
        "refused_fast": fast,
        "refused_connects": refused,
        "reset_in_queue": reset,
        "statuses": r["statuses"],
        "client_shed": shed,
        "shed_share": shed / int(r["due"]) if int(r["due"]) else 0.0,
        "generator": r.get("generator", "h2load"),
        "errors": r["errors"],
        "fast_share": fast_share,
        "rss_growth": growth,
        "judged": judged,
        "met": met if judged else None,
        "correctness": p["correctness"],
        "cpu": p["cpu"],
        "adaptive": p["adaptive"],
        "adaptive_before": p["adaptive_before"],
        "gateway_shed": p["shed"],
        "held": p.get("held", ""),
        **({"samples": p["samples"]} if "samples" in p else {}),
    }


def _shed_flag(row: dict[str, Any]) -> str:
    """Over a tenth of the arrivals client-shed: h2load's clients were too few for the
    latency (generator-bound); sbload's were refused clients backing off, which then owed
    more than they could send one at a time before their schedule's end (the gateway's
    refusal, not the generator's limit)."""
    if row["shed_share"] <= 0.1:
        return ""
    return " owed by refused clients" if row.get("generator") == "sbload" else " generator-bound"


def _yes(ok: bool | None) -> str:
    return "" if ok is None else (" met" if ok else " NOT met")


def _limit(row: dict[str, Any], key: str) -> str:
    before, after = row["adaptive_before"], row["adaptive"]
    if key not in after:
        return "-"
    text = f"{after[key]:,.0f}"
    if key in before:
        text = f"{before[key]:,.0f} -> {text}"
    return text


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| load | offered / sent req/s (clients) | goodput / sustainable | 2xx p50 / p99 ms "
        "| excess | of it sent, refused <= fast | client-shed (of arrivals) | RSS growth "
        "| CPU: gateway / broker / generator | limit: at the head / the namespace's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['factor']:g}x | {row['offered']:,.0f} | {row['failed']} |")
            continue
        met = row["met"] or {}
        cpu = row["cpu"]
        lines.append(
            f"| {row['factor']:g}x | {row['offered']:,.0f} / {row['sent_rate']:,.0f} "
            f"({row['connections']:,}) | {row['goodput_share']:.0%}"
            f"{_yes(met.get('goodput'))}"
            f"{' client-bound' if 'client-bound' in row.get('held', '') else ''} | "
            f"{row['p50_ms']:,.0f} / {row['p99_ms']:,.0f}{_yes(met.get('p99'))}"
            f"{' h2load pipelined' if 'pipelined' in row.get('held', '') else ''} | "
            f"{row['excess']:,} | {row['fast_share']:.0%}"
            f"{_yes(met.get('fast'))} ({row.get('refused_connects', 0):,} connects refused, "
            f"{row.get('reset_in_queue', 0):,} reset in the listener's queue) "
            f"| {row['client_shed']:,} ({row['shed_share']:.0%}){_shed_flag(row)} | "
            f"{row['rss_growth'] / MiB:+.1f} MiB{_yes(met.get('rss'))} | "
            f"{cpu.get('gateway', 0):.0%} / {cpu.get('broker', 0):.0%} / "
            f"{cpu.get('h2load', 0):.0%} | {_limit(row, 'head_limit')} / "
            f"{_limit(row, 'limit')} |"
        )
    return lines


def tally(ladders: dict[str, list[dict[str, Any]]]) -> str:
    """Every judged goal of every ladder, met or not, on one line."""
    parts = []
    met = total = 0
    for name, rows in ladders.items():
        for row in rows:
            if not row["met"]:
                continue
            missed = [g for g in GOALS if not row["met"][g]]
            met += len(GOALS) - len(missed)
            total += len(GOALS)
            parts.append(
                f"{name} {row['factor']:g}x: "
                + ("all met" if not missed else "NOT met: " + ", ".join(missed))
            )
    return f"goals met {met} of {total} ({'; '.join(parts)})"


async def _stack(args: argparse.Namespace, cores: Cores) -> Any:
    """The gateway on the broker, or (``--sink null``) alone: an async context manager."""
    extra = {**({ADAPTIVE_ENV: "true"} if args.adaptive == "on" else {}), **dict(args.env)}

    @contextlib.asynccontextmanager
    async def null() -> Any:
        env = {**IN_MEMORY_ENV, **extra}
        gateway = await Server.start("gateway", "gateway", env, cpus=cores.subject, sink="null")
        try:
            yield Stack(gateway, None, 0.0)
        finally:
            await gateway.close()

    @contextlib.asynccontextmanager
    async def sdk() -> Any:
        async with gateway_on_broker(cores, extra) as e2e:
            yield Stack(e2e.gateway, e2e, args.broker_base_ms)

    return null() if args.sink == "null" else sdk()


def report(
    args: argparse.Namespace,
    log: Any,
    run: dict[str, Any],
    cost: dict[str, Any],
    unloaded: dict[str, Any],
    baseline: int,
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    """The summary: the header, the refusal's cost, a table per ladder, the goals' tally."""
    rate, spread, ok_us, base_ms = run["rate"], run["spread"], run["ok_us"], run["base_ms"]
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"\n== P9 overload ladder ({now}, {loadavg()})")
    log(
        f"sink {args.sink}; generator {args.generator}; adaptive admission {args.adaptive}; "
        f"sustainable {rate:,.0f} req/s "
        f"(windows {spread}; {ok_us:.0f} us of gateway CPU a 2xx); unloaded (0.5x) 2xx p50 "
        f"{unloaded.get('p50_ms', math.nan):.0f} ms, p99 "
        f"{unloaded.get('p99_ms', math.nan):.0f} ms; RSS baseline "
        f"{baseline / MiB:.1f} MiB; broker round trip {base_ms:g} ms"
    )
    if cost and not math.isnan(cost["503"]["us"] + cost["201"]["us"]):
        ratio = cost["503"]["us"] / cost["201"]["us"]
        log(
            f"a refusal at the head costs {cost['503']['us']:.1f} us of gateway CPU, a 201 on "
            f"the null sink {cost['201']['us']:.1f} us ({ratio:.2f}x), a 201 on the broker "
            f"{ok_us:.0f} us ({cost['503']['us'] / ok_us:.2f}x)"
        )
    for name, ladder_rows in rows.items():
        log(
            f"\n{name}"
            + (
                f": the broker's round trip {base_ms:g} ms, {base_ms * 10:g} ms "
                "from half-way through each phase (limits: before -> at the end)"
                if name == "broker-x10"
                else f": the broker's round trip {base_ms:g} ms"
            )
        )
        for line in table(ladder_rows):
            log(line)
    log(
        f"\ngoals at {', '.join(f'{f:g}x' for f in GOALS_AT)}: goodput >= {GOAL_GOODPUT:.0%} of "
        f"sustainable; >= {GOAL_FAST:.0%} of the excess that was sent refused (503 or "
        f"connection failure, a refused connect counted as one) within {args.fast * 1000:g} "
        f"ms; 2xx p99 <= {GOAL_P99_MS:.0f} ms; "
        "RSS growth <= 64 MiB. sent: the rate the generator managed to send; client-shed: "
        "arrivals it could not send within the run (each client holds one request at a time); "
        "over 10 % of the arrivals: with h2load generator-bound (raise --max-connections or "
        "lower --client-rate), with sbload owed by refused clients (connects refused, their "
        "backlog not sent before their schedule's end: the gateway refusing); client-bound: "
        "in the steady window every client h2load still held was busy (requests in progress "
        ">= 90 % of the open connections, sampled), so goodput "
        "was at most those clients / the latency (a client refused at connect is gone for the "
        "phase); h2load pipelined: more requests in progress than connections, h2load's --rps "
        "having sent every request a client owed in one write after the gateway closed its "
        "connection, so they waited behind each other there (a p99 of the generator's making). "
        "CPU: each process's share of one CPU (the gateway has the first CPU; "
        "the broker and h2load share the second); on a shared machine the shares need not add "
        "up to saturation."
    )
    log(tally(rows) + f"; {loadavg()}")
    for name, ladder_rows in rows.items():
        for row in ladder_rows:
            if "failed" in row:
                continue
            a = row["adaptive"]
            limit = (
                f"; adaptive limit {a.get('limit', 0):.0f} (baseline "
                f"{a.get('baseline_s', float('nan')) * 1000:.1f} ms, "
                f"{a.get('refused', 0):,.0f} refused by the dispatcher so far)"
                if "limit" in a
                else ""
            )
            log(
                f"  {name} {row['factor']:g}x: {row['correctness']}; gateway shed "
                f"{ {k: int(v) for k, v in row['gateway_shed'].items() if v} }{limit}"
            )


async def bench(args: argparse.Namespace, cores: Cores, log: Any) -> dict[str, Any]:
    cost: dict[str, Any] = {}
    if args.refusal_cost:
        log("\n== what a refusal costs: null sink, closed loop")
        cost = await refusal_cost(args, cores, log)
    ladders = [name for name in args.ladders if name == "steady" or args.sink == "sdk"]
    async with await _stack(args, cores) as stack:
        rss = RssSampler(stack.gateway.pid, interval=0.5).start()
        try:
            first = rss.sample() or 0
            log(
                f"\ngateway up (pid {stack.gateway.pid}, sink {args.sink}, adaptive admission "
                f"{args.adaptive}), RSS {first / MiB:.1f} MiB; broker round trip "
                f"{stack.base_ms:g} ms"
            )
            log(f"\n== sustainable rate: {args.rounds} x {args.window:g} s, h2load closed loop")
            rate, rates, ok_us = await sustainable_rate(args, cores, stack, log)
            spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
            log(f"-> sustainable: {rate:,.0f} req/s (median; windows {spread})")
            if args.rate:
                rate = args.rate
                log(f"-> the ladder's 1x: {rate:,.0f} req/s, as given (--rate)")
            log(f"\n== 0.5x: {rate * 0.5:,.0f} req/s offered for {args.duration:g} s")
            unloaded_phase = await phase(args, cores, stack, rss, rate, 0.5, "steady")
            phases: dict[str, list[dict[str, Any]]] = {}
            for name in ladders:
                phases[name] = []
                for factor in args.factors:
                    log(
                        f"\n== {name} {factor:g}x: {rate * factor:,.0f} req/s offered for "
                        f"{args.duration:g} s"
                        + (
                            f"; the broker's round trip {stack.base_ms:g} -> "
                            f"{stack.base_ms * 10:g} ms half-way"
                            if name == "broker-x10"
                            else ""
                        )
                    )
                    p = await phase(args, cores, stack, rss, rate, factor, name)
                    phases[name].append(p)
                    if "failed" in p:
                        log(f"   {p['failed']}: no figures for this phase")
                        continue
                    r = p["result"]
                    steady_lat = r.get("latency_steady_ms") or {}
                    log(
                        f"   2xx p50 / p99 of the requests sent in the steady window (the "
                        f"ramp's connects left out): {steady_lat.get('p50', math.nan):.0f} / "
                        f"{steady_lat.get('p99', math.nan):.0f} ms"
                    )
                    log(
                        f"   {p['connections']:,} clients; statuses {r['statuses']}, errors "
                        f"{r['errors']}, in flight at the end {r['unanswered_at_end']:,}, "
                        f"client-shed {r['shed']:,}; gateway shed {p['shed']}; CPU "
                        + ", ".join(f"{k} {v:.0%}" for k, v in p["cpu"].items())
                        + f"; {p['sends']}; {p['correctness']}"
                    )
                    if p["held"]:
                        log(f"   steady window: {p['held']}")
            await asyncio.sleep(args.cooldown)
            after = rss.sample() or 0
        finally:
            await rss.close()
    baseline = unloaded_phase.get("peak") or first
    unloaded = summarize(unloaded_phase, rate, baseline)
    rows = {name: [summarize(p, rate, baseline) for p in ps] for name, ps in phases.items()}
    report(
        args,
        log,
        {"rate": rate, "spread": spread, "ok_us": ok_us, "base_ms": stack.base_ms},
        cost,
        unloaded,
        baseline,
        rows,
    )
    log(f"RSS {after / MiB:.1f} MiB after {args.cooldown:g} s of calm")
    out = {
        "sink": args.sink,
        "adaptive": args.adaptive,
        "loadavg": loadavg(),
        "refusal_cost": cost,
        "sustainable_rate": rate,
        "sustainable_windows": rates,
        "gateway_us_per_2xx": ok_us,
        "unloaded": unloaded,
        "ladders": rows,
        "rss_first": first,
        "rss_after": after,
        "series": {
            f"{name} {p['factor']:g}x": p["series"]
            for name, ps in phases.items()
            for p in ps
            if "series" in p
        },
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
        "--ladders",
        default=",".join(LADDERS),
        help="steady and/or broker-x10 (the broker's round trip raised tenfold half-way "
        "through each phase), comma-separated (both; the null sink runs steady only)",
    )
    parser.add_argument(
        "--fast", type=float, default=0.05, help="a refusal this soon after sending is fast"
    )
    parser.add_argument("--sink", choices=("sdk", "null"), default="sdk")
    parser.add_argument(
        "--adaptive",
        choices=("on", "off"),
        default="on",
        help="adaptive admission (SBGATE_ADAPTIVE_ADMISSION; on)",
    )
    parser.add_argument(
        "--broker-base-ms",
        type=float,
        default=5.0,
        help="the broker's round trip throughout (ms; the broker-x10 ladder raises it to ten "
        "times this half-way through each phase)",
    )
    parser.add_argument(
        "--no-refusal-cost",
        dest="refusal_cost",
        action="store_false",
        help="skip step 0 (what a refusal costs)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=lambda kv: tuple(kv.split("=", 1)),
        help="NAME=value: a gateway setting (e.g. SBGATE_MAX_REQUESTS_IN_PROGRESS=0)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="the ladder's 1x in req/s instead of the sustainable rate measured (which is still "
        "measured and printed): the same offered loads for an A/B on a shared machine",
    )
    parser.add_argument("--rounds", type=int, help="sustainable-rate windows (3; quick 1)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per rate window")
    parser.add_argument("--connections", type=int, default=128, help="clients, rate windows")
    parser.add_argument("--max-connections", type=int, default=4000, help="open-loop clients")
    parser.add_argument(
        "--client-rate",
        type=float,
        default=2.5,
        help="requests a second each open-loop client paces, so a request may take up to "
        "1 / this before its client falls behind (2.5: 400 ms)",
    )
    parser.add_argument(
        "--ramp",
        type=float,
        default=2.0,
        help="seconds over which an open-loop phase's clients connect, evenly, each then "
        "sending for the phase's duration: their timers start when they connect, so their "
        "requests are a rate, not bursts; goodput is judged between the ramp's end and the "
        "duration, when every client sends (0: h2load for a duration, all clients at once; 2)",
    )
    parser.add_argument(
        "--spread",
        type=int,
        default=1,
        help="h2load processes an open-loop load is split into, started a fraction of a "
        "client's interval apart (the phases' spread without a ramp; 1)",
    )
    parser.add_argument(
        "--generator",
        choices=("h2load", "sbload"),
        default="sbload",
        help="the open-loop phases' generator: sbload (bench/sbload.c, which make bench-tools "
        "builds: its clients reconnect one by one after a refused connect or a close, and "
        "never pipeline), or h2load (whose refused clients are gone for the phase and which "
        "pipelines after a close) (sbload)",
    )
    parser.add_argument(
        "--slice",
        type=float,
        default=0.0,
        help="seconds each h2load process runs before it is started again, so clients whose "
        "connect a paused listener refused come back (h2load never retries a connect), as "
        "real clients reconnect (0: one run a process; measured, slices' reconnections "
        "close the listener by its accept-queue rule, so off by default)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="client deadline: a request unanswered, or a connection silent, this long is "
        "dropped (h2load's -N; 10). A ramped phase ends when its last client does, and "
        "under overload h2load left some clients idle on open connections, neither sending "
        "nor closing, until this deadline (measured: phases ran 20 s past their last "
        "answer at 30)",
    )
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds of calm after")
    parser.add_argument("--out", default=str(OUT_DIR), help="where the JSON goes")
    args = parser.parse_args(argv)
    args.duration = args.duration or (6.0 if args.quick else 15.0)
    args.factors = [float(f) for f in args.factors.split(",")]
    args.ladders = [name for name in args.ladders.split(",") if name]
    unknown = set(args.ladders) - set(LADDERS)
    if unknown:
        parser.error(f"unknown ladders: {', '.join(sorted(unknown))} (known: {LADDERS})")
    args.rounds = args.rounds or (1 if args.quick else 3)
    return run_bench("P9 overload", lambda cores, log: bench(args, cores, log))


if __name__ == "__main__":
    raise SystemExit(main())
