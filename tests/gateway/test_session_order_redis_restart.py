"""A session keeps its order through a Redis restart that loses its fence
(docs/failover.md#sessions-keep-their-order), end to end: a serving replica and a syphon
replica sharing a real redis-server, the local broker, real session receivers.

The fence's contents go with Redis; the replica writes it back as *unknown*. The session's
older messages sit in two backlog queues (a queue left rotation between them), and newer
ones follow after the failback. The syphon must rebuild the fence from the backlog (peek
every queue, the messages' acceptance stamps) and move them home in acknowledgement order.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from gateway.core.backlog import session_ranking
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_session_order import (
    BACKLOGS,
    BASE,
    DEADLINE,
    ENTITY,
    backlog_total,
    fenced,
    post,
    receive_session,
    session_queue,
)
from tests.support.processes import RedisServer
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

S = "restart-1"


async def fence_hash(redis_server: RedisServer) -> dict[str, str]:
    async with Redis.from_url(redis_server.url, decode_responses=True) as r:
        async with asyncio.timeout(DEADLINE):
            return dict(await r.hgetall(f"{{sbgate}}:fence:{ENTITY}\n{S}"))


async def where(control: ControlClient) -> dict[str, list[str]]:
    """S's MessageIds per backlog queue, in stored order."""
    out: dict[str, list[str]] = {}
    for q in BACKLOGS:
        for m in await control.messages("secondary", q, limit=100):
            if (m.get("application_properties") or {}).get("x-ms-sessionid") == S:
                out.setdefault(q, []).append(str(m["message_id"]))
    return out


async def test_a_fence_redis_lost_keeps_the_order_of_two_backlog_queues(
    gateway: GatewayFactory,
    control: ControlClient,
    broker: BrokerProcess,
    redis_server: RedisServer,
):
    await session_queue(control)
    env = {**BASE, "SBGATE_SESSION_ORDER": "strict", "SBGATE_REDIS_URL": redis_server.url}
    gw = await gateway(env)
    first, second = session_ranking(ENTITY, S, BACKLOGS)[:2]
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    for n in range(3):
        assert await post(gw, S, n) == 202
    # S's queue leaves rotation: its next messages start a generation in the next queue.
    await control.add_fault(
        "secondary", "amqp:internal-error", operation="send", entity=first, count=1
    )
    for n in range(3, 5):
        assert await post(gw, S, n) == 202
    assert await where(control) == {
        first: [f"{S}-{n}" for n in range(3)],
        second: [
            f"{S}-3",
            f"{S}-4",
        ],
    }

    redis_server.restart(empty=True)

    async def unknown() -> bool:
        return (await fence_hash(redis_server)).get("u") == "1"

    await eventually(unknown, within=DEADLINE, every=0.2, what="written back as unknown")
    await control.remove_fault("primary", fault)
    async with asyncio.timeout(DEADLINE):
        assert (await gw.post(f"/admin/entities/{ENTITY}/healthy")).status == 200
    for n in range(5, 8):
        assert await post(gw, S, n) == 202, "an unknown fence still fences"

    sy = await gateway({**env, "SBGATE_ENABLE_SYPHON": "true"}, mode="syphon")

    async def drained() -> bool:
        return await backlog_total(control) == 0

    await eventually(drained, within=DEADLINE * 2, every=0.2, what="the backlog drained")
    got = await receive_session(broker, S)
    assert got == [f"{S}-{n}" for n in range(8)]

    async def lifted() -> bool:
        return (await fenced(gw))["count"] == 0

    await eventually(lifted, within=DEADLINE, every=0.2, what="the fence lifted")
    assert await post(gw, S, 8) == 201
    moved = await (await sy.get("/metrics")).text()
    assert 'sbgate_syphon_session_moves_total{outcome="waited"}' in moved
