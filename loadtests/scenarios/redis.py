"""Redis faults: blackholed, restarted empty mid-failover, one replica cut off."""

from __future__ import annotations

import asyncio
import time

from loadtests.scenarios.framework import Ctx, StateWatcher, five_xx, pct, profile, ratio_2xx
from loadtests.stack import PRIMARY


async def redis_blackhole(ctx: Ctx) -> None:
    """Redis blackholed for ~30 s (connections hang): no 5xx, replicas stay ready."""
    c = ctx.client(profile())
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
    n5, what = five_xx(c.stats.records)
    ctx.criterion("no 5xx while Redis is blackholed", n5 == 0, what)
    ctx.criterion("replicas stay ready", not_ready == 0, f"{not_ready} polls saw a replica unready")


async def redis_restart_empty(ctx: Ctx) -> None:
    """Redis restarted empty while the primary is failed over: no flapping."""
    c = ctx.client(profile())
    async with StateWatcher(ctx.stack) as watch:
        task = ctx.start(c.run(duration=ctx.s(40)))
        await ctx.at(ctx.s(4))
        await ctx.stack.control.down(PRIMARY)
        t_over = await watch.wait_all("failed_over", within=20)
        ctx.note(f"failed over at {ctx.elapsed():.1f} s")
        w_start = time.monotonic()
        assert ctx.stack.redis is not None, "a Redis scenario runs with Redis"
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
    ratio = ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, pct(ratio), timed=True)
    ctx.expect_backlog_drained = True


async def redis_partition(ctx: Ctx) -> None:
    """One replica cut off from Redis while the primary fails: it keeps answering on its own
    local state machine; both come back to the primary after recovery."""
    c = ctx.client(profile())
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
        ctx.criterion(
            f"gw{i}: >= 99% answered 2xx", ratio >= 0.99, f"{pct(ratio)} of {len(recs)}", timed=True
        )
    n5, what = five_xx(c.stats.records)
    ctx.criterion("no 5xx", n5 == 0, what)
    ctx.expect_backlog_drained = True
