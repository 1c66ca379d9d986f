"""Session fences shared through a real redis-server by two replicas' stores: set on one,
seen by the other; lifted exactly; never raced by a write in flight; fail closed while
Redis is away; written back as unknown after Redis restarts empty; hostile values."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gateway.lifetimes import Backoff
from gateway.state import RedisStateStore
from gateway.state.connect import RedisTarget
from gateway.state.fence import FenceUnavailable
from gateway.state.redis.fences import fence_from_hash
from tests.support.processes import RedisServer
from tests.support.redis import RedisClusterServers
from tests.support.redis import redis_cluster as redis_cluster  # the fixture
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST = {"op_timeout": 0.5, "health_interval": 0.2, "reconnect_backoff": Backoff(0.05, 0.3)}
QUEUES = ["p/x-servicebus-transfer/0", "p/x-servicebus-transfer/1"]
E, S = "orders", "s1"


@asynccontextmanager
async def two(
    server: RedisServer, target: RedisTarget | None = None, op_timeout: float | None = None
) -> AsyncIterator[tuple[RedisStateStore, RedisStateStore]]:
    where = target or RedisTarget(server.client_url)
    opts = {**FAST, **({} if op_timeout is None else {"op_timeout": op_timeout})}
    stores = [RedisStateStore(where, f"r{i}", **opts) for i in (0, 1)]  # type: ignore[arg-type]
    await asyncio.gather(*(s.start() for s in stores))
    await eventually(lambda: all(s.connected for s in stores), what="both connected")
    try:
        yield stores[0], stores[1]
    finally:
        async with asyncio.timeout(10):
            await asyncio.gather(*(s.close() for s in stores))


async def write(store: RedisStateStore, wid: str, tokens: list[str], ok: bool = True) -> str:
    got = await store.fences.begin_write(E, S, wid, QUEUES, (), deadline=time_in(30))
    assert got is not None
    await store.fences.end_write(E, S, wid, tokens, ok)
    return got[0]


def time_in(seconds: float) -> float:
    return time.time() + seconds


async def test_a_fence_set_on_one_replica_is_seen_on_the_other_and_lifts_exactly(
    redis_server: RedisServer,
):
    async with two(redis_server) as (a, b):
        queue = await write(a, "w1", ["t1", "t2"])
        assert a.fences.fenced(E, S)
        await eventually(lambda: b.fences.fenced(E, S), what="b learns the fence")
        # b's write goes to the same queue: the fence chose it for the whole cluster.
        assert await write(b, "w2", ["t3"]) == queue
        assert await b.fences.movable(E, S, queue, ["t1", "t2", "t3"]) == 3
        assert await b.fences.movable(E, S, queue, ["t3"]) == 0, "t1 is held elsewhere"
        await b.fences.moved(E, S, ["t1", "t2"])
        assert a.fences.fenced(E, S) and b.fences.fenced(E, S)
        await b.fences.moved(E, S, ["t3"])
        assert not b.fences.fenced(E, S)
        await eventually(lambda: not a.fences.fenced(E, S), what="a learns the lift")


async def test_a_write_in_flight_on_another_replica_holds_the_lift(redis_server: RedisServer):
    async with two(redis_server) as (a, b):
        await write(a, "w1", ["t1"])
        assert await b.fences.begin_write(E, S, "w2", QUEUES, (), deadline=time_in(30))
        await a.fences.moved(E, S, ["t1"])  # the syphon moved all it knows of
        assert a.fences.fenced(E, S), "w2 is in flight: lifting would let it be overtaken"
        await b.fences.end_write(E, S, "w2", ["t2"], ok=True)
        await a.fences.moved(E, S, ["t2"])
        await eventually(lambda: not b.fences.fenced(E, S), what="lifted")


async def test_while_redis_is_away_a_fenced_write_fails_closed(redis_server: RedisServer):
    async with two(redis_server) as (a, _):
        redis_server.kill()
        await eventually(lambda: not a.connected, what="a sees redis gone")
        with pytest.raises(FenceUnavailable):
            await a.fences.begin_write(E, S, "w1", QUEUES, (), deadline=time_in(30))


async def test_redis_restarted_empty_gets_the_fence_back_as_unknown(redis_server: RedisServer):
    async with two(redis_server) as (a, b):
        await write(a, "w1", ["t1"])
        await eventually(lambda: b.fences.fenced(E, S), what="b learns the fence")
        redis_server.restart(empty=True)
        await eventually(
            lambda: all(r.connected and r.stats.reconnects for r in (a, b)),
            within=15,
            what="both reconnected and resynced",
        )
        assert a.fences.fenced(E, S) and b.fences.fenced(E, S), "S must not jump the queue"
        await a.fences.moved(E, S, ["t1"])
        assert a.fences.fenced(E, S), "unknown: only an empty backlog lifts it"
        await a.fences.backlog_empty([E])
        await eventually(lambda: not b.fences.fenced(E, S), what="lifted everywhere")


async def test_a_replica_that_starts_reads_the_fences(redis_server: RedisServer):
    async with two(redis_server) as (a, _):
        await write(a, "w1", ["t1"])
        late = RedisStateStore(RedisTarget(redis_server.client_url), "late", **FAST)  # type: ignore[arg-type]
        await late.start()
        try:
            await eventually(lambda: late.connected, what="late connected")
            assert late.fences.fenced(E, S)
        finally:
            await late.close()


def test_hostile_fence_values_hold_the_fence():
    assert fence_from_hash({"since": "nan", "t:x": "1 1"}).unknown
    assert fence_from_hash({"since": "1", "t:x": "one"}).unknown
    ok = fence_from_hash({"since": "1", "gen": "1", "q:1": "q", "t:x": "1 1"})
    assert not ok.unknown and ok.tokens == {"x": (1, 1)}
    assert fence_from_hash({"since": "1", "u": "1"}).outstanding(2.0)


def test_a_replica_that_never_reached_redis_takes_every_session_to_be_fenced():
    store = RedisStateStore(RedisTarget("redis://127.0.0.1:1"), "cold", **FAST)  # type: ignore[arg-type]
    assert store.fences.fenced(E, "any session"), "fail closed until the first resync"


async def test_fences_work_on_a_redis_cluster(redis_cluster: RedisClusterServers) -> None:
    """One slot (the hash tag), sharded pub/sub: set on one replica, lifted on the other."""
    target = RedisTarget(redis_cluster.url, mode="cluster")
    async with two(redis_cluster.nodes[0], target) as (a, b):
        await write(a, "w1", ["t1"])
        await eventually(lambda: b.fences.fenced(E, S), what="b learns the fence")
        await b.fences.moved(E, S, ["t1"])
        await eventually(lambda: not a.fences.fenced(E, S), what="a learns the lift")


async def test_an_end_that_runs_twice_counts_its_tokens_once(redis_server: RedisServer):
    """An end whose answer was lost (a timeout after the script ran) is replayed and runs
    again: it must not count its tokens a second time, or a message already home would hold
    the fence for ever (found by bench.session_bench: sessions fenced with nothing left)."""
    async with two(redis_server) as (a, b):
        await write(a, "w1", ["t1"])
        assert await b.fences.begin_write(E, S, "w2", QUEUES, (), deadline=time_in(30))
        await b.fences.moved(E, S, ["t1"])
        await a.fences.end_write(E, S, "w1", ["t1"], True)  # the same end, run again
        await b.fences.end_write(E, S, "w2", ["t2"], True)
        await b.fences.moved(E, S, ["t2"])
        assert not b.fences.fenced(E, S), "t1 is home: nothing holds the fence"


async def test_a_fence_held_only_by_an_expired_write_lifts_on_an_empty_backlog(
    redis_server: RedisServer,
):
    async with two(redis_server) as (a, b):
        assert await a.fences.begin_write(E, S, "w1", QUEUES, (), deadline=time_in(0.5))
        await write(b, "w2", ["t2"])
        await b.fences.moved(E, S, ["t2"])
        assert b.fences.fenced(E, S), "w1 may still land"

        async def lifted() -> bool:
            await b.fences.backlog_empty([E])  # what the syphon's depth check calls
            return not b.fences.fenced(E, S)

        await eventually(lifted, within=10, every=0.2, what="the fence lifts")
        await eventually(lambda: not a.fences.fenced(E, S), what="a learns the lift")


async def test_many_session_writes_at_once_do_not_exhaust_the_redis_connections(
    redis_server: RedisServer,
):
    """150 sessions' backlog writes at once (a failover under load): each fence call takes
    a connection of the client's pool (100); past that the client raised, which broke the
    state session and answered every session's write 503 until it was back
    (bench.session_bench: 6,340 of 10,000 answered 503). A generous op_timeout: what is
    tested is the pool, not how fast a loaded machine runs 150 scripts."""
    async with two(redis_server, op_timeout=10.0) as (a, _):

        async def one(i: int) -> tuple[str, int] | None:
            return await a.fences.begin_write(E, f"s{i}", f"w{i}", QUEUES, (), time_in(30))

        got = await asyncio.gather(*(one(i) for i in range(150)), return_exceptions=True)
        assert all(isinstance(g, tuple) for g in got), [g for g in got if not isinstance(g, tuple)][
            :3
        ]
        assert a.connected


async def test_a_fence_redis_lost_is_rebuilt_once_in_the_backlogs_order(
    redis_server: RedisServer,
):
    """After Redis restarts empty, the fence comes back unknown: nothing of S moves until a
    syphon rebuilds it from what the backlog holds (the older messages first, in the order
    given), once, whichever replica gets there first."""
    qa, qb = QUEUES
    async with two(redis_server) as (a, b):
        await write(a, "w1", ["old0"])
        redis_server.restart(empty=True)
        await eventually(
            lambda: all(r.connected and r.stats.reconnects for r in (a, b)),
            within=15,
            what="both reconnected and resynced",
        )
        assert await a.fences.unknown(E, S)
        assert await write(b, "w2", ["new"]) == qa  # counted exactly, generation 1
        assert await a.fences.movable(E, S, qa, ["old0", "new"]) == 0, "unknown"
        await a.fences.moved(E, S, ["gone"])  # a move from before the restart, replayed
        old = [("old0", qa), ("old1", qb), ("gone", qb), ("new", qa)]
        await a.fences.rebuild(E, S, old)
        assert not await b.fences.unknown(E, S)
        await b.fences.rebuild(E, S, [("x", qb)])  # too late: a known fence is left alone
        assert await b.fences.movable(E, S, qb, ["old1", "x"]) == 0, "old0 first"
        assert await b.fences.movable(E, S, qa, ["old0", "new"]) == 1
        await b.fences.moved(E, S, ["old0"])
        assert await b.fences.movable(E, S, qb, ["old1", "x"]) == 2
        await b.fences.moved(E, S, ["old1"])
        assert await b.fences.movable(E, S, qa, ["new"]) == 1
        await b.fences.moved(E, S, ["new"])
        await eventually(lambda: not a.fences.fenced(E, S), what="lifted everywhere")


async def test_redis_that_lost_its_data_under_a_live_connection_is_never_read_as_no_fence(
    redis_server: RedisServer,
):
    """Redis can lose its dataset while a replica's connection lives on (a restart the
    connection pool reconnects through before the subscriber notices, a failover to an empty
    replica behind a proxy, a FLUSHALL). A fence missing then is lost, not lifted: S's
    messages held by one receiver must not move while S's oldest is held by another, and a
    write must not start a fresh fence that would shadow the lost one."""
    async with two(redis_server) as (a, b):
        queue = await write(a, "w1", ["t1", "t2"])
        await eventually(lambda: b.fences.fenced(E, S), what="b learns the fence")
        assert await b.fences.movable(E, S, queue, ["t2"]) == 0, "t1 is held elsewhere"
        redis_server.command("FLUSHALL")  # the connections stay up
        assert await b.fences.movable(E, S, queue, ["t2"]) == 0, "a lost fence is no lift"
        with pytest.raises(FenceUnavailable):
            await a.fences.begin_write(E, S, "w2", QUEUES, (), deadline=time_in(30))
        # Both replicas notice, resync and write the fence back as unknown.
        await eventually(
            lambda: all(r.connected and r.stats.reconnects for r in (a, b)),
            within=15,
            what="both resynced",
        )
        assert await a.fences.unknown(E, S) and b.fences.fenced(E, S)
        assert await b.fences.movable(E, S, queue, ["t1", "t2"]) == 0, "unknown: rebuild first"
