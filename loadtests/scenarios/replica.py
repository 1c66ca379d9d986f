"""Replica and process faults: a steady baseline, a replica killed or stopped mid-load, the
syphon killed between send and complete."""

from __future__ import annotations

import asyncio
import random
import time

from gateway.errors import Overloaded
from loadtests.harness import backlog_depth
from loadtests.scenarios.framework import Ctx, acked_fraction, five_xx, pct, profile
from loadtests.stack import PRIMARY


async def baseline(ctx: Ctx) -> None:
    """Steady load, no fault: everything to the primary, no 5xx. A ``503 overloaded`` is
    the gateway shedding a request whose head waited for a loop that was behind (a host that
    stalled the process): a timed criterion, as a busy machine can miss it; any other 5xx
    is a fault of the gateway's."""
    c = ctx.client(profile(concurrency=16))
    await c.run(duration=ctx.s(30))
    recs = c.stats.records
    n5, what = five_xx([r for r in recs if r.error != Overloaded.code])
    ctx.criterion("no 5xx", n5 == 0, what)
    shed, what = five_xx([r for r in recs if r.error == Overloaded.code])
    ctx.criterion("nothing shed as overloaded", shed == 0, what, timed=True)
    routes = {r.route for r in recs if r.outcome == "acked"}
    ctx.criterion("every message to the primary", routes <= {"primary"}, f"routes {routes}")


async def replica_kill(ctx: Ctx) -> None:
    """SIGKILL one replica mid-load; clients retry the same ids on the other."""
    c = ctx.client(profile())
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
    acked_ids, all_ids = acked_fraction(ctx)
    ratio = acked_ids / max(1, all_ids)
    ctx.criterion(
        "every request eventually acknowledged (retry on the other replica)",
        ratio >= 0.999,
        f"{acked_ids}/{all_ids} ids acked ({pct(ratio)}); {len(first)} requests",
    )


async def replica_sigterm(ctx: Ctx) -> None:
    """SIGTERM one replica mid-load: readiness drops, in-flight requests finish, exit 0."""
    c = ctx.client(profile())
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
    acked_ids, all_ids = acked_fraction(ctx)
    ctx.criterion(
        "every request eventually acknowledged",
        acked_ids == all_ids,
        f"{acked_ids}/{all_ids} ids acked",
    )


async def syphon_kill(ctx: Ctx) -> None:
    """Fill the backlog during an outage, then SIGKILL the syphon process again and again
    while it moves messages home: every message arrives, once (duplicate detection)."""
    c = ctx.client(profile())
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
