"""Hostile traffic next to normal load: poison requests and backlog messages, slow clients."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson

from loadtests.checker import in_backlog, is_dlq
from loadtests.scenarios.framework import Ctx, five_xx, pct, profile, ratio_2xx
from loadtests.stack import SECONDARY


async def poison(ctx: Ctx) -> None:
    """Malformed and oversized requests among normal load: each refused with a 4xx, the
    normal traffic untouched (no 5xx, all acknowledged)."""
    c = ctx.client(profile())
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
    n5, what = five_xx(c.stats.records)
    ctx.criterion("normal traffic: no 5xx", n5 == 0, what)
    ratio = ratio_2xx(c.stats.records)
    ctx.criterion("normal traffic: 100% answered 2xx", ratio == 1.0, pct(ratio))
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
    ctx.criterion(
        "poison backlog message set aside in the backlog's dead-letter queue",
        not misplaced and len(where) == len(ids),
        f"{len(where)}/{len(ids)} found; misplaced {misplaced[:3]}",
    )


async def slowloris(ctx: Ctx) -> None:
    """1,000 slow clients (headers trickling in) next to normal load."""
    n_slow = max(50, int(1000 * min(1.0, ctx.scale * 2)))
    c = ctx.client(profile())
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
    n5, what = five_xx(recs)
    ratio = ratio_2xx(recs)
    ctx.criterion("normal load: no 5xx", n5 == 0, what)
    ctx.criterion("normal load: >= 99% answered 2xx", ratio >= 0.99, pct(ratio), timed=True)
    lat = sorted((r.end - r.start) * 1000 for r in recs if r.outcome == "acked")
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
    ctx.criterion("normal load: p99 < 2 s", p99 < 2000, f"p99 {p99:.0f} ms", timed=True)
