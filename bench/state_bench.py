"""How fast a failover decision reaches every replica, and what `get()` costs on the hot path.

Three replicas, each a separate process with its own `RedisStateStore` (its own connections
and subscriber), in the same run on one real redis-server (`standalone`) and on a real
3-master Redis Cluster (`cluster`: sharded pub/sub, the replicas seeded with a node that does
not serve the state's slot), each started here on free ports. For each entity:

* P5 — one replica decides `failed_over`; latency = the last of the 3 replicas applying it
  (its listener ran) minus the moment just before `propose()` on the deciding replica;
* P6 — another replica decides `healthy` (a ping got through); same measure.

Times are CLOCK_MONOTONIC, which every process on the machine shares. Also measured: one
`store.get()` against a plain `dict.get` (the hot path reads memory only).

    .venv/bin/python -m bench.state_bench [--transitions 200] [--modes standalone,cluster]

Goals: P5 p99 <= 50 ms, P6 p99 <= 100 ms. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
import timeit
from multiprocessing.connection import Connection, wait
from typing import Any

from bench.harness import parse_args
from gateway.state import EntityState, MemoryStateStore, RedisStateStore
from gateway.state.connect import RedisTarget
from tests.support.processes import RedisServer
from tests.support.redis import STATE_TAG, RedisClusterServers

REPLICAS = 3


async def _replica(url: str, mode: Any, idx: int, conn: Connection) -> None:
    """One replica: report every applied change; propose what the parent asks."""
    store = RedisStateStore(RedisTarget(url, mode=mode), f"r{idx}")

    def on_entity(s: EntityState) -> None:
        conn.send(("applied", idx, s.entity, s.epoch, time.monotonic()))

    store.subscribe(on_entity, lambda _b: None)
    await store.start()
    stop = asyncio.Event()

    def on_command() -> None:
        cmd = conn.recv()
        if cmd[0] == "stop":
            stop.set()
            return
        _, entity, status = cmd
        t0 = time.monotonic()
        new = store.propose(store.get(entity), status, "bench")
        conn.send(("proposed", idx, entity, new.epoch if new else -1, t0))

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), on_command)
    conn.send(("ready", idx, store.connected))
    try:
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await store.close()
        conn.send(("stats", idx, store.stats.as_dict()))


def _replica_main(url: str, mode: str, idx: int, conn: Connection) -> None:
    asyncio.run(_replica(url, mode, idx, conn))


def _recv_until(conns: list[Connection], want: Any, timeout: float = 10.0) -> list[tuple[Any, ...]]:
    """Collect messages from the replicas until `want(messages)` is true."""
    got: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    while not want(got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"replicas did not answer in {timeout} s: {got[-5:]}")
        for c in wait(conns, left):
            assert isinstance(c, Connection)
            got.append(c.recv())
    return got


def _transition(conns: list[Connection], decider: int, entity: str, status: str) -> float:
    """Ask `decider` to propose; seconds until every replica applied that epoch."""
    conns[decider].send(("propose", entity, status))

    def done(msgs: list[tuple[Any, ...]]) -> bool:
        prop = [m for m in msgs if m[0] == "proposed"]
        if not prop:
            return False
        epoch = prop[0][3]
        applied = {m[1] for m in msgs if m[0] == "applied" and m[2] == entity and m[3] == epoch}
        return len(applied) == REPLICAS

    msgs = _recv_until(conns, done)
    prop = next(m for m in msgs if m[0] == "proposed")
    if prop[3] < 0:
        raise RuntimeError(f"replica {decider} rejected the proposal for {entity}")
    t0, epoch = prop[4], prop[3]
    last = max(m[4] for m in msgs if m[0] == "applied" and m[2] == entity and m[3] == epoch)
    return last - t0


def _pct(xs: list[float], p: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _report(name: str, lat: list[float], goal_ms: float) -> None:
    ms = [x * 1000 for x in lat]
    p99 = _pct(ms, 99)
    print(
        f"{name}: n={len(ms)} p50={_pct(ms, 50):.2f} ms p90={_pct(ms, 90):.2f} ms "
        f"p99={p99:.2f} ms max={max(ms):.2f} ms mean={statistics.fmean(ms):.2f} ms "
        f"(goal p99 <= {goal_ms:.0f} ms: {'met' if p99 <= goal_ms else 'NOT met'})"
    )


def bench_propagation(transitions: int, mode: str) -> None:
    ctx = mp.get_context("spawn")  # fresh interpreters: nothing inherited from this loop
    with RedisServer() if mode == "standalone" else RedisClusterServers() as backend:
        if isinstance(backend, RedisClusterServers):
            owner = backend.owner(STATE_TAG)
            url = next(n for n in backend.nodes if n is not owner).url
        else:
            url = backend.url
        pipes = [ctx.Pipe() for _ in range(REPLICAS)]
        procs = [
            ctx.Process(target=_replica_main, args=(url, mode, i, pipes[i][1]), daemon=True)
            for i in range(REPLICAS)
        ]
        for p in procs:
            p.start()
        conns = [parent for parent, _ in pipes]
        try:
            ready = _recv_until(conns, lambda m: len(m) == REPLICAS, timeout=30)
            if not all(m[2] for m in ready):
                raise RuntimeError(f"a replica did not connect to Redis: {ready}")
            for i in range(5):  # warm-up: connections, script cache
                _transition(conns, i % REPLICAS, f"warm-{i}", "failed_over")
            p5: list[float] = []
            p6: list[float] = []
            for i in range(transitions):
                entity = f"contoso/orders-{i}"
                p5.append(_transition(conns, i % REPLICAS, entity, "failed_over"))
                p6.append(_transition(conns, (i + 1) % REPLICAS, entity, "healthy"))
            print(f"[{mode}] 3 replicas = 3 processes, each its own RedisStateStore; {url}")
            _report("P5 failover decision -> all 3 replicas applied", p5, 50)
            _report("P6 healthy transition -> all 3 replicas applied", p6, 100)
        finally:
            for c in conns:
                c.send(("stop",))
            stats = _recv_until(
                conns, lambda m: sum(x[0] == "stats" for x in m) == REPLICAS, timeout=10
            )
            for m in stats:
                if m[0] == "stats":
                    print(f"  replica r{m[1]} stats: {m[2]}")
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()


def bench_get(entities: int = 1000, number: int = 1_000_000) -> None:
    """`get()` against a plain dict lookup, on a populated store (no loop, no Redis)."""
    redis_store = RedisStateStore("redis://127.0.0.1:1/0", "r0")  # never started
    memory_store = MemoryStateStore("r0")
    plain: dict[str, EntityState] = {}
    for i in range(entities):
        name = f"contoso/orders-{i}"
        for store in (redis_store, memory_store):
            store.propose(store.get(name), "failed_over", "bench")
        plain[name] = redis_store.get(name)
    key = f"contoso/orders-{entities // 2}"

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e9

    base = best(lambda: plain.get(key))
    r = best(lambda: redis_store.get(key))
    m = best(lambda: memory_store.get(key))
    missing = best(lambda: redis_store.get("never-seen"))
    print(f"get(): dict.get {base:.0f} ns; RedisStateStore.get {r:.0f} ns ({r / base:.1f}x)")
    print(f"       MemoryStateStore.get {m:.0f} ns ({m / base:.1f}x)")
    print(f"       an entity never seen (healthy) {missing:.0f} ns ({missing / base:.1f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--transitions", type=int, default=200)
    parser.add_argument("--modes", default="standalone,cluster")
    args = parse_args(parser, argv, {"transitions": 50})
    for mode in args.modes.split(","):
        bench_propagation(args.transitions, mode.strip())
    bench_get()
    return 0


if __name__ == "__main__":
    sys.exit(main())
