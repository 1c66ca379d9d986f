"""The chaos scenarios: each starts its own stack (2 gateway replicas), drives load and one
kind of fault, then drains everything and checks it. Every scenario has the same baseline
criteria (nothing acknowledged lost, no duplicate delivered with duplicate detection on, no
delivery after a definite "not stored", no phantom, nothing misrouted) plus its own.

Durations scale with ``scale`` (1.0 = the full suite; the CI tests use ~0.3). Nothing
sleeps to wait for a condition: waits poll with deadlines; the sleeps left are the *shape*
of the scenario (how long a fault lasts).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from loadtests.acks import AckWriter, read_acks
from loadtests.checker import Verdict, check, in_backlog, is_dlq
from loadtests.client import Endpoints, LoadClient, LoadProfile, LoadStats
from loadtests.harness import backlog_depth, drain_all
from loadtests.stack import PRIMARY, SECONDARY, Stack, StackOptions, syphon_available

log = logging.getLogger(__name__)
_T = TypeVar("_T")

ENTITIES = ("orders", "payments", "events")


@dataclass
class Criterion:
    name: str
    ok: bool | None  # None: pending (the feature it checks is not there yet)
    detail: str = ""


@dataclass
class ScenarioResult:
    name: str
    title: str
    verdict: Verdict
    criteria: list[Criterion]
    duration_s: float
    requests: int
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.ok is not False for c in self.criteria)

    @property
    def pending(self) -> bool:
        return any(c.ok is None for c in self.criteria)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "title": self.title,
            "passed": self.passed,
            "pending": self.pending,
            "duration_s": round(self.duration_s, 1),
            "requests": self.requests,
            "verdict": self.verdict.as_dict(),
            "criteria": [c.__dict__ for c in self.criteria],
            "notes": self.notes,
        }


class StateWatcher:
    """Polls every replica's /admin/entities and records each observed state change as
    (monotonic time, replica index, entity, state). An owned task: use as a context."""

    def __init__(self, stack: Stack, interval: float = 0.1) -> None:
        self.stack = stack
        self.interval = interval
        self.changes: list[tuple[float, int, str, str]] = []
        self.current: dict[tuple[int, str], str] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StateWatcher:
        self._task = asyncio.create_task(self._poll(), name="state-watcher")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                for i, gw in enumerate(self.stack.replicas):
                    if not gw.running:
                        continue
                    try:
                        async with asyncio.timeout(1.0):
                            async with session.get(gw.url + "/admin/entities") as resp:
                                body = await resp.json()
                    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                        continue
                    now = time.monotonic()
                    for e in body.get("entities", []):
                        key = (i, e["entity"])
                        if self.current.get(key) != e["state"]:
                            self.current[key] = e["state"]
                            self.changes.append((now, i, e["entity"], e["state"]))
                await asyncio.sleep(self.interval)

    def all_in(self, state: str, replicas: list[int] | None = None) -> bool:
        idx = replicas if replicas is not None else list(range(len(self.stack.replicas)))
        return all(self.current.get((i, e)) == state for i in idx for e in ENTITIES)

    async def wait_all(
        self, state: str, within: float, replicas: list[int] | None = None
    ) -> float | None:
        """Monotonic time at which every (replica, entity) was in `state`, None on timeout."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.all_in(state, replicas):
                return time.monotonic()
            await asyncio.sleep(self.interval / 2)
        return None

    def first(self, state: str, after: float, replica: int, entity: str) -> float | None:
        for t, i, e, s in self.changes:
            if t >= after and i == replica and e == entity and s == state:
                return t
        return None

    def transitions(self, start: float, end: float) -> list[tuple[float, int, str, str]]:
        return [c for c in self.changes if start <= c[0] < end]


class Ctx:
    """What a scenario body gets: the stack, the clock, the load, its criteria."""

    def __init__(self, stack: Stack, run_dir: Path, scale: float) -> None:
        self.stack = stack
        self.run_dir = run_dir
        self.scale = scale
        self.criteria: list[Criterion] = []
        self.notes: list[str] = []
        self.injected: set[str] = set()
        self.clients: list[LoadClient] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.endpoints: Endpoints | None = None
        self.t0 = time.monotonic()
        self.expect_backlog_drained = False
        # Checks to run once the backlog is drained (before the stack stops), and checks of
        # what the final drain delivered.
        self.after_drain: list[Callable[[Ctx], Awaitable[None]]] = []
        self.post_checks: list[PostCheck] = []
        self.has_syphon = False
        self.max_rate: float | None = None  # requests/s cap for every client (CI)

    def s(self, seconds: float) -> float:
        """A scenario duration, scaled (never below 1 s)."""
        return max(1.0, seconds * self.scale)

    def start(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """A task owned by the scenario: awaited by its body, or cancelled and awaited by
        `run_scenario` if the body ends early (a failed step must not leave load running)."""
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        return task

    async def cancel_tasks(self) -> None:
        pending = [t for t in self.tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def criterion(self, name: str, ok: bool | None, detail: str = "") -> None:
        self.criteria.append(Criterion(name, ok, detail))

    def note(self, text: str) -> None:
        log.info("%s", text)
        self.notes.append(text)

    def client(self, profile: LoadProfile, name: str = "client") -> LoadClient:
        assert self.endpoints is not None
        acks = AckWriter(self.run_dir / "acks" / f"{name}-{len(self.clients)}.jsonl")
        profile.id_prefix = f"{self.run_dir.name}-{name}{len(self.clients)}"
        if self.max_rate is not None:
            profile.rate = min(profile.rate or self.max_rate, self.max_rate)
        c = LoadClient(self.endpoints, acks, profile)
        self.clients.append(c)
        return c

    async def at(self, t: float) -> None:
        """Wait until `t` seconds (scaled by the caller) after the scenario started."""
        delay = self.t0 + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    @property
    def stats(self) -> LoadStats:
        merged = LoadStats()
        for c in self.clients:
            merged.records.extend(c.stats.records)
            merged.requests += c.stats.requests
            merged.messages_acked += c.stats.messages_acked
        return merged


Body = Callable[[Ctx], Awaitable[None]]
PostCheck = Callable[[Ctx, list[dict[str, Any]], Verdict], None]


@dataclass
class Scenario:
    name: str
    title: str
    body: Body
    options: StackOptions = field(default_factory=StackOptions)
    needs_syphon: bool = False  # criteria about draining the backlog are pending without it


# -- helpers -------------------------------------------------------------------------------


def _profile(**kw: Any) -> LoadProfile:
    base: dict[str, Any] = {"concurrency": 12}
    base.update(kw)
    return LoadProfile(**base)


def _ratio_2xx(records: list[Any]) -> float:
    answered = [r for r in records if r.attempt == 0]
    if not answered:
        return 1.0
    return sum(1 for r in answered if r.outcome == "acked") / len(answered)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


async def _wait_backlog_empty(ctx: Ctx, within: float) -> float | None:
    """Seconds until no message waits in any backlog queue; None on timeout."""
    assert ctx.stack.broker is not None
    start = time.monotonic()
    while time.monotonic() - start < within:
        if await backlog_depth(ctx.stack.broker) == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.25)
    return None


# -- scenario bodies -----------------------------------------------------------------------


async def baseline(ctx: Ctx) -> None:
    """Steady load, no fault: everything to the primary, no 5xx."""
    c = ctx.client(_profile(concurrency=16))
    await c.run(duration=ctx.s(30))
    recs = c.stats.records
    n5 = sum(1 for r in recs if r.status is not None and r.status >= 500)
    ctx.criterion("no 5xx", n5 == 0, f"{n5} answers >= 500")
    routes = {r.route for r in recs if r.outcome == "acked"}
    ctx.criterion("every message to the primary", routes <= {"primary"}, f"routes {routes}")


async def replica_kill(ctx: Ctx) -> None:
    """SIGKILL one replica mid-load; clients retry the same ids on the other."""
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(30)))
    await ctx.at(ctx.s(8))
    ctx.stack.replicas[0].kill()
    killed_at = ctx.elapsed()
    ctx.note(f"SIGKILL gw0 at {killed_at:.1f} s")
    await ctx.at(ctx.s(18))
    await ctx.stack.restart_replica(0)
    ctx.note(f"gw0 back at {ctx.elapsed():.1f} s")
    await task
    recs = c.stats.records
    first = [r for r in recs if r.attempt == 0]
    retried = sum(1 for r in recs if r.attempt > 0)
    ctx.note(f"{retried} retries after the kill")
    acked_ids, all_ids = _acked_fraction(ctx)
    ratio = acked_ids / max(1, all_ids)
    ctx.criterion(
        "every request eventually acknowledged (retry on the other replica)",
        ratio >= 0.999,
        f"{acked_ids}/{all_ids} ids acked ({_pct(ratio)}); {len(first)} requests",
    )


def _acked_fraction(ctx: Ctx) -> tuple[int, int]:
    acked: set[str] = set()
    every: set[str] = set()
    for a in read_acks([ctx.run_dir / "acks"]):
        every.add(a.message_id)
        if a.outcome == "acked":
            acked.add(a.message_id)
    return len(acked), len(every)


async def replica_sigterm(ctx: Ctx) -> None:
    """SIGTERM one replica mid-load: readiness drops, in-flight requests finish, exit 0."""
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(25)))
    await ctx.at(ctx.s(8))
    gw0 = ctx.stack.replicas[0]
    term_at = time.monotonic()
    gw0.terminate()
    code = await gw0.wait(within=30)
    ctx.note(f"gw0 exited {code} {time.monotonic() - term_at:.1f} s after SIGTERM")
    ctx.criterion("SIGTERM: clean exit 0", code == 0, f"exit code {code}")
    await ctx.at(ctx.s(16))
    await ctx.stack.restart_replica(0)
    await task
    cut = [
        r
        for r in c.stats.records
        if r.url == gw0.url and r.outcome == "indeterminate" and r.start >= term_at - 1
    ]
    ctx.criterion(
        "no accepted request cut (no unanswered request on the stopping replica)",
        not cut,
        f"{len(cut)} unanswered: "
        + ", ".join(f"{r.error} at +{r.end - term_at:.2f} s" for r in cut[:3])
        + f" (drain delay {ctx.stack.options.drain_delay} s)",
    )
    acked_ids, all_ids = _acked_fraction(ctx)
    ctx.criterion(
        "every request eventually acknowledged",
        acked_ids == all_ids,
        f"{acked_ids}/{all_ids} ids acked",
    )


async def primary_outage(ctx: Ctx) -> None:
    """The primary namespace down ~30 s, then back: clients keep getting 2xx (backlog),
    every replica fails over within interval + 1 s, the backlog is drained after recovery."""
    interval = ctx.stack.options.failover_interval
    c = ctx.client(_profile())
    async with StateWatcher(ctx.stack) as watch:
        task = ctx.start(c.run(duration=ctx.s(45)))
        await ctx.at(ctx.s(5))
        assert ctx.stack.broker is not None
        down_at = time.monotonic()
        await ctx.stack.control.down(PRIMARY)
        ctx.note(f"primary down at {ctx.elapsed():.1f} s")
        failed_over = await watch.wait_all("failed_over", within=interval + 15)
        worst = 0.0
        details = []
        for i in range(len(ctx.stack.replicas)):
            for e in ENTITIES:
                t_failing = watch.first("failing", down_at, i, e)
                t_over = watch.first("failed_over", down_at, i, e)
                if t_over is None:
                    worst = float("inf")
                    continue
                # Measured from the first failure the cluster saw (the start of `failing`;
                # a replica that learnt it from another may skip that state).
                starts = [
                    watch.first("failing", down_at, j, e) for j in range(len(ctx.stack.replicas))
                ]
                t_start = min([t for t in starts if t is not None] or [t_failing or down_at])
                worst = max(worst, t_over - t_start)
                details.append(f"gw{i}/{e}: {t_over - down_at:.1f} s after down")
        ctx.criterion(
            "failover within interval + 1 s (every replica, every entity)",
            failed_over is not None and worst <= interval + 1.0 + watch.interval,
            f"worst {worst:.2f} s from the first failure (interval {interval} s); "
            + "; ".join(details[:6]),
        )
        await ctx.at(ctx.s(35))
        await ctx.stack.control.up(PRIMARY)
        up_at = time.monotonic()
        ctx.note(f"primary up at {ctx.elapsed():.1f} s")
        healthy = await watch.wait_all("healthy", within=20)
        ctx.criterion(
            "every replica back on the primary after recovery",
            healthy is not None,
            f"{(healthy or 0) - up_at:.1f} s after up" if healthy else "not within 20 s",
        )
        await task
    ratio = _ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, _pct(ratio))
    backlogged = sum(r.messages for r in c.stats.records if r.route == "backlog")
    ctx.note(f"{backlogged} messages acknowledged from the backlog")
    ctx.criterion("messages were backlogged", backlogged > 0, f"{backlogged}")
    ctx.expect_backlog_drained = True


async def broker_stall(ctx: Ctx) -> None:
    """Every replica's connection to the primary stalls (the fault proxy holds the bytes) for
    ~12 s, then flows again: sends hang until the gateway's deadline, the gateway fails over;
    after the heal the held transfers reach the broker late (stored although the gateway saw
    a timeout: backlog shadows, which duplicate detection must absorb)."""
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(35)))
    await ctx.at(ctx.s(5))
    for pair in ctx.stack.broker_proxies:
        pair[PRIMARY].stall()
    ctx.note(f"primary links stalled at {ctx.elapsed():.1f} s")
    await ctx.at(ctx.s(5) + max(8.0, ctx.s(12)))
    for pair in ctx.stack.broker_proxies:
        pair[PRIMARY].heal()
    ctx.note(f"primary links flowing again at {ctx.elapsed():.1f} s")
    await task
    ratio = _ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, _pct(ratio))
    n5 = sum(1 for r in c.stats.records if r.status is not None and r.status >= 500)
    ctx.note(f"{n5} answers >= 500")
    ctx.expect_backlog_drained = True


async def total_outage(ctx: Ctx) -> None:
    """The primary and every backlog queue down: 100% 503, zero 2xx, memory flat."""
    send_timeout = ctx.stack.options.send_timeout
    c = ctx.client(_profile(retry=False, concurrency=16))
    task = ctx.start(c.run(duration=ctx.s(35)))
    await ctx.at(ctx.s(5))
    await ctx.stack.control.down(SECONDARY)
    await ctx.stack.control.down(PRIMARY)
    down_at = time.monotonic()
    ctx.note(f"primary and secondary down at {ctx.elapsed():.1f} s")
    # Settle: requests already in flight may still finish either way.
    await asyncio.sleep(send_timeout + 2)
    w_start = time.monotonic()
    samples: list[list[int]] = []  # RSS of each replica, once a second
    w_end_at = ctx.t0 + ctx.s(28)
    while time.monotonic() < w_end_at:
        samples.append([gw.rss_bytes() or 0 for gw in ctx.stack.replicas])
        await asyncio.sleep(min(1.0, max(0.0, w_end_at - time.monotonic())))
    samples.append([gw.rss_bytes() or 0 for gw in ctx.stack.replicas])
    w_end = time.monotonic()
    await ctx.stack.control.up(SECONDARY)
    await ctx.stack.control.up(PRIMARY)
    ctx.note(f"up again at {ctx.elapsed():.1f} s ({w_end - down_at:.0f} s outage)")
    await task
    # Requests that started and ended inside the outage (one in flight at recovery may
    # legitimately succeed).
    window = [r for r in c.stats.window(w_start, w_end) if r.end < w_end]
    n2 = sum(1 for r in window if r.status is not None and 200 <= r.status < 300)
    n503 = sum(1 for r in window if r.status == 503)
    ctx.criterion("zero 2xx during the outage", n2 == 0, f"{n2} of {len(window)}")
    ctx.criterion(
        "100% 503 during the outage",
        bool(window) and n503 == len(window),
        f"{n503}/{len(window)} (others: {_other_statuses(window)})",
    )
    # Flat = no growth once warmed up: compare the middle of the outage with its end (the
    # first seconds allocate the SDK's reconnect state and the allocator's arenas).
    first, mid, last = samples[0], samples[len(samples) // 2], samples[-1]
    growth = max(b - a for a, b in zip(mid, last, strict=True)) / 2**20
    mib = [[round(x / 2**20) for x in row] for row in (first, mid, last)]
    ctx.criterion(
        "memory flat under outage load (RSS growth < 8 MiB over the second half)",
        growth < 8,
        f"RSS start/middle/end of the outage: {mib} MiB",
    )


def _other_statuses(records: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.status != 503:
            key = str(r.status) if r.status is not None else str(r.error)
            out[key] = out.get(key, 0) + 1
    return out


async def redis_blackhole(ctx: Ctx) -> None:
    """Redis blackholed for ~30 s (connections hang): no 5xx, replicas stay ready."""
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(40)))
    not_ready = 0
    await ctx.at(ctx.s(4))
    for p in ctx.stack.redis_proxies:
        p.blackhole()
    ctx.note(f"Redis blackholed at {ctx.elapsed():.1f} s")
    end = ctx.t0 + ctx.s(34)
    assert ctx.endpoints is not None
    while time.monotonic() < end:
        if len(ctx.endpoints.ready) < len(ctx.stack.replicas):
            not_ready += 1
        await asyncio.sleep(0.2)
    for p in ctx.stack.redis_proxies:
        p.heal()
    ctx.note(f"Redis healed at {ctx.elapsed():.1f} s")
    await task
    n5 = sum(1 for r in c.stats.records if r.status is not None and r.status >= 500)
    ctx.criterion("no 5xx while Redis is blackholed", n5 == 0, f"{n5} answers >= 500")
    ctx.criterion("replicas stay ready", not_ready == 0, f"{not_ready} polls saw a replica unready")


async def redis_restart_empty(ctx: Ctx) -> None:
    """Redis restarted empty while the primary is failed over: no flapping."""
    c = ctx.client(_profile())
    async with StateWatcher(ctx.stack) as watch:
        task = ctx.start(c.run(duration=ctx.s(40)))
        await ctx.at(ctx.s(4))
        await ctx.stack.control.down(PRIMARY)
        t_over = await watch.wait_all("failed_over", within=20)
        ctx.note(f"failed over at {ctx.elapsed():.1f} s")
        w_start = time.monotonic()
        await asyncio.to_thread(ctx.stack.redis.restart, True)
        ctx.note(f"Redis restarted empty at {ctx.elapsed():.1f} s")
        await ctx.at(ctx.s(28))
        w_end = time.monotonic()
        await ctx.stack.control.up(PRIMARY)
        healthy = await watch.wait_all("healthy", within=20)
        await task
    flips = [t for t in watch.transitions(w_start, w_end) if t[3] != "failed_over"]
    ctx.criterion("failover engaged", t_over is not None, "")
    ctx.criterion(
        "no flapping after the empty restart (stays failed_over while the primary is down)",
        not flips,
        f"{len(flips)} transitions away from failed_over: {flips[:4]}",
    )
    ctx.criterion("back on the primary after recovery", healthy is not None, "")
    ratio = _ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, _pct(ratio))
    ctx.expect_backlog_drained = True


async def redis_partition(ctx: Ctx) -> None:
    """One replica cut off from Redis while the primary fails: it keeps answering on its own
    local state machine; both come back to the primary after recovery."""
    c = ctx.client(_profile())
    async with StateWatcher(ctx.stack) as watch:
        task = ctx.start(c.run(duration=ctx.s(40)))
        await ctx.at(ctx.s(3))
        ctx.stack.redis_proxies[0].reset()
        ctx.note(f"gw0 cut off from Redis at {ctx.elapsed():.1f} s")
        await ctx.at(ctx.s(6))
        await ctx.stack.control.down(PRIMARY)
        over = await watch.wait_all("failed_over", within=20)
        ctx.criterion(
            "both replicas fail over (the cut-off one on its own)",
            over is not None,
            str(watch.current),
        )
        await ctx.at(ctx.s(22))
        await ctx.stack.control.up(PRIMARY)
        await ctx.at(ctx.s(26))
        ctx.stack.redis_proxies[0].heal()
        ctx.note(f"gw0 reconnected to Redis at {ctx.elapsed():.1f} s")
        healthy = await watch.wait_all("healthy", within=25)
        ctx.criterion(
            "both replicas back on the primary",
            healthy is not None,
            str({k: v for k, v in watch.current.items() if v != "healthy"}),
        )
        await task
    for i, gw in enumerate(ctx.stack.replicas):
        recs = [r for r in c.stats.records if r.url == gw.url and r.attempt == 0]
        ratio = sum(1 for r in recs if r.outcome == "acked") / max(1, len(recs))
        ctx.criterion(f"gw{i}: >= 99% answered 2xx", ratio >= 0.99, f"{_pct(ratio)} of {len(recs)}")
    n5 = sum(1 for r in c.stats.records if r.status is not None and r.status >= 500)
    ctx.criterion("no 5xx", n5 == 0, f"{n5}")
    ctx.expect_backlog_drained = True


async def syphon_kill(ctx: Ctx) -> None:
    """Fill the backlog during an outage, then SIGKILL the syphon process again and again
    while it moves messages home: every message arrives, once (duplicate detection)."""
    c = ctx.client(_profile())
    await ctx.stack.control.down(PRIMARY)
    await c.run(duration=ctx.s(12))
    await ctx.stack.control.up(PRIMARY)
    assert ctx.stack.broker is not None
    depth = await backlog_depth(ctx.stack.broker)
    ctx.note(f"{depth} messages in the backlog after the outage")
    ctx.criterion("messages were backlogged", depth > 0, f"{depth}")
    rng = random.Random(7)
    kills = 0
    target_kills = max(3, round(10 * min(1.0, ctx.scale)))
    deadline = time.monotonic() + 150
    while kills < target_kills and time.monotonic() < deadline:
        if await backlog_depth(ctx.stack.broker) == 0:
            break
        before = (await ctx.stack.control.counters(PRIMARY))["messages_received"]
        sy = await ctx.stack.start_syphon(wait_ready=False)
        # Wait until it is moving (the primary receives its sends), then kill it without
        # warning a moment later: batches are in flight, some sent and not yet completed.
        moving = False
        until = time.monotonic() + 30
        while time.monotonic() < until and sy.running:
            counters = await ctx.stack.control.counters(PRIMARY)
            if counters["messages_received"] > before:
                moving = True
                break
            await asyncio.sleep(0.02)
        if moving:
            await asyncio.sleep(rng.uniform(0.0, 0.4))
        sy.kill()
        await sy.wait(10)
        kills += moving
    ctx.note(f"{kills} syphon kills while moving")
    ctx.criterion(
        f"the syphon was killed while moving, repeatedly (>= {target_kills})",
        kills >= target_kills,
        f"{kills}",
    )
    await ctx.stack.start_syphon(wait_ready=False)
    ctx.expect_backlog_drained = True
    ctx.after_drain.append(_redeliveries_caught)


async def _redeliveries_caught(ctx: Ctx) -> None:
    counters = await ctx.stack.control.counters(PRIMARY)
    dups = counters["duplicates"]
    ctx.note(f"primary counters: {counters}")
    ctx.criterion(
        "some kills landed between send and complete (duplicates caught at the primary)",
        dups > 0,
        f"{dups} redelivered messages dropped by duplicate detection",
    )


async def ttl_shorter_than_outage(ctx: Ctx) -> None:
    """Messages with a TTL shorter than the outage: the ones that outlive it in the backlog
    are dead-lettered there (TTLExpiredException), never delivered late; nothing is lost."""
    ttl = 5.0
    outage = max(ttl * 3, ctx.s(15))
    c = ctx.client(_profile(ttl=ttl))
    task = ctx.start(c.run(duration=ctx.s(3) + outage + ctx.s(5)))
    await ctx.at(ctx.s(3))
    await ctx.stack.control.down(PRIMARY)
    await ctx.at(ctx.s(3) + outage)
    await ctx.stack.control.up(PRIMARY)
    await task
    ctx.expect_backlog_drained = True
    ctx.note(f"TTL {ttl} s; outage {outage:.0f} s")
    ctx.post_checks.append(lambda c, delivered, v: _ttl_honoured(c, delivered, ttl))
    ctx.after_drain.append(_subsecond_ttl_probe)


PROBE_TTL = 0.5


async def _subsecond_ttl_probe(ctx: Ctx) -> None:
    """Once everything is healthy again: a few messages with TimeToLive 0.5 s straight to the
    primary. They must expire (dead-lettered at the primary), never stay deliverable."""
    assert ctx.endpoints is not None
    acks = AckWriter(ctx.run_dir / "acks" / "ttl-probe.jsonl")
    probe = LoadClient(ctx.endpoints, acks, LoadProfile(retry=False))
    ids = [f"{ctx.run_dir.name}-ttl-probe-{i}" for i in range(5)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        for mid in ids:
            headers = {
                "Content-Type": "text/plain",
                "BrokerProperties": orjson.dumps(
                    {"MessageId": mid, "TimeToLive": PROBE_TTL}
                ).decode(),
            }
            await probe.send_once(
                session,
                ctx.stack.urls[0],
                "orders",
                "/queues/orders/messages",
                b"p",
                headers,
                [mid],
            )
    acks.close()
    ctx.post_checks.append(lambda c, delivered, v: _probe_expired(c, delivered, ids))


def _probe_expired(ctx: Ctx, delivered: list[dict[str, Any]], ids: list[str]) -> None:
    alive = [
        r["message_id"]
        for r in delivered
        if r["message_id"] in set(ids) and not in_backlog(r) and not is_dlq(r)
    ]
    ctx.criterion(
        f"a TimeToLive under a second ({PROBE_TTL} s) is honoured at the primary",
        not alive,
        f"{len(alive)}/{len(ids)} still deliverable well after their TTL: {alive[:2]}",
    )


def _ttl_honoured(ctx: Ctx, delivered: list[dict[str, Any]], ttl: float) -> None:
    """Expired ones in the backlog's DLQ; nothing enqueued at the primary after its TTL."""
    accepted: dict[str, dt.datetime] = {}
    for a in read_acks([ctx.run_dir / "acks"]):
        if a.outcome == "acked" and "-ttl-probe-" not in a.message_id:  # checked on its own
            accepted.setdefault(a.message_id, dt.datetime.fromisoformat(a.ts))
    in_backlog_dlq = sum(
        1
        for r in delivered
        if in_backlog(r) and is_dlq(r) and r.get("dead_letter_reason") == "TTLExpiredException"
    )
    late: list[str] = []  # enqueued at the primary after its TTL had run out
    alive: list[str] = []  # still deliverable at the primary long after its TTL
    for r in delivered:
        acked_at = accepted.get(r["message_id"])
        if in_backlog(r) or is_dlq(r) or not acked_at:
            continue
        # The ack is written after the answer, so it is later than the acceptance: lenient.
        if r.get("enqueued_time") and _age(r["enqueued_time"], acked_at) > ttl + 1.0:
            late.append(r["message_id"])
        if r.get("drained_at") and _age(r["drained_at"], acked_at) > ttl + 2.0:
            alive.append(r["message_id"])
    if not ctx.has_syphon:
        ctx.criterion("expired messages dead-lettered in the backlog", None, "pending")
        return
    ctx.criterion(
        "messages that outlived their TTL in the backlog dead-lettered there (TTLExpired)",
        in_backlog_dlq > 0,
        f"{in_backlog_dlq} in backlog dead-letter queues",
    )
    ctx.criterion(
        "nothing enqueued at the primary after its TTL ran out",
        not late,
        f"{len(late)} late: {late[:3]}",
    )
    ctx.criterion(
        "nothing still deliverable at the primary after its TTL ran out",
        not alive,
        f"{len(alive)} alive: {alive[:3]}",
    )


def _age(iso: str, since: dt.datetime) -> float:
    t = dt.datetime.fromisoformat(iso)
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return (t - since).total_seconds()


async def poison(ctx: Ctx) -> None:
    """Malformed and oversized requests among normal load: each refused with a 4xx, the
    normal traffic untouched (no 5xx, all acknowledged)."""
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(20)))
    url = ctx.stack.replicas[0].url
    cases: list[tuple[str, str, dict[str, str], bytes]] = [
        ("invalid JSON batch", "/queues/orders/messages",
         {"Content-Type": "application/vnd.microsoft.servicebus.json"}, b"[{not json"),
        ("batch with one malformed item", "/queues/orders/messages",
         {"Content-Type": "application/vnd.microsoft.servicebus.json"},
         orjson.dumps([{"Body": "ok", "BrokerProperties": {"MessageId": "poison-ok"}},
                       {"Body": 5, "BrokerProperties": "nope"}])),
        ("BrokerProperties not JSON", "/queues/orders/messages",
         {"BrokerProperties": "{MessageId:", "Content-Type": "text/plain"}, b"x"),
        ("MessageId over 128 characters", "/queues/orders/messages",
         {"BrokerProperties": orjson.dumps({"MessageId": "p" * 200}).decode()}, b"x"),
        ("message over 256 KB", "/queues/payments/messages",
         {"BrokerProperties": '{"MessageId": "poison-big"}'}, b"z" * (300 * 1024)),
        ("unknown entity", "/queues/nope/messages",
         {"BrokerProperties": '{"MessageId": "poison-404"}'}, b"x"),
        ("backlog path", "/primary/x-servicebus-transfer/0/messages", {}, b"x"),
        ("dead-letter sub-queue", "/queues/orders/$DeadLetterQueue/messages", {}, b"x"),
    ]  # fmt: skip
    answers: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            for name, path, headers, body in cases:
                async with (
                    asyncio.timeout(15),
                    session.post(url + path, data=body, headers=headers) as resp,
                ):
                    answers.append((name, resp.status))
            await asyncio.sleep(ctx.s(0.5))
    await task
    bad = [(n, s) for n, s in answers if not 400 <= s < 500]
    ctx.criterion(
        "every poison request refused with a 4xx",
        not bad,
        f"{len(answers)} sent; not 4xx: {bad[:4]}",
    )
    n5 = sum(1 for r in c.stats.records if r.status is not None and r.status >= 500)
    ctx.criterion("normal traffic: no 5xx", n5 == 0, f"{n5}")
    ratio = _ratio_2xx(c.stats.records)
    ctx.criterion("normal traffic: 100% answered 2xx", ratio == 1.0, _pct(ratio))
    # A poison message in a backlog queue (no x-ms-path): the syphon must set it aside and
    # go on with the rest, never deliver it anywhere.
    await _backlog_poison(ctx)


async def _backlog_poison(ctx: Ctx) -> None:
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    assert ctx.stack.broker is not None
    queue = ctx.stack.backlog_queues()[0]
    ids = [f"{ctx.run_dir.name}-backlog-poison-{i}" for i in range(3)]
    ctx.injected.update(ids)
    cs = ctx.stack.broker.connection_string(SECONDARY)
    async with asyncio.timeout(30), ServiceBusClient.from_connection_string(cs) as sb:
        async with sb.get_queue_sender(queue) as sender:
            await sender.send_messages(
                [ServiceBusMessage(b"poison", message_id=mid) for mid in ids]
            )
    ctx.note(f"injected {len(ids)} messages without x-ms-path into {queue}")
    ctx.post_checks.append(lambda c, delivered, v: _poison_set_aside(c, delivered, ids))
    ctx.expect_backlog_drained = True


def _poison_set_aside(ctx: Ctx, delivered: list[dict[str, Any]], ids: list[str]) -> None:
    where = {r["message_id"]: r for r in delivered if r["message_id"] in set(ids)}
    misplaced = [m for m in ids if m in where and not (in_backlog(where[m]) and is_dlq(where[m]))]
    if not ctx.has_syphon:
        ctx.criterion("poison backlog message set aside in the backlog's DLQ", None, "pending")
        return
    ctx.criterion(
        "poison backlog message set aside in the backlog's dead-letter queue",
        not misplaced and len(where) == len(ids),
        f"{len(where)}/{len(ids)} found; misplaced {misplaced[:3]}",
    )


async def slowloris(ctx: Ctx) -> None:
    """1,000 slow clients (headers trickling in) next to normal load."""
    n_slow = max(50, int(1000 * min(1.0, ctx.scale * 2)))
    c = ctx.client(_profile())
    task = ctx.start(c.run(duration=ctx.s(25)))
    await ctx.at(ctx.s(3))
    stop = asyncio.Event()
    opened = [0]
    cut = [0]

    async def slow(url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        try:
            async with asyncio.timeout(5):
                _, w = await asyncio.open_connection(host, int(port))
        except (OSError, TimeoutError):
            return
        opened[0] += 1
        try:
            w.write(b"POST /queues/orders/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n")
            async with asyncio.timeout(5):
                await w.drain()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        await stop.wait()
                if stop.is_set():
                    break
                w.write(b"X-Slow: a\r\n")
                async with asyncio.timeout(5):
                    await w.drain()
        except (OSError, ConnectionError, TimeoutError):
            cut[0] += 1
        finally:
            w.close()

    urls = ctx.stack.urls
    async with asyncio.TaskGroup() as tg:
        for i in range(n_slow):
            tg.create_task(slow(urls[i % len(urls)]))
        await ctx.at(ctx.s(25))
        stop.set()
    await task
    ctx.note(f"{opened[0]} slow connections opened, {cut[0]} cut by the server")
    ctx.criterion(
        f"{n_slow} slow clients connected", opened[0] >= 0.9 * n_slow, f"{opened[0]} opened"
    )
    recs = c.stats.records
    n5 = sum(1 for r in recs if r.status is not None and r.status >= 500)
    ratio = _ratio_2xx(recs)
    ctx.criterion("normal load: no 5xx", n5 == 0, f"{n5}")
    ctx.criterion("normal load: >= 99% answered 2xx", ratio >= 0.99, _pct(ratio))
    lat = sorted((r.end - r.start) * 1000 for r in recs if r.outcome == "acked")
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
    ctx.criterion("normal load: p99 < 2 s", p99 < 2000, f"p99 {p99:.0f} ms")


SYPHON_REPLICAS = StackOptions(syphon="replicas")

SCENARIOS: list[Scenario] = [
    Scenario("baseline", "Baseline: steady load, no fault", baseline),
    Scenario("replica-kill", "kill -9 one replica mid-load", replica_kill),
    Scenario(
        "replica-sigterm",
        "SIGTERM one replica mid-load",
        replica_sigterm,
        # Readiness must be seen failing before the listener closes: the drain delay plays
        # the endpoint-propagation time (Kubernetes' default setting here is 5 s).
        StackOptions(drain_delay=3.0),
    ),
    Scenario(
        "primary-outage",
        "Primary down ~30 s, then back",
        primary_outage,
        SYPHON_REPLICAS,
        needs_syphon=True,
    ),
    Scenario(
        "broker-stall",
        "Every replica's primary connection stalled ~12 s (TCP proxy)",
        broker_stall,
        StackOptions(syphon="replicas", proxy_broker=True),
        needs_syphon=True,
    ),
    Scenario("total-outage", "Primary and every backlog down", total_outage),
    Scenario("redis-blackhole", "Redis blackholed ~30 s", redis_blackhole),
    Scenario(
        "redis-restart-empty",
        "Redis restarted empty mid-failover",
        redis_restart_empty,
        SYPHON_REPLICAS,
        needs_syphon=True,
    ),
    Scenario(
        "redis-partition",
        "One replica cut off from Redis while the primary fails",
        redis_partition,
        SYPHON_REPLICAS,
        needs_syphon=True,
    ),
    Scenario(
        "syphon-kill",
        "Syphon killed between send and complete, repeatedly",
        syphon_kill,
        StackOptions(syphon="off"),
        needs_syphon=True,
    ),
    Scenario(
        "ttl-outage",
        "TTL shorter than the outage",
        ttl_shorter_than_outage,
        SYPHON_REPLICAS,
        needs_syphon=True,
    ),
    Scenario(
        "poison",
        "Poison requests (and a poison backlog message) among normal ones",
        poison,
        SYPHON_REPLICAS,
        needs_syphon=True,
    ),
    Scenario("slowloris", "1,000 slow clients next to normal load", slowloris),
]


def by_name(names: list[str] | None) -> list[Scenario]:
    if not names:
        return list(SCENARIOS)
    table = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]


async def run_scenario(
    scn: Scenario,
    out_dir: Path,
    *,
    scale: float = 1.0,
    max_rate: float | None = None,
    keep_logs: bool = True,
) -> ScenarioResult:
    """Start a stack, run `scn`, drain and check, tear down. Never raises for a failed
    criterion (it is in the result); raises only if the stack cannot start.

    `scale` multiplies the scenario's durations; `max_rate` caps every client's request
    rate (the CI version keeps to a few thousand messages)."""
    run_dir = out_dir / scn.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    has_syphon = syphon_available()
    stack = Stack(scn.options, run_dir)
    await stack.start()
    ctx = Ctx(stack, run_dir, scale)
    ctx.has_syphon = has_syphon
    ctx.max_rate = max_rate
    error: BaseException | None = None
    try:
        if scn.needs_syphon and not has_syphon:
            ctx.note("the syphon is not in this checkout: backlog criteria are pending")
        async with Endpoints(stack.urls) as ep:
            ctx.endpoints = ep
            ctx.t0 = time.monotonic()
            try:
                await scn.body(ctx)
            except Exception as exc:  # a broken scenario is a failed criterion, not a crash
                log.exception("scenario %s failed", scn.name)
                error = exc
                ctx.criterion("scenario ran to the end", False, f"{type(exc).__name__}: {exc}")
            finally:
                await ctx.cancel_tasks()
            for c in ctx.clients:
                c.acks.close()
            if ctx.expect_backlog_drained:
                if has_syphon:
                    took = await _wait_backlog_empty(ctx, within=90)
                    ctx.criterion(
                        "backlog drained after recovery",
                        took is not None,
                        f"in {took:.1f} s" if took is not None else "not within 90 s",
                    )
                else:
                    ctx.criterion("backlog drained after recovery", None, "pending: no syphon")
            for hook in ctx.after_drain:
                await hook(ctx)
        await stack.stop_gateways()
        assert stack.broker is not None
        delivered = await drain_all(stack.broker, run_dir)
        (run_dir / "delivered.jsonl").write_bytes(
            b"".join(orjson.dumps(r) + b"\n" for r in delivered)
        )
    finally:
        await stack.stop()
    verdict = check(read_acks([run_dir / "acks"]), delivered, injected=ctx.injected)
    for post in ctx.post_checks:
        post(ctx, delivered, verdict)
    dd = scn.options.duplicate_detection
    criteria = [
        Criterion("acknowledged messages", verdict.acked > 0, f"{verdict.acked}"),
        Criterion("no acknowledged message lost", verdict.lost == 0, _ex(verdict, "lost")),
        Criterion(
            "no duplicate delivered (duplicate detection on)" if dd else "duplicates (info)",
            verdict.duplicated == 0 if dd else True,
            f"{verdict.duplicated} ids, {verdict.extra_copies} extra copies "
            + _ex(verdict, "duplicated"),
        ),
        Criterion(
            "no delivery after a definite refusal",
            verdict.unexpected_violations == 0,
            _ex(verdict, "unexpected_violation"),
        ),
        Criterion("no phantom message", verdict.phantoms == 0, _ex(verdict, "phantom")),
        Criterion("nothing misrouted", verdict.misrouted == 0, _ex(verdict, "misrouted")),
        Criterion(
            "backlog shadows (info: ambiguous primary sends, deduplicated at the primary)",
            True,
            f"{verdict.backlog_shadows} " + _ex(verdict, "backlog_shadow"),
        ),
        *ctx.criteria,
    ]
    if error is not None:
        ctx.notes.append(f"error: {error!r}")
    result = ScenarioResult(
        name=scn.name,
        title=scn.title,
        verdict=verdict,
        criteria=criteria,
        duration_s=time.monotonic() - started,
        requests=sum(c.stats.requests for c in ctx.clients),
        notes=ctx.notes,
    )
    (run_dir / "result.json").write_bytes(
        orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2)
    )
    if not keep_logs:
        shutil.rmtree(run_dir / "logs", ignore_errors=True)
    return result


def _ex(v: Verdict, kind: str) -> str:
    ex = v.examples.get(kind)
    return f"e.g. {ex}" if ex else ""
