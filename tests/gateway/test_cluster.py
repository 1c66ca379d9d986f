"""Several replicas sharing failover state through a real redis-server: a failure seen by
one replica is known to all of them; recovery, pinger lease, Redis faults."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.processes import RedisServer
from tests.support.redis import redis_cluster as redis_cluster  # the fixture
from tests.support.redis import redis_server_in
from tests.support.waiting import eventually

CLUSTER = {
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_FAILOVER_INTERVAL": "0",
    "SBGATE_PING_PRIMARY_INTERVAL": "0.3",
    "SBGATE_BACKLOG_QUEUE_COUNT": "3",
    "SBGATE_SDK_RETRY_TOTAL": "0",
    "SBGATE_SEND_TIMEOUT": "2",
}


@pytest.fixture(params=["standalone", "cluster"])
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """One server, and a 3-master Redis Cluster (the node serving the state's slot)."""
    yield from redis_server_in(request, request.param)


async def replicas(gateway: GatewayFactory, redis: RedisServer, n: int, **extra: str) -> list[Any]:
    where = {"SBGATE_REDIS_URL": redis.client_url, "SBGATE_REDIS_MODE": redis.mode}
    return [
        await gateway({**CLUSTER, **where, "SBGATE_REPLICA_ID": f"r{i}", **extra}) for i in range(n)
    ]


async def state(gw: Any, entity: str = "orders") -> dict[str, Any]:
    body = await (await gw.get("/admin/entities")).json()
    return next(e for e in body["entities"] if e["entity"] == entity)


async def all_in(gws: list[Any], status: str) -> bool:
    return all([(await state(g))["state"] == status for g in gws])


async def test_one_replicas_decision_routes_every_replica_to_the_backlog(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    gws = await replicas(gateway, redis_server, 3, SBGATE_PING_PRIMARY_INTERVAL="60")
    fault = await control.add_fault(
        "primary", "amqp:internal-error", operation="send", entity="orders"
    )
    assert (await gws[0].post("/orders/messages", data=b"x")).status == 202
    await eventually(lambda: all_in(gws, "failed_over"), within=5)
    sends_before = (await control.entity("primary", "orders"))["sends"]
    for gw in gws[1:]:  # they never saw a failure themselves
        resp = await gw.post("/orders/messages", data=b"y")
        assert resp.status == 202 and (await resp.json())["route"] == "backlog"
    assert (await control.entity("primary", "orders"))["sends"] == sends_before, (
        "replicas that learnt of the failover did not try the primary"
    )
    assert {(await state(g))["by"] for g in gws} == {"r0"}
    await control.remove_fault("primary", fault)


async def test_a_failing_backlog_is_rotated_out_on_every_replica(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    gws = await replicas(gateway, redis_server, 2, SBGATE_PING_PRIMARY_INTERVAL="60")
    await control.add_fault("primary", "amqp:internal-error", operation="send", entity="orders")
    first = await (await gws[0].post("/orders/messages", data=b"1")).json()
    bad = first["backlog"]
    await control.add_fault("secondary", "amqp:internal-error", operation="send", entity=bad)
    assert (await gws[0].post("/orders/messages", data=b"2")).status == 202

    async def rotated_out_everywhere() -> bool:
        for g in gws:
            rows = {q["path"]: q["inRotation"] for q in (await state(g))["backlogQueues"]}
            if rows[bad]:
                return False
        return True

    await eventually(rotated_out_everywhere, within=5)
    for _ in range(5):
        resp = await gws[1].post("/orders/messages", data=b"3")
        assert resp.status == 202 and (await resp.json())["backlog"] != bad


async def test_recovery_brings_every_replica_back_and_the_pinger_lease_moves(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    gws = await replicas(gateway, redis_server, 2)
    fault = await control.add_fault(
        "primary", "amqp:internal-error", operation="send", entity="orders"
    )
    assert (await gws[0].post("/orders/messages", data=b"x")).status == 202
    await eventually(lambda: all_in(gws, "failed_over"), within=5)

    async def pinger() -> str | None:
        return (await state(gws[1]))["pinger"]  # type: ignore[no-any-return]

    await eventually(pinger, within=5)
    holder = await pinger()
    assert holder in {"r0", "r1"}
    # Stop the holder: the lease expires and the other replica takes over the pings.
    holder_gw = gws[0] if holder == "r0" else gws[1]
    other = gws[1] if holder == "r0" else gws[0]
    await holder_gw.close()

    async def taken_over() -> bool:
        return (await state(other))["pinger"] not in {None, holder}

    await eventually(taken_over, within=10, every=0.1)
    await control.remove_fault("primary", fault)
    await eventually(lambda: all_in([other], "healthy"), within=5)
    assert (await other.post("/orders/messages", data=b"home")).status == 201


async def test_redis_killed_mid_failover_then_restarted_empty_no_5xx_no_flapping(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    gws = await replicas(gateway, redis_server, 2, SBGATE_PING_PRIMARY_INTERVAL="60")
    await control.add_fault("primary", "amqp:internal-error", operation="send", entity="orders")
    assert (await gws[0].post("/orders/messages", data=b"x")).status == 202
    await eventually(lambda: all_in(gws, "failed_over"), within=5)
    redis_server.kill()
    statuses = []
    for i in range(20):
        resp = await gws[i % 2].post("/orders/messages", data=b"during")
        statuses.append(resp.status)
    assert set(statuses) == {202}, "no 5xx while Redis is gone: replicas fail open"
    assert (await gws[0].get("/readyz")).status == 200
    metrics = await (await gws[0].get("/metrics")).text()
    assert "sbgate_redis_connected 0.0" in metrics
    redis_server.restart(empty=True)

    async def reconnected() -> bool:
        text = await (await gws[0].get("/metrics")).text()
        return "sbgate_redis_connected 1.0" in text

    await eventually(reconnected, within=15, every=0.1)
    assert await all_in(gws, "failed_over"), "restored from memory: no flapping"
    assert redis_server.command("KEYS", "*"), "the replicas wrote their state back"


async def test_a_key_of_the_wrong_type_cuts_no_replica_off(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    """`redis-cli SET {sbgate}:entity:orders failed_over` (a typo) and a backlog disabled
    until inf: every replica stays connected, counts and skips them, and a failover decided
    on one still reaches the other (writing over the bad key)."""
    gws = await replicas(gateway, redis_server, 2, SBGATE_PING_PRIMARY_INTERVAL="60")
    redis_server.command("SET", "{sbgate}:entity:orders", "failed_over")
    redis_server.command("HSET", "{sbgate}:backlog:orders.backlog.0", "until", "inf")
    redis_server.command(
        "PUBLISH",
        "{sbgate}:events",
        '{"kind": "backlog", "queue": "orders.backlog.0", "until": "inf", "by": "x",'
        ' "reason": "r"}',
    )
    redis_server.command("CLIENT", "KILL", "TYPE", "pubsub")  # every replica resyncs

    async def counted_and_connected(gw: Any) -> bool:
        text = await (await gw.get("/metrics")).text()
        return (
            "sbgate_redis_connected 1.0" in text
            and 'sbgate_state_invalid_values_total{source="resync"} 0.0' not in text
        )

    for gw in gws:
        await eventually(lambda gw=gw: counted_and_connected(gw), within=10, every=0.1)
    assert await all_in(gws, "healthy")
    await control.add_fault("primary", "amqp:internal-error", operation="send", entity="orders")
    assert (await gws[0].post("/orders/messages", data=b"x")).status == 202
    await eventually(lambda: all_in(gws, "failed_over"), within=5)
    assert redis_server.command("TYPE", "{sbgate}:entity:orders") == b"+hash"  # written over
    for gw in gws:
        assert "sbgate_redis_connected 1.0" in await (await gw.get("/metrics")).text()
