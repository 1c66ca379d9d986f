"""Service Bus faults: the primary down or stalled, both namespaces down, a TTL shorter than
the outage."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import aiohttp
import orjson

from loadtests.acks import AckWriter, read_acks
from loadtests.checker import in_backlog, is_dlq
from loadtests.client import LoadClient, LoadProfile
from loadtests.scenarios.framework import (
    ENTITIES,
    Ctx,
    StateWatcher,
    five_xx,
    other_statuses,
    pct,
    profile,
    ratio_2xx,
)
from loadtests.stack import PRIMARY, SECONDARY


async def primary_outage(ctx: Ctx) -> None:
    """The primary namespace down ~30 s, then back: clients keep getting 2xx (backlog),
    every replica fails over within interval + 1 s, the backlog is drained after recovery."""
    interval = ctx.stack.options.failover_interval
    c = ctx.client(profile())
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
            timed=True,
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
    ratio = ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, pct(ratio), timed=True)
    backlogged = sum(r.messages for r in c.stats.records if r.route == "backlog")
    ctx.note(f"{backlogged} messages acknowledged from the backlog")
    ctx.criterion("messages were backlogged", backlogged > 0, f"{backlogged}")
    ctx.expect_backlog_drained = True


async def broker_stall(ctx: Ctx) -> None:
    """Every replica's connection to the primary stalls (the fault proxy holds the bytes) for
    ~12 s, then flows again: sends hang until the gateway's deadline, the gateway fails over;
    after the heal the held transfers reach the broker late (stored although the gateway saw
    a timeout: backlog shadows, which duplicate detection must absorb)."""
    c = ctx.client(profile())
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
    ratio = ratio_2xx(c.stats.records)
    ctx.criterion(">= 99% of requests answered 2xx", ratio >= 0.99, pct(ratio), timed=True)
    ctx.note(five_xx(c.stats.records)[1])
    ctx.expect_backlog_drained = True


async def total_outage(ctx: Ctx) -> None:
    """The primary and every backlog queue down: 100% 503, zero 2xx, memory flat."""
    send_timeout = ctx.stack.options.send_timeout
    c = ctx.client(profile(retry=False, concurrency=16))
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
        f"{n503}/{len(window)} (others: {other_statuses(window)})",
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


async def ttl_shorter_than_outage(ctx: Ctx) -> None:
    """Messages with a TTL shorter than the outage: the ones that outlive it in the backlog
    are dead-lettered there (TTLExpiredException), never delivered late; nothing is lost."""
    ttl = 5.0
    outage = max(ttl * 3, ctx.s(15))
    c = ctx.client(profile(ttl=ttl))
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
