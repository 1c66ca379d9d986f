"""The chaos framework: a scenario starts its own stack (2 gateway replicas), drives load
and one kind of fault, then drains everything and checks it. Every scenario has the same
baseline criteria (nothing acknowledged lost, no duplicate delivered with duplicate detection
on, no delivery after a definite "not stored", no phantom, nothing misrouted) plus its own.

Durations scale with ``scale`` (1.0 = the full suite; the CI tests use ~0.3). Nothing
sleeps to wait for a condition: waits poll with deadlines; the sleeps left are the *shape*
of the scenario (how long a fault lasts). The scenarios themselves live in one module per
fault family: `replica`, `namespace`, `redis`, `messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from loadtests.acks import AckWriter, read_acks
from loadtests.checker import Verdict, check
from loadtests.client import Endpoints, LoadClient, LoadProfile, LoadStats
from loadtests.harness import backlog_depth, drain_all
from loadtests.stack import Stack, StackOptions

log = logging.getLogger(__name__)
_T = TypeVar("_T")

ENTITIES = ("orders", "payments", "events")


@dataclass
class Criterion:
    name: str
    ok: bool
    detail: str = ""
    # A bound on time or on the share answered within clients' timeouts: it holds on an idle
    # machine and is what `python -m loadtests chaos` reports, but a loaded machine can miss
    # it, so the test suite (which never asserts timing) checks only the others.
    timed: bool = False


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
        return all(c.ok for c in self.criteria)

    @property
    def correct(self) -> bool:
        """Every criterion but the timed ones: nothing lost, misrouted or duplicated, ..."""
        return all(c.ok for c in self.criteria if not c.timed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "title": self.title,
            "passed": self.passed,
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

    def criterion(self, name: str, ok: bool, detail: str = "", *, timed: bool = False) -> None:
        self.criteria.append(Criterion(name, ok, detail, timed))

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


SYPHON_REPLICAS = StackOptions(syphon="replicas")


# -- helpers for scenario bodies ------------------------------------------------------------


def profile(**kw: Any) -> LoadProfile:
    base: dict[str, Any] = {"concurrency": 12}
    base.update(kw)
    return LoadProfile(**base)


def ratio_2xx(records: list[Any]) -> float:
    answered = [r for r in records if r.attempt == 0]
    if not answered:
        return 1.0
    return sum(1 for r in answered if r.outcome == "acked") / len(answered)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


async def wait_backlog_empty(ctx: Ctx, within: float) -> float | None:
    """Seconds until no message waits in any backlog queue; None on timeout."""
    assert ctx.stack.broker is not None
    start = time.monotonic()
    while time.monotonic() - start < within:
        if await backlog_depth(ctx.stack.broker) == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.25)
    return None


def acked_fraction(ctx: Ctx) -> tuple[int, int]:
    acked: set[str] = set()
    every: set[str] = set()
    for a in read_acks([ctx.run_dir / "acks"]):
        every.add(a.message_id)
        if a.outcome == "acked":
            acked.add(a.message_id)
    return len(acked), len(every)


def five_xx(records: list[Any]) -> tuple[int, str]:
    """The attempts answered 5xx, and what they were, by status and error code: (3,
    "3 answers >= 500 (503 overloaded x2, 500 internal_error x1)"), or (0, "none")."""
    kinds: dict[str, int] = {}
    for r in records:
        if r.status is not None and r.status >= 500:
            key = f"{r.status} {r.error or '-'}"
            kinds[key] = kinds.get(key, 0) + 1
    n = sum(kinds.values())
    if not n:
        return 0, "none"
    listed = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return n, f"{n} answers >= 500 ({listed})"


def other_statuses(records: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.status != 503:
            key = str(r.status) if r.status is not None else str(r.error)
            out[key] = out.get(key, 0) + 1
    return out


# -- running one --------------------------------------------------------------------------


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
    rate (the CI version keeps to a few thousand messages). Without `keep_logs` the
    processes' logs are removed after a run that met every criterion, and kept after one
    that did not (what the gateways logged is how a failure is read)."""
    run_dir = out_dir / scn.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    stack = Stack(scn.options, run_dir)
    await stack.start()
    ctx = Ctx(stack, run_dir, scale)
    ctx.max_rate = max_rate
    error: BaseException | None = None
    try:
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
                took = await wait_backlog_empty(ctx, within=90)
                ctx.criterion(
                    "backlog drained after recovery",
                    took is not None,
                    f"in {took:.1f} s" if took is not None else "not within 90 s",
                )
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
    if not keep_logs and result.passed:
        shutil.rmtree(run_dir / "logs", ignore_errors=True)
    return result


def _ex(v: Verdict, kind: str) -> str:
    ex = v.examples.get(kind)
    return f"e.g. {ex}" if ex else ""
