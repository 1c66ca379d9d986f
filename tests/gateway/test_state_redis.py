"""RedisStateStore against real redis-server processes: 2-3 stores (replicas) on one server.

Faults are real: SIGKILL, SIGSTOP/SIGCONT, a restart on the same port, a cut TCP link.
Nothing sleeps to wait for a condition: tests await listener events or poll with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis, RedisCluster

from gateway.lifetimes import Backoff
from gateway.state import BacklogState, EntityState, RedisStateStore, StateStore
from gateway.state.connect import Client, RedisTarget
from gateway.state.redis.values import entity_from_hash
from tests.support.processes import RedisServer, free_port
from tests.support.redis import (
    STATE_TAG,
    RedisClusterServers,
    TcpProxy,
    redis_server_in,
)

# The fixture, until a conftest imports it for every test module.
from tests.support.redis import redis_cluster as redis_cluster
from tests.support.waiting import eventually, no_hang

pytestmark = pytest.mark.timeout(60)

OP_TIMEOUT = 0.5
FAST = {
    "op_timeout": OP_TIMEOUT,
    "health_interval": 0.2,
    "reconnect_backoff": Backoff(0.05, 0.3, jitter=0.25),
}


class Recorder:
    """Listener pair that records every change a store reports."""

    def __init__(self) -> None:
        self.entities: list[EntityState] = []
        self.backlogs: list[BacklogState] = []
        self.written: list[str | None] = []

    def on_entity(self, s: EntityState) -> None:
        self.entities.append(s)

    def on_backlog(self, b: BacklogState) -> None:
        self.backlogs.append(b)

    def on_write(self, queue: str | None) -> None:
        self.written.append(queue)


@pytest.fixture(params=["standalone", "cluster", "tls"])
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """Every test that takes it runs on one server, on a 3-master cluster (where it is the
    node serving the state's slot), and on one server over TLS with a private CA."""
    yield from redis_server_in(request, request.param)


def standalone(server: RedisServer, why: str) -> None:
    if server.mode != "standalone":
        pytest.skip(why)


def target(where: str | RedisServer | RedisTarget) -> RedisTarget:
    if isinstance(where, RedisTarget):
        return where
    if isinstance(where, RedisServer):
        ca = None if where.ca_file is None else str(where.ca_file)
        return RedisTarget(where.client_url, mode=where.mode, ca_file=ca)  # type: ignore[arg-type]
    return RedisTarget(where)


@asynccontextmanager
async def replicas(
    urls: str | RedisServer | RedisTarget | list[str], n: int = 3, **kw: Any
) -> AsyncIterator[tuple[list[RedisStateStore], list[Recorder]]]:
    url_list = urls if isinstance(urls, list) else [urls] * n
    opts = {**FAST, **kw}
    stores = [RedisStateStore(target(u), f"r{i}", **opts) for i, u in enumerate(url_list)]
    recs = [Recorder() for _ in stores]
    for s, r in zip(stores, recs, strict=True):
        s.subscribe(r.on_entity, r.on_backlog, r.on_write)
    await asyncio.gather(*(s.start() for s in stores))
    # `start` waits for the first attempt only: on a loaded machine it may fail (op_timeout
    # 0.5 s) and the next one connect. A test that begins with every replica connected must
    # wait for that — a store not connected yet fails open (a lease is granted to all).
    await eventually(lambda: all(s.connected for s in stores), what="every replica connected")
    try:
        yield stores, recs
    finally:
        async with asyncio.timeout(10):
            await asyncio.gather(*(s.close() for s in stores))


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Client]:
    client = target(redis_server).client(op_timeout=5, name="test")
    yield client
    await client.aclose()


async def stored(raw: Client, entity: str) -> EntityState | None:
    h = await raw.hgetall(f"{{sbgate}}:entity:{entity}")
    if not h:
        return None
    return EntityState(
        entity, h["status"], int(h["epoch"]), float(h["since"]), h["by"], h["reason"]
    )


def agree(stores: list[RedisStateStore], entity: str, want: EntityState | None = None) -> bool:
    states = {s.get(entity) for s in stores}
    return len(states) == 1 and (want is None or states == {want})


# -- basics ---------------------------------------------------------------------------------


async def test_is_a_state_store(redis_server: RedisServer) -> None:
    store: StateStore = RedisStateStore(redis_server.url, "r0")
    assert store.replica_id == "r0"
    assert not store.connected  # not started


async def test_a_proposal_reaches_every_replica_with_the_same_epoch(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, recs):
        assert all(s.connected for s in stores)
        r0 = stores[0]
        failing = r0.propose(r0.get("orders"), "failing", "timeout")
        assert failing is not None and failing.epoch == 1 and failing.by == "r0"
        await eventually(lambda: all(r.entities == [failing] for r in recs), what="listeners")
        assert all(s.get("orders") == failing for s in stores)
        assert await stored(raw, "orders") == failing

        # The next decision is made on another replica, from what it learned.
        r2 = stores[2]
        over = r2.propose(r2.get("orders"), "failed_over", "timeout")
        assert over is not None and over.epoch == 2
        await eventually(lambda: agree(stores, "orders", over))
        await eventually(lambda: all(r.entities == [failing, over] for r in recs))
        assert await stored(raw, "orders") == over
        assert sum(s.stats.write_conflicts for s in stores) == 0


async def test_concurrent_conflicting_proposals_converge_on_one_winner(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, recs):
        entities = [f"queue-{i}" for i in range(20)]
        for e in entities:
            # Same base (epoch 0) on all three, in one loop turn: a real race to Redis.
            stores[0].propose(stores[0].get(e), "failing", "timeout")
            stores[1].propose(stores[1].get(e), "failed_over", "operator")
            stores[2].propose(stores[2].get(e), "healthy", "ping")

        def last_word(r: Recorder, e: str) -> EntityState | None:
            seen = [x for x in r.entities if x.entity == e]
            return seen[-1] if seen else None

        async def converged() -> bool:
            for e in entities:
                redis_state = await stored(raw, e)
                if redis_state is None or not agree(stores, e, redis_state):
                    return False
                # Listeners run on a later loop turn than the memory change they report.
                if any(last_word(r, e) != redis_state for r in recs):
                    return False
            return True

        await eventually(converged, what="every replica holds and reported what Redis holds")
        for e in entities:
            winner = stores[0].get(e)
            assert winner.epoch == 1  # exactly one transition applied
            for r in recs:  # every replica's last word on the entity is the winner
                assert last_word(r, e) == winner
        # Exactly one transition per entity reached Redis; each loser either lost the CAS or
        # heard the winner first (and dropped its own pending write).
        assert sum(s.stats.writes for s in stores) == len(entities)
        assert sum(s.stats.write_conflicts for s in stores) <= 2 * len(entities)


async def test_a_stale_proposal_and_a_stale_event_are_ignored(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server, n=2) as (stores, recs):
        r0, r1 = stores
        one = r0.propose(r0.get("orders"), "failing", "timeout")
        assert one is not None
        two = r0.propose(one, "failed_over", "timeout")
        assert two is not None
        await eventually(lambda: agree(stores, "orders", two))
        assert r1.propose(one, "healthy", "ping") is None  # built on epoch 1: stale

        # A late event (epoch 1) published after epoch 2, then a marker to know it was read.
        late = {"kind": "entity", "entity": "orders", "status": "healthy", "epoch": 1}
        late |= {"since": 1.0, "by": "ghost", "reason": "late"}
        publish = "SPUBLISH" if redis_server.mode == "cluster" else "PUBLISH"
        await raw.execute_command(publish, "{sbgate}:events", orjson.dumps(late))
        marker = r0.propose(r0.get("marker"), "failing", "timeout")
        await eventually(lambda: r1.get("marker") == marker)
        assert r1.get("orders") == two
        assert r1.stats.events_stale >= 1
        assert all(x.by != "ghost" for r in recs for x in r.entities)


async def test_coalesced_writes_end_with_the_newest_state(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server, n=2) as (stores, _):
        r0, r1 = stores
        state = r0.get("orders")
        for i in range(50):
            nxt = r0.propose(state, "failing" if i % 2 == 0 else "healthy", f"step-{i}")
            assert nxt is not None
            state = nxt
        await eventually(lambda: r1.get("orders") == state)
        assert await stored(raw, "orders") == state
        assert state.epoch == 50
        assert r0.stats.writes < 50  # coalesced: only the newest pending state is written
        assert r0.stats.write_conflicts == 0


async def test_a_full_write_queue_falls_back_to_a_resync(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server, n=2, max_pending=2) as (stores, _):
        r0, r1 = stores
        made = [r0.propose(r0.get(f"e{i}"), "failing", "timeout") for i in range(6)]
        assert r0.stats.writes_dropped >= 1
        await eventually(lambda: all(r1.get(m.entity) == m for m in made if m is not None))
        for m in made:
            assert m is not None and await stored(raw, m.entity) == m


async def test_a_failing_listener_does_not_stop_the_subscriber(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with replicas(redis_server, n=2) as (stores, recs):
        r0, r1 = stores

        def broken(_: EntityState) -> None:
            raise RuntimeError("listener bug")

        r1.subscribe(broken, recs[1].on_backlog)
        with caplog.at_level(logging.ERROR):
            a = r0.propose(r0.get("a"), "failing", "timeout")
            await eventually(lambda: r1.get("a") == a)
            b = r0.propose(r0.get("b"), "failing", "timeout")
            await eventually(lambda: r1.get("b") == b and recs[1].entities[-1:] == [b])
        assert "listener bug" in caplog.text
        assert r1.connected


# -- backlogs -------------------------------------------------------------------------------


async def test_a_backlog_disable_is_seen_everywhere_and_expires(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, recs):
        queue = "contoso/x-servicebus-transfer/4"
        until = time.time() + 0.8
        stores[1].disable_backlog(queue, until, "send failed")
        await eventually(lambda: all(s.backlogs_disabled(time.time()) == {queue} for s in stores))
        want = BacklogState(queue, until, "r1", "send failed")
        await eventually(lambda: all(r.backlogs == [want] for r in recs))
        ttl = await raw.pttl(f"{{sbgate}}:backlog:{queue}")
        assert 0 < ttl <= 800
        # Expiry: Redis drops the key, and memory stops reporting it, with no event needed.
        await eventually(lambda: all(not s.backlogs_disabled(time.time()) for s in stores))

        async def gone() -> bool:
            return await raw.exists(f"{{sbgate}}:backlog:{queue}") == 0

        await eventually(gone)


async def test_enabling_a_backlog_puts_it_back_everywhere(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, _):
        far = time.time() + 300
        stores[0].disable_backlog("q1", far, "send failed")
        stores[2].disable_backlog("q1", far - 100, "shorter")  # the later until wins
        await eventually(lambda: all(s.backlogs_disabled(time.time()) == {"q1"} for s in stores))
        await eventually(lambda: all(s.backlog_states()["q1"].until == far for s in stores))
        stores[1].enable_backlog("q1")
        await eventually(lambda: all(not s.backlogs_disabled(time.time()) for s in stores))
        assert await raw.exists("{sbgate}:backlog:q1") == 0


# -- leases ---------------------------------------------------------------------------------


# -- backlog-write announcements ------------------------------------------------------------


async def test_a_backlog_write_announcement_reaches_every_syphon_once(
    redis_server: RedisServer,
) -> None:
    async with replicas(redis_server) as (stores, recs):
        await eventually(lambda: all(r.written == [None] for r in recs), what="connected")
        stores[0].announce_backlog_write("p/x-servicebus-transfer/1")
        stores[1].announce_backlog_write(None)  # a replica that starts: every queue
        want = sorted(["p/x-servicebus-transfer/1", None], key=str)
        await eventually(lambda: all(sorted(r.written[1:], key=str) == want for r in recs))
        assert recs[0].written.count("p/x-servicebus-transfer/1") == 1, "heard once, not twice"


async def test_an_announcement_made_while_redis_is_down_is_covered_once_it_returns(
    redis_server: RedisServer,
) -> None:
    async with replicas(redis_server, n=2) as (stores, recs):
        await eventually(lambda: all(r.written == [None] for r in recs), what="connected")
        redis_server.kill()
        await eventually(lambda: not any(s.connected for s in stores), what="disconnected")
        stores[0].announce_backlog_write("q/1")
        assert recs[1].written == [None], "nobody else can hear it now"
        redis_server.restart(empty=True)
        # The writer publishes it once it is back; the other replica hears it if it is
        # subscribed by then, and in any case hears None when it reconnects — after the
        # announcement was made, so its syphon looks at every queue, "q/1" included.
        await eventually(lambda: recs[1].written.count(None) >= 2, what="other reconnected")
        await eventually(lambda: not stores[0]._pending_writes, what="writer published it")
        await eventually(lambda: all(s.connected for s in stores))
        stores[0].announce_backlog_write("q/2")  # both subscribed now: heard by name
        await eventually(lambda: "q/2" in recs[1].written)


async def test_redis_that_loses_its_data_under_live_connections_gets_the_state_back(
    redis_server: RedisServer,
) -> None:
    """A FLUSHALL keeps every connection up, so nothing breaks a session: the dataset mark
    does. Each replica notices within a health interval, resyncs and writes its state back,
    so a replica that starts afterwards still learns of the failover."""
    async with replicas(redis_server, n=2) as (stores, _):
        made = stores[0].propose(stores[0].get("p/q"), "failing", "timeout")
        assert made is not None
        await eventually(lambda: stores[1].get("p/q") == made, what="shared")
        redis_server.command("FLUSHALL")
        await eventually(
            lambda: all(s.stats.data_losses and s.connected for s in stores), what="noticed"
        )
        async with replicas(redis_server, n=1) as ([late], _):
            assert late.get("p/q") == made


async def test_a_dataset_mark_of_another_type_is_repaired_not_fatal(
    redis_server: RedisServer,
) -> None:
    """A value at the mark's key that is not a string (hostile or damaged) fails every check
    of it: the resync that follows writes a good one, so the replicas reconnect."""
    async with replicas(redis_server, n=2) as (stores, _):
        mark = redis_server.command("GET", "{sbgate}:dataset")
        redis_server.command("DEL", "{sbgate}:dataset")
        redis_server.command("HSET", "{sbgate}:dataset", "x", "1")
        await eventually(
            lambda: all(s.stats.data_losses and s.connected for s in stores), what="repaired"
        )
        assert redis_server.command("TYPE", "{sbgate}:dataset") == b"+string"
        assert mark is not None


async def test_an_oversized_dataset_mark_is_replaced_not_adopted(redis_server: RedisServer) -> None:
    """A mark is an id of 32 characters that every fence script carries: a long string at
    its key (hostile or damaged) would ride on every one of them if the replicas adopted
    it. The resync that its change causes replaces it with a mark of their own."""
    async with replicas(redis_server, n=2) as (stores, _):
        redis_server.command("SET", "{sbgate}:dataset", "x" * 100_000)
        await eventually(
            lambda: all(s.stats.data_losses and s.connected for s in stores), what="noticed"
        )
        await eventually(
            lambda: redis_server.command("STRLEN", "{sbgate}:dataset") == b":32", what="replaced"
        )


async def test_exactly_one_of_three_holds_a_lease(redis_server: RedisServer) -> None:
    async with replicas(redis_server) as (stores, _):
        got = await asyncio.gather(*(s.acquire_lease("ping:orders", 5) for s in stores))
        assert sorted(got) == [False, False, True]
        holder = stores[got.index(True)]
        assert {await s.lease_holder("ping:orders") for s in stores} == {holder.replica_id}
        assert await holder.acquire_lease("ping:orders", 5)  # renewal by the holder
        others = [s for s in stores if s is not holder]
        assert not any([await s.acquire_lease("ping:orders", 5) for s in others])
        await others[0].release_lease("ping:orders")  # not the holder: no effect
        assert await holder.lease_holder("ping:orders") == holder.replica_id


async def test_a_released_lease_moves_to_another_replica(redis_server: RedisServer) -> None:
    async with replicas(redis_server) as (stores, _):
        assert await stores[0].acquire_lease("ping:orders", 30)
        assert not await stores[1].acquire_lease("ping:orders", 30)
        await stores[0].release_lease("ping:orders")
        assert await stores[1].acquire_lease("ping:orders", 30)
        assert await stores[2].lease_holder("ping:orders") == "r1"


async def test_a_lease_not_renewed_moves_after_its_ttl(redis_server: RedisServer) -> None:
    async with replicas(redis_server) as (stores, _):
        ttl = 0.5
        assert await stores[0].acquire_lease("ping:orders", ttl)
        taken = time.monotonic()
        # r0 stops renewing (its pinger died); r1 and r2 keep trying, as pingers do.
        winners: list[str] = []

        async def someone_else_holds() -> bool:
            for s in stores[1:]:
                if await s.acquire_lease("ping:orders", ttl):
                    winners.append(s.replica_id)
            return bool(winners)

        await eventually(someone_else_holds)
        assert time.monotonic() - taken >= ttl * 0.8
        assert len(winners) == 1
        assert await stores[0].lease_holder("ping:orders") == winners[0]
        assert not await stores[0].acquire_lease("ping:orders", ttl)


# -- faults ---------------------------------------------------------------------------------


async def test_redis_killed_mid_failover_then_restarted_empty_no_flapping(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, recs):
        r0, r1, r2 = stores
        failing = r0.propose(r0.get("orders"), "failing", "timeout")
        assert failing is not None
        await eventually(lambda: agree(stores, "orders", failing))
        over = r1.propose(r1.get("orders"), "failed_over", "timeout")
        assert over is not None
        await eventually(lambda: agree(stores, "orders", over))

        redis_server.kill()
        await eventually(lambda: not any(s.connected for s in stores), what="disconnected")
        # Fail open: everything keeps working on memory, nothing raises, nothing waits long.
        other = r2.propose(r2.get("billing"), "failing", "connection")
        assert other is not None and other.epoch == 1 and r2.get("billing") == other
        r2.disable_backlog("q2", time.time() + 300, "send failed")
        async with no_hang("lease calls with Redis dead"):
            assert await r0.acquire_lease("ping:orders", 5)
            assert await r0.lease_holder("ping:orders") is None
            await r0.release_lease("ping:orders")
        assert all(s.get("orders") == over for s in stores)
        assert all(s.stats.redis_errors >= 1 for s in stores)

        redis_server.restart(empty=True)
        await eventually(lambda: all(s.connected for s in stores), what="reconnected")
        # Memory was written back to the empty Redis, and everyone learned r2's changes.
        await eventually(lambda: agree(stores, "billing", other))
        await eventually(lambda: all(s.backlogs_disabled(time.time()) == {"q2"} for s in stores))

        async def restored() -> bool:
            return await stored(raw, "orders") == over and await stored(raw, "billing") == other

        await eventually(restored)
        assert all(s.get("orders") == over for s in stores)
        for r in recs:  # no flapping: nobody ever reported "orders" healthy after failover
            seen = [x for x in r.entities if x.entity == "orders"]
            assert seen[-1] == over
            assert all(x.status != "healthy" for x in seen)
        assert all(s.stats.reconnects >= 1 and s.stats.resyncs >= 2 for s in stores)


async def test_redis_paused_calls_stay_bounded_then_replicas_converge(
    redis_server: RedisServer, raw: Client
) -> None:
    async with replicas(redis_server) as (stores, _):
        r0, r1, _r2 = stores
        before = r0.propose(r0.get("orders"), "failing", "timeout")
        await eventually(lambda: agree(stores, "orders", before))

        redis_server.pause()
        try:
            # The first lease call finds the stall: it returns (fail open) within the deadline.
            # A paused Redis never answers: returning at all is our op_timeout at work.
            async with no_hang("acquire_lease with Redis paused"):
                assert await r1.acquire_lease("ping:orders", 5)
            async with no_hang("lease_holder with Redis paused"):
                assert await r0.lease_holder("ping:orders") is None
            assert before is not None
            after = r0.propose(before, "failed_over", "timeout")
            assert after is not None and r0.get("orders") == after
            # The subscribers notice the silence (no PONG) by themselves.
            await eventually(lambda: not any(s.connected for s in stores))
        finally:
            redis_server.resume()

        await eventually(lambda: all(s.connected for s in stores), what="reconnected")
        await eventually(lambda: agree(stores, "orders", after))

        async def in_redis() -> bool:
            return await stored(raw, "orders") == after

        await eventually(in_redis)


async def test_resync_adopts_newer_state_written_while_a_replica_was_away(
    redis_server: RedisServer,
) -> None:
    standalone(redis_server, "a proxy in front of one node: the cluster client bypasses it")
    proxy = await TcpProxy(redis_server.port).start()
    try:
        async with replicas([proxy.url, redis_server.url], n=2) as (stores, recs):
            away, here = stores
            one = here.propose(here.get("orders"), "failing", "timeout")
            await eventually(lambda: agree(stores, "orders", one))

            proxy.cut()
            await eventually(lambda: not away.connected, what="the away replica lost Redis")
            assert one is not None
            two = here.propose(one, "failed_over", "timeout")
            here.disable_backlog("q7", time.time() + 300, "send failed")
            assert two is not None and here.connected
            assert away.get("orders") == one  # it cannot know yet

            resyncs = away.stats.resyncs
            proxy.heal()
            await eventually(lambda: away.connected, what="the away replica is back")
            assert away.stats.resyncs > resyncs
            await eventually(lambda: away.get("orders") == two)
            assert away.backlogs_disabled(time.time()) == {"q7"}
            await eventually(lambda: recs[0].entities[-1:] == [two])
    finally:
        await proxy.close()


@pytest.mark.integration  # starts its own redis-server
async def test_start_with_redis_down_returns_then_connects_when_it_comes_up() -> None:
    server = RedisServer(free_port())
    store = RedisStateStore(server.url, "r0", **FAST)  # type: ignore[arg-type]
    try:
        async with no_hang("start with Redis down"):
            await store.start()
        assert not store.connected
        early = store.propose(store.get("orders"), "failing", "timeout")
        assert early is not None and await store.acquire_lease("ping:orders", 5)

        server.start()
        await eventually(lambda: store.connected, what="connected once Redis is up")
        raw = Redis.from_url(server.url, decode_responses=True)
        try:

            async def written() -> bool:
                return await stored(raw, "orders") == early

            await eventually(written)
        finally:
            await raw.aclose()
    finally:
        await store.close()
        server.close()


async def test_close_is_bounded_while_redis_is_paused(redis_server: RedisServer) -> None:
    store = RedisStateStore(target(redis_server), "r0", **FAST)  # type: ignore[arg-type]
    await store.start()
    await eventually(lambda: store.connected, what="connected")
    tasks = list(store._tasks)
    redis_server.pause()
    try:
        store.propose(store.get("orders"), "failing", "timeout")
        async with no_hang("close with Redis paused"):
            await store.close()
        assert all(t.done() for t in tasks)
        assert not store.connected
    finally:
        redis_server.resume()


def test_the_redis_server_helper_restarts_on_the_same_port(redis_server: RedisServer) -> None:
    standalone(redis_server, "the helper itself, on one server")
    port = redis_server.port
    assert redis_server.command("SET", "k", "v") == b"+OK"
    redis_server.restart(empty=False)
    assert redis_server.port == port and redis_server.command("GET", "k") == b"$1"
    redis_server.restart()  # empty
    assert redis_server.command("GET", "k") == b"$-1"
    redis_server.pause()
    assert redis_server.command("PING", check=False) is None  # stalled: no answer
    redis_server.resume()
    assert redis_server.command("PING") == b"+PONG"


# -- values in Redis are input (issue 23) ----------------------------------------------------


def _all_agree(stores: list[RedisStateStore]) -> bool:
    """Every replica connected, holding the same state for every entity and the same backlog
    queues out of rotation."""
    if not all(s.connected for s in stores):
        return False
    entities = set().union(*(s.snapshot() for s in stores))
    now = time.time()
    return all(agree(stores, e) for e in entities) and (
        len({s.backlogs_disabled(now) for s in stores}) == 1
    )


async def _resynced(raw: Redis, stores: list[RedisStateStore]) -> None:
    """Cut every replica's subscriber connection: each reconnects and resyncs; wait for it.

    On a cluster the kill goes to every node: a cluster client sends CLIENT KILL to its
    default node, the first primary of the slot map it read, which is not always the node
    serving the state's slot (the order of that map changes once a node has restarted, as
    earlier tests of the session do): the kill then reached no subscriber, and the wait
    timed out — on a loaded machine or not, depending on which tests ran before."""
    before = [s.stats.resyncs for s in stores]
    if isinstance(raw, RedisCluster):
        await raw.client_kill_filter(_type="pubsub", target_nodes=RedisCluster.ALL_NODES)
    else:
        await raw.client_kill_filter(_type="pubsub")
    await eventually(
        lambda: all(
            s.stats.resyncs > b and s.connected for s, b in zip(stores, before, strict=True)
        ),
        what="every replica resynced",
    )


async def test_keys_of_the_wrong_type_cut_no_replica_off(
    redis_server: RedisServer, raw: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with replicas(redis_server.url, n=2) as (stores, _):
        await raw.set("{sbgate}:entity:orders", "failed_over")  # an operator's typo
        await raw.rpush("{sbgate}:entity:events", "a", "b")
        await raw.set("{sbgate}:backlog:q1", "300")
        await raw.hset("{sbgate}:lease:pinger", mapping={"a": "b"})
        await raw.set("{sbgate}:entity:bytes", b"\xff\xfe not utf-8")
        await raw.hset("{sbgate}:entity:utf", mapping={"status": b"\xff\xfe", "epoch": b"\xff"})
        with caplog.at_level(logging.WARNING, logger="gateway.state.redis"):
            await _resynced(raw, stores)
        assert "{sbgate}:entity:orders" in caplog.text
        assert all(s.stats.invalid_values.get("resync", 0) >= 5 for s in stores)
        assert _all_agree(stores)

        # Writing over a key of the wrong type repairs it, and everyone hears of it.
        one = stores[0].propose(stores[0].get("orders"), "failing", "timeout")
        assert one is not None
        await eventually(lambda: agree(stores, "orders", one), what="the change spread")
        assert await stored(raw, "orders") == one
        stores[1].disable_backlog("q1", time.time() + 300, "send failed")
        await eventually(lambda: stores[0].backlogs_disabled(time.time()) == {"q1"})
        assert await raw.hget("{sbgate}:backlog:q1", "by") == "r1"
        # A lease key of the wrong type: taken over, not a broken session.
        assert await stores[0].acquire_lease("pinger", 5.0)
        assert await stores[1].lease_holder("pinger") == "r0"
        await _resynced(raw, stores)
        assert _all_agree(stores)
        assert all(s.stats.reconnects == 2 for s in stores)  # the two cuts, nothing more


@pytest.mark.parametrize(
    ("key", "fields"),
    [
        ("{sbgate}:backlog:q2", {"until": "inf", "by": "x", "reason": "r"}),
        ("{sbgate}:backlog:q2", {"until": "nan", "by": "x", "reason": "r"}),
        ("{sbgate}:backlog:q2", {"until": "1e300", "by": "x", "reason": "r"}),
        ("{sbgate}:backlog:q2", {"until": "-inf"}),
        ("{sbgate}:entity:e1", {"status": "failed_over", "epoch": "5", "since": "nan"}),
        ("{sbgate}:entity:e1", {"status": "failed_over", "epoch": "5", "since": "inf"}),
        ("{sbgate}:entity:e1", {"status": "failed_over", "epoch": "1e300", "since": "1"}),
        ("{sbgate}:entity:e1", {"status": "failed_over", "epoch": "99999999999999999999"}),
        ("{sbgate}:entity:e1", {"status": "failed_over", "epoch": "-3"}),
        ("{sbgate}:entity:e1", {"status": "bogus", "epoch": "2"}),
    ],
)
async def test_bad_numbers_in_redis_are_skipped_then_repaired(
    redis_server: RedisServer, raw: Redis, key: str, fields: dict[str, str]
) -> None:
    async with replicas(redis_server.url, n=2) as (stores, _):
        await raw.hset(key, mapping=fields)
        await _resynced(raw, stores)
        assert _all_agree(stores)
        now = time.time()
        assert all(not s.backlogs_disabled(now) for s in stores)
        assert all(s.get("e1").epoch == 0 for s in stores)
        assert all(sum(s.stats.invalid_values.values()) >= 1 for s in stores)
        # A real change over the bad value wins everywhere, and Redis holds it.
        if "entity" in key:
            one = stores[1].propose(stores[1].get("e1"), "failing", "timeout")
            await eventually(lambda: agree(stores, "e1", one))
            assert await stored(raw, "e1") == one
        else:
            stores[1].disable_backlog("q2", now + 60, "send failed")
            await eventually(lambda: stores[0].backlogs_disabled(now) == {"q2"})
            assert float(await raw.hget(key, "until")) == stores[1].backlog_states()["q2"].until
        await _resynced(raw, stores)
        assert _all_agree(stores)


JUNK_EVENTS = [
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b"{}",
    b'{"kind": "backlog"}',
    b'{"kind": "backlog", "queue": "q4", "until": "inf", "by": "x", "reason": "r"}',
    b'{"kind": "backlog", "queue": "q4", "until": "nan", "by": "x", "reason": "r"}',
    b'{"kind": "backlog", "queue": "q4", "until": 1e300, "by": "x", "reason": "r"}',
    b'{"kind": "backlog", "queue": {"a": 1}, "until": 1, "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": "e2", "status": "failed_over", "epoch": 1e300,'
    b' "since": 1, "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": "e2", "status": "failed_over", "epoch": "inf",'
    b' "since": 1, "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": "e2", "status": "failed_over", "epoch": 3,'
    b' "since": "inf", "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": "e2", "status": "failed_over", "epoch": true,'
    b' "since": 1, "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": ["e2"], "status": "failed_over", "epoch": 3,'
    b' "since": 1, "by": "x", "reason": "r"}',
    b'{"kind": "entity", "entity": "e2", "status": "failed_over", "epoch": 3,'
    b' "since": 1, "by": {"x": 1}, "reason": "r"}',
    b'{"kind": "written", "queue": {"x": 1}, "by": "x"}',
    b'{"kind": "written"}',
    b'{"kind": 7}',
]


async def test_junk_on_the_channel_changes_nothing_and_breaks_nothing(
    redis_server: RedisServer, raw: Redis
) -> None:
    async with replicas(redis_server.url, n=2) as (stores, recs):
        for event in JUNK_EVENTS:
            await raw.publish("{sbgate}:events", event)
        # A good event after the junk is still applied: the subscriber is alive.
        marker = stores[0].propose(stores[0].get("marker"), "failing", "timeout")
        await eventually(lambda: agree(stores, "marker", marker))
        assert all(s.get("e2").epoch == 0 for s in stores)
        assert all(not s.backlogs_disabled(time.time()) for s in stores)
        assert all(s.stats.invalid_values.get("event", 0) >= len(JUNK_EVENTS) - 2 for s in stores)
        assert all(r.written.count({"x": 1}) == 0 for r in recs)  # type: ignore[arg-type]
        assert all(s.stats.reconnects == 0 for s in stores)
        assert _all_agree(stores)


async def test_a_key_deleted_after_a_bad_value_does_not_break_the_next_resync(
    redis_server: RedisServer, raw: Redis
) -> None:
    """`until=inf`, published once, then the key deleted: no replica keeps the queue out of
    rotation, and the next resync (which writes memory back) does not fail."""
    async with replicas(redis_server.url, n=2) as (stores, _):
        await raw.hset("{sbgate}:backlog:q5", mapping={"until": "inf", "by": "x", "reason": "r"})
        await raw.publish(
            "{sbgate}:events",
            b'{"kind": "backlog", "queue": "q5", "until": "inf", "by": "x", "reason": "r"}',
        )
        await raw.publish(
            "{sbgate}:events",
            b'{"kind": "backlog", "queue": "q5", "until": 1e300, "by": "x", "reason": "r"}',
        )
        marker = stores[0].propose(stores[0].get("marker"), "failing", "timeout")
        await eventually(lambda: agree(stores, "marker", marker))
        assert all(not s.backlogs_disabled(time.time()) for s in stores)
        await raw.delete("{sbgate}:backlog:q5")
        await _resynced(raw, stores)
        await _resynced(raw, stores)
        assert _all_agree(stores)
        assert all(s.stats.reconnects == 2 for s in stores)


async def test_a_forced_resync_reaches_the_subscribers_whatever_the_default_node(
    redis_server: RedisServer, raw: Client
) -> None:
    """`_resynced`'s kill reaches the node serving the state's slot even when the cluster
    client's default node is another one (as after a node restart): it failed before."""
    if not isinstance(raw, RedisCluster):
        pytest.skip("a cluster client's default node")
    await raw.initialize()
    owner = raw.get_node_from_key("{sbgate}:events")
    assert owner is not None
    raw.set_default_node(next(n for n in raw.get_primaries() if n.name != owner.name))
    async with replicas(redis_server.url, n=2) as (stores, _):
        await _resynced(raw, stores)  # type: ignore[arg-type]
        assert _all_agree(stores)


_JUNK_VALUES = st.sampled_from(
    ["inf", "-inf", "nan", "1e300", "-1", "", "x", "1_000", "0x10", " 5", "99999999999999999"]
)
_GOOD_TIME = st.integers(1, 4_000_000_000).map(str)
_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("junk_entity"),
            st.sampled_from(["a", "b"]),
            st.fixed_dictionaries(
                {},
                optional={
                    "status": st.sampled_from(["healthy", "failing", "failed_over", "bogus"]),
                    "epoch": st.one_of(_JUNK_VALUES, st.integers(0, 9).map(str)),
                    "since": st.one_of(_JUNK_VALUES, _GOOD_TIME),
                },
            ),
        ),
        st.tuples(
            st.just("junk_backlog"),
            st.sampled_from(["q1", "q2"]),
            st.fixed_dictionaries({"until": st.one_of(_JUNK_VALUES, _GOOD_TIME)}),
        ),
        st.tuples(st.just("wrong_type"), st.sampled_from(["entity:a", "backlog:q1", "lease:p"])),
        st.tuples(st.just("junk_event"), st.sampled_from(JUNK_EVENTS)),
        st.tuples(
            st.just("propose"),
            st.integers(0, 1),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["healthy", "failing", "failed_over"]),
        ),
        st.tuples(st.just("disable"), st.integers(0, 1), st.sampled_from(["q1", "q2"])),
        st.tuples(st.just("lease"), st.integers(0, 1)),
        st.tuples(st.just("resync")),
    ),
    max_size=12,
)


@pytest.mark.timeout(300)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=_OPS)
def test_property_junk_among_good_values_never_splits_the_replicas(
    redis_server: RedisServer, ops: list[tuple[Any, ...]]
) -> None:
    """Whatever mix of junk keys, junk events and real changes: the two replicas end
    connected, agreeing on every entity and backlog, and Redis holds what they hold."""

    async def scenario() -> None:
        raw = Redis.from_url(redis_server.url, decode_responses=True)
        try:
            await raw.flushall()
            async with replicas(redis_server.url, n=2) as (stores, _):
                for op in ops:
                    kind = op[0]
                    # Each junk write replaces the key in one transaction (a replica may
                    # write to it at any moment).
                    if kind in ("junk_entity", "junk_backlog"):
                        key = f"{{sbgate}}:{kind[5:]}:{op[1]}"
                        async with raw.pipeline(transaction=True) as pipe:
                            pipe.delete(key)
                            if op[2]:
                                pipe.hset(key, mapping=op[2])
                            await pipe.execute()
                    elif kind == "wrong_type":
                        async with raw.pipeline(transaction=True) as pipe:
                            pipe.delete(f"{{sbgate}}:{op[1]}")
                            pipe.rpush(f"{{sbgate}}:{op[1]}", "x")
                            await pipe.execute()
                    elif kind == "junk_event":
                        await raw.publish("{sbgate}:events", op[1])
                    elif kind == "propose":
                        store = stores[op[1]]
                        store.propose(store.get(op[2]), op[3], "test")
                    elif kind == "disable":
                        stores[op[1]].disable_backlog(op[2], time.time() + 600, "test")
                    elif kind == "lease":
                        await stores[op[1]].acquire_lease("p", 5.0)
                        await stores[op[1]].lease_holder("p")
                    else:
                        await _resynced(raw, stores)
                # Settle: a last resync reads whatever junk is left, then they must agree.
                await _resynced(raw, stores)
                await eventually(lambda: _all_agree(stores), what="the replicas agree")
                for entity, state in stores[0].snapshot().items():
                    held = await raw.hgetall(f"{{sbgate}}:entity:{entity}")
                    assert entity_from_hash(entity, held) == state
                assert all(s.stats.reconnects == s.stats.resyncs - 1 for s in stores)
        finally:
            await raw.aclose()

    asyncio.run(scenario())


# -- cluster --------------------------------------------------------------------------------


async def test_every_key_and_the_channel_live_in_the_one_slot_of_the_hash_tag(
    redis_cluster: RedisClusterServers,
) -> None:
    redis_cluster.heal()
    owner = redis_cluster.owner(STATE_TAG)
    seed = next(n for n in redis_cluster.nodes if n is not owner)
    async with replicas(RedisTarget(seed.url, mode="cluster"), n=2) as (stores, _):
        r0, r1 = stores
        made = [r0.propose(r0.get(f"p/q-{i}"), "failing", "timeout") for i in range(10)]
        r1.disable_backlog("p/x-servicebus-transfer/1", time.time() + 300, "send failed")
        assert await r0.acquire_lease("ping:p/q-0", 30)
        await eventually(lambda: all(r1.get(m.entity) == m for m in made if m is not None))
        await eventually(lambda: bool(r0.backlogs_disabled(time.time())))
        with redis_cluster.admin(owner) as admin:
            keys = set(admin.keys("*"))
            # 10 entities, a backlog, a lease and the dataset mark.
            assert len(keys) == 13 and all(k.startswith("{sbgate}:") for k in keys)
            slots = {admin.execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
            assert slots == {redis_cluster.slot("{sbgate}:events")}
        # Sharded pub/sub: the subscribers hang on the slot's owner, nowhere else.
        for node in redis_cluster.nodes:
            with redis_cluster.admin(node) as admin:
                subs = admin.execute_command("PUBSUB", "SHARDNUMSUB", "{sbgate}:events")
                assert subs[1] == (2 if node is owner else 0)


async def test_a_slot_migration_during_traffic_loses_nothing(
    redis_cluster: RedisClusterServers,
) -> None:
    """`redis-cli --cluster reshard`'s steps, run while both replicas keep deciding: they
    follow the slot to its new owner (MOVED/ASK, then the dropped sharded subscription makes
    them resubscribe there and resync) and converge on what Redis holds."""
    redis_cluster.heal()
    owner = redis_cluster.owner(STATE_TAG)
    others = [n for n in redis_cluster.nodes if n is not owner]
    async with replicas(RedisTarget(others[0].url, mode="cluster"), n=2) as (stores, recs):
        r0, r1 = stores
        stop = asyncio.Event()
        decided: dict[str, EntityState] = {}

        async def traffic() -> None:
            i = 0
            while not stop.is_set():
                store = stores[i % 2]
                entity = f"e{i % 16}"
                status = "failing" if store.get(entity).status == "healthy" else "healthy"
                new = store.propose(store.get(entity), status, f"step-{i}")
                if new is not None:
                    decided[entity] = new
                i += 1
                await asyncio.sleep(0.005)  # paces the load; not a wait for a condition

        async with asyncio.TaskGroup() as tg:
            tg.create_task(traffic())
            await eventually(lambda: r0.stats.writes + r1.stats.writes >= 20)
            await asyncio.to_thread(redis_cluster.migrate, STATE_TAG, others[1])
            writes = r0.stats.writes + r1.stats.writes
            await eventually(lambda: r0.stats.writes + r1.stats.writes >= writes + 20)
            stop.set()
        assert redis_cluster.owner(STATE_TAG) is others[1]
        # The old owner dropped the sharded subscriptions: each replica opened a new session.
        await eventually(lambda: all(s.stats.reconnects >= 1 for s in stores))
        await eventually(lambda: all(s.connected for s in stores), what="on the new owner")

        raw = RedisTarget(others[0].url, mode="cluster").client(op_timeout=5, name="test")
        try:

            async def converged() -> bool:
                for entity in decided:
                    in_redis = await stored(raw, entity)
                    if in_redis is None or not agree(stores, entity, in_redis):
                        return False
                return True

            await eventually(converged, what="both replicas hold what the new owner holds")
        finally:
            await raw.aclose()
        # Still sharing: a decision made now reaches the other replica through the new owner.
        last = r1.propose(r1.get("after"), "failed_over", "timeout")
        await eventually(lambda: r0.get("after") == last and recs[0].entities[-1:] == [last])


async def test_state_in_the_untagged_layout_of_earlier_releases_is_imported_once(
    redis_server: RedisServer, raw: Client
) -> None:
    """The upgrade path: keys written before the hash tag (`sbgate:entity:<name>`) are read
    on the first resync, where the tagged layout lacks them; the tagged layout wins."""
    standalone(redis_server, "a cluster never held the untagged layout")
    old = {"status": "failed_over", "epoch": "4", "since": "1.5", "by": "old", "reason": "x"}
    await raw.hset("sbgate:entity:orders", mapping=old)
    await raw.hset("sbgate:entity:billing", mapping=old)
    await raw.hset("{sbgate}:entity:billing", mapping={**old, "epoch": "6", "by": "new"})
    far = time.time() + 300
    await raw.hset("sbgate:backlog:q1", mapping={"until": repr(far), "by": "old", "reason": "x"})
    async with replicas(redis_server, n=1) as (stores, _):
        (r0,) = stores
        assert r0.get("orders") == EntityState("orders", "failed_over", 4, 1.5, "old", "x")
        assert r0.get("billing").epoch == 6 and r0.get("billing").by == "new"
        assert r0.backlogs_disabled(time.time()) == {"q1"}
        await raw.hset("sbgate:entity:late", mapping=old)  # written after the import
        resyncs = r0.stats.resyncs
        redis_server.restart(empty=False)
        await eventually(lambda: r0.connected and r0.stats.resyncs > resyncs)
        assert r0.get("late").epoch == 0, "the untagged layout is read only once"


@pytest.mark.integration  # starts its own cluster
async def test_a_cluster_without_sharded_pub_sub_falls_back_to_classic_pub_sub() -> None:
    """Redis 6 (Azure Cache for Redis Premium clustered) has no SPUBLISH: the events go by
    classic pub/sub, which the cluster bus carries to every node. Stood in for by a Redis 7
    cluster whose SPUBLISH is renamed away, so `COMMAND INFO SPUBLISH` answers nil."""
    with RedisClusterServers(args=("--rename-command", "SPUBLISH", "")) as cluster:
        owner = cluster.owner(STATE_TAG)
        seed = next(n for n in cluster.nodes if n is not owner)
        async with replicas(RedisTarget(seed.url, mode="cluster"), n=2) as (stores, _):
            r0, r1 = stores
            made = r0.propose(r0.get("orders"), "failed_over", "timeout")
            await eventually(lambda: r1.get("orders") == made)
            back = r1.propose(r1.get("orders"), "healthy", "ping")
            await eventually(lambda: r0.get("orders") == back)
            with cluster.admin(owner) as admin:
                assert admin.execute_command("PUBSUB", "NUMSUB", "{sbgate}:events")[1] == 2
                assert admin.execute_command("PUBSUB", "SHARDNUMSUB", "{sbgate}:events")[1] == 0
