"""Session-order benchmarks (docs/failover.md#sessions-keep-their-order): ratios measured in
one run, printed; nothing asserted.

    .venv/bin/python -m bench.session_bench            # both, ~4 minutes
    .venv/bin/python -m bench.session_bench --quick    # short windows, fewer sessions
    .venv/bin/python -m bench.session_bench healthy    # a selection: healthy, failback

* **healthy** — the fence's cost on a healthy entity: the gateway's hot path (null sink,
  failover on, Redis configured, 1 KB messages carrying a SessionId) with
  ``session_order = strict`` (the fence is looked up for every message) vs the same with
  ``availability`` (no fence), and vs messages without a SessionId. Alternating rounds, the
  median of the per-round ratios (as P7 in `bench.gateway_bench`); goal ≥ 0.97. Every
  request carries the same SessionId (h2load sends one header set): the look-up is a set
  membership in memory, whatever the number of sessions.
* **failback** — after a failover, S sessions x M messages (1,000 x 10) wait in the backlog,
  every session fenced (32 sessions send at once, each one's messages one after the other;
  a message answered 503 is sent again, up to 5 times, as a client would); the entity is
  marked healthy and a ``gateway syphon`` replica (sharing Redis) moves them home.
  Printed: the time until every fence lifted, the session messages moved per second, and
  the plain syphon's rate for the same number of messages without a SessionId (the same
  run, the same broker set-up).

The gateways run in their own processes, pinned to the first CPU; the load generator and
the local broker on the second; redis-server on either (in the failback runs). Traffic
goes to 127.0.0.1 only; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.gateway_bench import (
    _NULL_NAMESPACES,
    BODY,
    ENTITY_URL_PATH,
    Party,
    Rate,
    _check_statuses,
    _cpu_ratio,
    _loadavg,
    _median_ratio,
    _ok_count,
    _together_ratio,
    alternate,
)
from bench.harness import Cores, Server, Window, cpu_seconds, pin, start_redis
from bench.native import H2Load, run_h2load
from gateway.core.backlog import backlog_path
from sblocal.testing import BrokerProcess, ControlClient
from tests.support.processes import GatewayProcess, broker_wiring, free_port
from tests.support.waiting import eventually

BENCHMARKS = ("healthy", "failback")
GOAL = 0.97
RETRIES = 5  # a message answered 503 (or not at all) is sent again, up to this many times
QUEUES = 10  # backlog queues of the pair
ENTITY = "orders"
SESSION_HEADER = {"BrokerProperties": orjson.dumps({"SessionId": "s-1"}).decode()}


@dataclass(frozen=True)
class Params:
    duration: float
    rounds: int
    connections: int
    sessions: int
    per_session: int
    senders: int  # sessions sending at once during the failover (each one sequential)
    quick: bool


def log(line: str) -> None:
    print(line, flush=True)


# -- healthy --------------------------------------------------------------------------------


async def bench_healthy(p: Params, cores: Cores) -> None:
    async with contextlib.AsyncExitStack() as stack:
        redis = await start_redis(cores.rest)
        stack.push_async_callback(asyncio.to_thread, redis.close)

        async def start(label: str, order: str) -> Server:
            env = {
                **_NULL_NAMESPACES,
                "SBGATE_ENTITIES": f"queue:{ENTITY}",
                "SBGATE_REPLICA_ID": f"bench-{label}",
                "SBGATE_LOG_LEVEL": "WARNING",
                "SBGATE_REDIS_URL": redis.url,
                "SBGATE_SESSION_ORDER": order,
            }
            server = await Server.start(label, "gateway", env, cpus=cores.subject)
            stack.push_async_callback(server.close)
            return server

        strict = await start("strict", "strict")
        avail = await start("availability", "availability")
        plain = await start("plain", "strict")
        rates = {
            "strict": Rate("strict, SessionId (fence on)", "req/s", "gateway"),
            "availability": Rate("availability, SessionId", "req/s", "gateway"),
            "plain": Rate("strict, no SessionId", "req/s", "gateway"),
        }

        def h2(server: Server, headers: dict[str, str]) -> H2Load:
            return H2Load(
                [server.url + ENTITY_URL_PATH],
                p.duration,
                connections=p.connections,
                body=BODY,
                headers={"content-type": "application/json", **headers},
            )

        def party(server: Server, headers: dict[str, str]) -> Party:
            rate = rates[server.label]

            async def run() -> tuple[Window, int]:
                window = await run_h2load(
                    h2(server, headers),
                    cpus=cores.rest,
                    watch={"gateway": server.pid, "redis": redis.pid},
                )
                _check_statuses(rate, window)
                return window, _ok_count(window)

            return rate, run

        loads = [(strict, SESSION_HEADER), (avail, SESSION_HEADER), (plain, {})]
        parties = [party(server, headers) for server, headers in loads]

        async def at_once() -> None:
            """All three loaded at once (they share the first CPU): CPU µs per request of
            each, measured at the same moments (the steadiest figure on a busy machine)."""
            cpu0 = {s.label: cpu_seconds(s.pid) for s, _ in loads}
            windows = await asyncio.gather(
                *(run_h2load(h2(s, h), cpus=cores.rest, watch={}) for s, h in loads)
            )
            parts = []
            for (server, _), window in zip(loads, windows, strict=True):
                ok = _ok_count(window)
                per = (cpu_seconds(server.pid) - cpu0[server.label]) / ok * 1e6 if ok else 0.0
                rates[server.label].together_us.append(per)
                parts.append(f"{server.label} {per:.0f}")
            log("  simultaneous CPU µs/req: " + ", ".join(parts))

        # A first, unmeasured round: each server syncs its fences and warms up.
        for _, run in parties:
            await run()
        await alternate(parties, p.rounds, log, at_once)
    ratio, text = _median_ratio(rates["strict"], rates["availability"])
    _, plain_text = _median_ratio(rates["strict"], rates["plain"])
    _, sim_text = _together_ratio(rates["strict"], rates["availability"])
    _, sim_plain = _together_ratio(rates["strict"], rates["plain"])
    log(
        f"-> healthy: strict (fence on) / availability, session messages: {text}  "
        f"(CPU-cost ratio {_cpu_ratio(rates['strict'], rates['availability']) or 'n/a'}; "
        f"simultaneous CPU-cost ratio {sim_text or 'n/a'})  "
        f"goal >= {GOAL}  met: {'yes' if ratio >= GOAL else 'NO'}"
    )
    log(
        f"   strict, session messages / strict, no SessionId: {plain_text} "
        f"(simultaneous CPU-cost ratio {sim_plain or 'n/a'})"
    )
    for r in rates.values():
        log(f"   {r.describe()}")
        for note in r.notes:
            log(f"     note: {note}")
    for r in rates.values():
        if r.share < 0.85:
            log(
                f"   WARNING: {r.label}: the gateway kept its CPU only {r.share:.0%} busy: "
                "other work is running on this machine; the simultaneous figure is the "
                "steadiest"
            )


# -- failback -------------------------------------------------------------------------------


def _env(broker: BrokerProcess, redis_url: str, replica: str, **extra: str) -> dict[str, str]:
    return {
        **broker_wiring(broker),
        "SBGATE_ENTITIES": f"queue:{ENTITY}",
        "SBGATE_LOG_LEVEL": "WARNING",
        "SBGATE_REPLICA_ID": replica,
        "SBGATE_REDIS_URL": redis_url,
        "SBGATE_BACKLOG_QUEUE_COUNT": str(QUEUES),
        "SBGATE_ENABLE_FAILOVER": "true",
        "SBGATE_FAILOVER_INTERVAL": "0",
        "SBGATE_PING_PRIMARY_INTERVAL": "3600",  # the bench marks the entity healthy
        "SBGATE_SDK_RETRY_TOTAL": "0",
        "SBGATE_IDLE_CHECK_INTERVAL": "3600",
        **extra,
    }


async def _depth(control: ControlClient, ns: str, path: str) -> int:
    return int((await control.entity(ns, path))["active"])


async def _backlogged(control: ControlClient) -> int:
    return sum(
        [await _depth(control, "secondary", backlog_path("primary", i)) for i in range(QUEUES)]
    )


async def _fenced(http: aiohttp.ClientSession, url: str) -> int:
    async with asyncio.timeout(10), http.get(f"{url}/admin/entities") as r:
        body = await r.json()
    [entry] = [e for e in body["entities"] if e["entity"] == ENTITY]
    return int(entry["fencedSessions"]["count"])


async def _fences_left(url: str) -> list[str]:
    """The fences still standing, each as Redis holds it (for a run where some did not
    lift: what holds them)."""
    from redis.asyncio import Redis

    client = Redis.from_url(url, decode_responses=True)
    try:
        async with asyncio.timeout(30):
            keys = [k async for k in client.scan_iter(match="{sbgate}:fence:*", count=1000)]
            return [f"{k.partition(chr(10))[2]}: {await client.hgetall(k)}" for k in keys]
    finally:
        await client.aclose()


async def _ingest(
    http: aiohttp.ClientSession, url: str, p: Params, sessions: bool
) -> tuple[list[int], float]:
    """Send every message (`p.senders` sessions at once, each one's messages one after the
    other); returns the answers' statuses and the seconds it took."""
    statuses: list[int] = []
    sem = asyncio.Semaphore(p.senders)

    async def one(s: int, i: int) -> int:
        props: dict[str, str] = {"MessageId": f"m-{s}-{i}"}
        if sessions:
            props["SessionId"] = f"s-{s}"
        try:
            async with (
                asyncio.timeout(60),
                http.post(
                    f"{url}/queues/{ENTITY}/messages",
                    data=BODY,
                    headers={"BrokerProperties": orjson.dumps(props).decode()},
                ) as r,
            ):
                await r.read()
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return 0  # unanswered (a busy gateway sheds connections): not acknowledged

    async def session(s: int) -> None:
        async with sem:
            for i in range(p.per_session):  # sequential within a session
                status = await one(s, i)
                for _ in range(RETRIES):  # as a client would: a 503 says "retry later"
                    if status not in {0, 503}:
                        break
                    await asyncio.sleep(0.2)
                    status = await one(s, i)
                statuses.append(status)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(p.sessions)))
    return statuses, time.perf_counter() - t0


async def failback_run(p: Params, cores: Cores, sessions: bool) -> dict[str, Any]:
    """One failover and failback: every message answered 202 into the backlog, then a syphon
    replica moves them home. Returns the timings."""
    total = p.sessions * p.per_session
    # The gateways' logs are kept (what a 503 was, say): printed at the end.
    logs = tempfile.mkdtemp(prefix=f"bench-session-{'sessions' if sessions else 'plain'}-")
    with BrokerProcess() as broker:
        pin(broker.pid, cores.rest)
        # Not pinned with the broker: a Redis call slower than the state store's 1 s
        # deadline breaks the session, and the session messages' backlog writes are then
        # answered 503 (fail closed) until it is back.
        redis = await start_redis(frozenset(range(os.cpu_count() or 1)))
        try:
            control = broker.control
            serve = GatewayProcess(
                "serve",
                _env(broker, redis.url, "serve", SBGATE_ENABLE_SYPHON="false"),
                port=free_port(),
                log_dir=Path(logs),
            )
            async with serve, aiohttp.ClientSession() as http:
                pin(serve.pid, cores.subject)
                fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
                statuses, ingest_s = await _ingest(http, serve.url, p, sessions)
                backlogged = await _backlogged(control)
                fenced_before = await _fenced(http, serve.url)
                await control.remove_fault("primary", fault)
                async with (
                    asyncio.timeout(10),
                    http.post(f"{serve.url}/admin/entities/{ENTITY}/healthy") as r,
                ):
                    if r.status != 200:
                        raise RuntimeError(f"marking {ENTITY} healthy: {r.status}")
                syphon = GatewayProcess(
                    "syphon",
                    _env(
                        broker,
                        redis.url,
                        "syphon",
                        SBGATE_RECEIVE_WAIT="0.5",
                        SBGATE_WORKERS="10",
                        SBGATE_MAX_BATCH="100",
                    ),
                    port=free_port(),
                    log_dir=Path(logs),
                    command="syphon",
                )
                t0 = time.perf_counter()
                lifted_s: float | None = None
                first: float | None = None  # the first message home
                async with syphon:
                    pin(syphon.pid, cores.subject)

                    async def home() -> bool:
                        nonlocal lifted_s, first
                        if lifted_s is None and await _fenced(http, serve.url) == 0:
                            lifted_s = time.perf_counter() - t0
                        at_home = await _depth(control, "primary", ENTITY)
                        if first is None and at_home > 0:
                            first = time.perf_counter()
                        return at_home >= backlogged

                    await eventually(home, within=900, every=0.1)
                    drain_s = time.perf_counter() - t0
                    moving_s = time.perf_counter() - (first or t0)

                    async def lifted() -> bool:
                        return await _fenced(http, serve.url) == 0

                    # Every message is home; a fence held by nothing but a write past its
                    # deadline lifts at the next depth check (one a minute while busy).
                    with contextlib.suppress(AssertionError):
                        await eventually(lifted, within=180, every=0.2)
                    if lifted_s is None and await lifted():
                        lifted_s = time.perf_counter() - t0
                    left = [] if lifted_s is not None else await _fences_left(redis.url)
        finally:
            await asyncio.to_thread(redis.close)
    return {
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "ingest_rate": total / ingest_s,
        "backlogged": backlogged,
        "fenced_before": fenced_before,
        "drain_s": drain_s,
        "moving_s": moving_s,
        "drain_rate": backlogged / moving_s,
        "lifted_s": lifted_s,
        "left": left,
        "logs": logs,
    }


async def bench_failback(p: Params, cores: Cores) -> None:
    total = p.sessions * p.per_session
    runs: dict[str, dict[str, Any]] = {}
    for label, sessions in (("sessions", True), ("plain", False)):
        where = f" in {p.sessions} sessions" if sessions else ", no SessionId"
        log(f"  {label}: {total} messages{where} ...")
        r = await failback_run(p, cores, sessions)
        runs[label] = r
        log(
            f"  {label}: answers {r['statuses']}, ingest {r['ingest_rate']:.0f} msgs/s, "
            f"{r['backlogged']} in the backlog ({r['fenced_before']} sessions fenced); "
            f"all home {r['drain_s']:.1f} s after the syphon replica was started, "
            f"{r['moving_s']:.1f} s after the first arrived ({r['drain_rate']:.0f} msgs/s)"
            + (f", every fence lifted after {r['lifted_s']:.1f} s" if r["lifted_s"] else "")
        )
        log(f"  ({label}: the gateways' logs are in {r['logs']})")
        if sessions and r["lifted_s"] is None:
            log(f"  NOT every fence lifted: {len(r['left'])} stand, e.g.")
            for line in r["left"][:5]:
                log(f"    {line[:400]}")
    s, plain = runs["sessions"], runs["plain"]
    lifted = (
        f"every fence lifted {s['lifted_s']:.1f} s after the syphon replica was started (its "
        "start-up included)"
        if s["lifted_s"] is not None
        else f"{len(s['left'])} fences did NOT lift"
    )
    log(
        f"-> failback: {p.sessions} fenced sessions x {p.per_session} messages: {lifted}; "
        f"session moves "
        f"{s['drain_rate']:.0f} msgs/s vs the plain syphon's {plain['drain_rate']:.0f} msgs/s "
        f"for {total} messages without sessions: ratio {s['drain_rate'] / plain['drain_rate']:.2f}"
    )


# -- driver ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> tuple[Params, set[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.session_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("which", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default both)")
    parser.add_argument("--quick", action="store_true", help="short windows, one round, 200 x 5")
    parser.add_argument("--duration", type=float, help="seconds per window (3; quick 1.5)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (5; quick 1)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--sessions", type=int, help="fenced sessions (1000; quick 200)")
    parser.add_argument("--per-session", type=int, help="messages per session (10; quick 5)")
    parser.add_argument("--senders", type=int, default=32, help="sessions sending at once")
    args = parser.parse_args(argv)
    which = set(args.which) or set(BENCHMARKS)
    if which - set(BENCHMARKS):
        parser.error(f"choose from {BENCHMARKS}")
    q = args.quick
    return (
        Params(
            duration=args.duration or (1.5 if q else 3.0),
            rounds=args.rounds or (1 if q else 5),
            connections=args.connections,
            sessions=args.sessions or (200 if q else 1000),
            per_session=args.per_session or (5 if q else 10),
            senders=args.senders,
            quick=q,
        ),
        which,
    )


async def main_async(p: Params, which: set[str], cores: Cores) -> None:
    jobs: list[tuple[str, Callable[[], Any]]] = []
    if "healthy" in which:
        jobs.append(
            ("healthy: the fence's cost on a healthy entity", lambda: bench_healthy(p, cores))
        )
    if "failback" in which:
        jobs.append(("failback: fenced sessions moved home", lambda: bench_failback(p, cores)))
    for title, job in jobs:
        log(f"\n== {title} (load average {_loadavg()})")
        started = time.monotonic()
        await job()
        log(f"   ({time.monotonic() - started:.0f} s; load average {_loadavg()})")


def main(argv: list[str] | None = None) -> int:
    p, which = parse(argv)
    cores = Cores.split()
    if cores.rest:
        os.sched_setaffinity(0, cores.rest)
    log(
        f"session benchmarks {sorted(which)}: {p.rounds} round(s) x {p.duration:g} s; "
        f"{p.sessions} sessions x {p.per_session}; {cores.describe}; "
        f"python {sys.version.split()[0]}; load average {_loadavg()} on {os.cpu_count()} CPUs"
    )
    asyncio.run(main_async(p, which, cores))
    log(f"\nload average {_loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
