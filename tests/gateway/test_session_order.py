"""Sessions keep their order through a failover (docs/failover.md#sessions-keep-their-order),
end to end: the gateway, its syphon and real session receivers of the SDK on the local
broker. Two apps share one state store, as two replicas share Redis: one serves, the other
runs only the syphon (started when the test lets the backlog go home)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest
from azure.servicebus.aio import ServiceBusClient
from redis.asyncio import Redis

from gateway.state.memory import MemoryStateStore
from sblocal.testing import BrokerProcess, ControlClient, ControlError
from tests.conftest import GatewayFactory
from tests.support.processes import RedisServer
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENTITY = "ordered"
BASE = {
    "SBGATE_ENTITIES": f"queue:orders,topic:events,queue:{ENTITY}",
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_FAILOVER_INTERVAL": "0",
    "SBGATE_PING_PRIMARY_INTERVAL": "600",  # the test marks the entity healthy itself
    "SBGATE_BACKLOG_QUEUE_COUNT": "3",
    "SBGATE_SDK_RETRY_TOTAL": "0",
    "SBGATE_SEND_TIMEOUT": "2",
    "SBGATE_RECEIVE_WAIT": "0.5",
    "SBGATE_IDLE_CHECK_INTERVAL": "3600",
}
BACKLOGS = [f"primary/x-servicebus-transfer/{i}" for i in range(3)]
DEADLINE = 20.0


async def session_queue(control: ControlClient) -> None:
    with contextlib.suppress(ControlError):  # one broker for the session: it may exist
        await control.create_entity("primary", ENTITY, "queue", {"requires_session": True})


async def post(gw: Any, session: str, n: int) -> int:
    props = {"MessageId": f"{session}-{n}", "SessionId": session}
    async with asyncio.timeout(DEADLINE):
        r = await gw.post(
            f"/queues/{ENTITY}/messages",
            data=f"{session}:{n}".encode(),
            headers={"BrokerProperties": orjson.dumps(props).decode()},
        )
        assert r.status in {201, 202}, await r.text()
        return int(r.status)


async def receive_session(broker: BrokerProcess, session: str) -> list[str]:
    """Every message of `session` through a session receiver, in the order it gives them."""
    out: list[str] = []
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(
            broker.connection_string("primary"), retry_total=0
        ) as sb:
            receiver = sb.get_queue_receiver(ENTITY, session_id=session)
            async with receiver:
                while batch := await receiver.receive_messages(
                    max_message_count=50, max_wait_time=1
                ):
                    for m in batch:
                        await receiver.complete_message(m)
                        out.append(str(m.message_id))
    return out


async def fenced(gw: Any) -> dict[str, Any]:
    async with asyncio.timeout(DEADLINE):
        admin = await (await gw.get("/admin/entities")).json()
    [entry] = [e for e in admin["entities"] if e["entity"] == ENTITY]
    return dict(entry["fencedSessions"])


async def backlog_total(control: ControlClient) -> int:
    return sum([int((await control.entity("secondary", q))["active"]) for q in BACKLOGS])


async def failback_race(
    gateway: GatewayFactory, control: ControlClient, order: str, sessions: list[str]
) -> tuple[Any, Any, dict[str, list[int]]]:
    """Messages 0-2 of each session go to the backlog during a failover; the entity is
    marked healthy while the backlog still holds them (no syphon yet); messages 3-5 follow
    at once; then a syphon replica starts and moves the backlog home. Returns the serving
    gateway, the syphon replica and each session's answers."""
    await session_queue(control)
    store = MemoryStateStore("replicas")
    env = {**BASE, "SBGATE_SESSION_ORDER": order}
    gw = await gateway(env, store_factory=lambda _: store)
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    answers: dict[str, list[int]] = {s: [] for s in sessions}
    for s in sessions:
        for n in range(3):
            answers[s].append(await post(gw, s, n))
    await control.remove_fault("primary", fault)
    async with asyncio.timeout(DEADLINE):
        assert (await gw.post(f"/admin/entities/{ENTITY}/healthy")).status == 200
    for s in sessions:
        for n in range(3, 6):
            answers[s].append(await post(gw, s, n))
    # A failed move on the way: the syphon must not send a session's later messages first.
    await control.add_fault("primary", "amqp:internal-error", operation="send", count=1)
    sy = await gateway(
        {**env, "SBGATE_ENABLE_SYPHON": "true"}, mode="syphon", store_factory=lambda _: store
    )

    async def drained() -> bool:
        return await backlog_total(control) == 0

    await eventually(drained, within=DEADLINE, every=0.2)
    return gw, sy, answers


async def test_strict_a_session_keeps_its_order_through_a_failback(
    gateway: GatewayFactory, control: ControlClient, broker: BrokerProcess
):
    sessions = [f"strict-{i}" for i in range(6)]
    gw, sy, answers = await failback_race(gateway, control, "strict", sessions)
    for s in sessions:
        assert answers[s] == [202] * 6, "fenced: after the failback too, until moved home"
        assert await receive_session(broker, s) == [f"{s}-{n}" for n in range(6)]

    async def lifted() -> bool:
        return (await fenced(gw))["count"] == 0

    # Once everything of a session is home, its fence is gone: the primary again.
    await eventually(lifted, within=DEADLINE, every=0.2)
    assert await post(gw, sessions[0], 6) == 201
    metrics = await (await gw.get("/metrics")).text()
    assert f'sbgate_session_fences{{entity="{ENTITY}"}} 0.0' in metrics
    assert f"sbgate_session_fence_seconds_count {float(len(sessions))}" in metrics
    moved = await (await sy.get("/metrics")).text()
    assert 'sbgate_syphon_session_moves_total{outcome="moved"}' in moved
    assert 'sbgate_syphon_session_moves_total{outcome="failed"} 1.0' in moved
    assert 'sbgate_syphon_billed_operations_total{kind="complete"} 36.0' in moved
    assert "sbgate_syphon_management_reads_total" in moved
    assert 'sbgate_syphon_billed_operations_total{kind="depth_check"}' not in moved
    assert await receive_session(broker, sessions[0]) == [f"{sessions[0]}-6"]


async def test_availability_the_primary_takes_new_messages_first(
    gateway: GatewayFactory, control: ControlClient, broker: BrokerProcess
):
    """The same race without the fence: order is lost (so the strict test can fail)."""
    sessions = [f"avail-{i}" for i in range(3)]
    _, _, answers = await failback_race(gateway, control, "availability", sessions)
    for s in sessions:
        assert answers[s] == [202] * 3 + [201] * 3
        got = await receive_session(broker, s)
        assert sorted(got) == sorted(f"{s}-{n}" for n in range(6))
        assert got[:3] == [f"{s}-{n}" for n in range(3, 6)], "the newer ones arrived first"


async def test_a_session_stays_in_one_backlog_queue(
    gateway: GatewayFactory, control: ControlClient
):
    await session_queue(control)
    gw = await gateway({**BASE, "SBGATE_SESSION_ORDER": "strict"})
    await control.add_fault("primary", "amqp:internal-error", operation="send")
    sessions = [f"one-queue-{i}" for i in range(8)]
    for n in range(4):
        for s in sessions:
            assert await post(gw, s, n) == 202
    where: dict[str, set[str]] = {}
    for q in BACKLOGS:
        for m in await control.messages("secondary", q, limit=100):
            props = m.get("application_properties") or {}
            where.setdefault(str(props.get("x-ms-sessionid")), set()).add(q)
    assert set(where) == set(sessions)
    assert all(len(queues) == 1 for queues in where.values()), where
    assert len({q for qs in where.values() for q in qs}) > 1, "sessions spread over queues"
    shown = await fenced(gw)
    assert shown["count"] == len(sessions) and set(shown["sample"]) == set(sessions)


async def test_the_healthy_path_of_a_session_makes_no_redis_call(
    gateway: GatewayFactory, control: ControlClient, redis_server: RedisServer
):
    """Fences live in Redis, but a healthy session's send reads them from memory only."""
    await session_queue(control)
    gw = await gateway({**BASE, "SBGATE_REDIS_URL": redis_server.url})

    async def commands() -> dict[str, int]:
        async with Redis.from_url(redis_server.url, decode_responses=True) as r:
            async with asyncio.timeout(DEADLINE):
                stats = await r.info("commandstats")
        # Not counted: the subscriber's health pings, this client's own connection set-up.
        own = ("ping", "hello", "client")
        return {k: int(v["calls"]) for k, v in stats.items() if not any(o in k for o in own)}

    assert await post(gw, "warm", 0) == 201  # senders open, the replica synced
    before = await commands()
    for n in range(30):
        assert await post(gw, f"healthy-{n % 5}", n) == 201
    after = await commands()
    # The only new calls are this test's own INFO.
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        "cmdstat_info": 1
    }
