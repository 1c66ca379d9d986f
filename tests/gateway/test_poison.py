"""One bad message never hurts another (issue 21), end to end: the real SDK over AMQP
against the local broker. Each test reproduces one report; each failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any

import orjson
import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from gateway.config import NamespaceSettings, TimeoutSettings
from gateway.core.backlog import restore, rewrite
from gateway.core.message import OutboundMessage
from gateway.errors import INVALID_MESSAGE, MESSAGE_REFUSED, FailureKind, SendFailure
from gateway.metrics import Metrics
from gateway.secret import Secret
from gateway.servicebus.client import SdkNamespaceClient
from gateway.servicebus.internals.encoding import amqp_value
from sblocal.testing import BrokerProcess, ControlClient, ControlError
from tests.conftest import GatewayFactory
from tests.security.test_slow_clients import open_raw, read_response
from tests.support.waiting import eventually

FAILOVER = {
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_FAILOVER_INTERVAL": "10",
    "SBGATE_PING_PRIMARY_INTERVAL": "60",
    "SBGATE_BACKLOG_QUEUE_COUNT": "2",
    "SBGATE_SDK_RETRY_TOTAL": "0",
}


async def entity_states(gw) -> dict[str, str]:
    listing = await (await gw.get("/admin/entities")).json()
    return {e["entity"]: e["state"] for e in listing["entities"]}


async def test_a_non_ascii_content_type_is_400_at_the_edge(gateway: GatewayFactory, control):
    """Four of these took `orders` and every backlog queue down (amqp:decode-error counted
    as a service failure). The edge knows an AMQP symbol is ASCII: none reaches the broker."""
    gw = await gateway(FAILOVER)
    for _ in range(4):
        reader, writer = await open_raw(gw.server.port)
        writer.write(
            b"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\n"
            b"Content-Type: t\xc3\xa9xt/plain\r\n\r\nx"
        )
        status, body = await read_response(reader)
        writer.close()
        assert status == 400, body
        assert "ASCII" in orjson.loads(body)["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0
    assert (await entity_states(gw))["orders"] == "healthy"


async def test_a_reserved_header_is_400_and_never_stored(
    gateway: GatewayFactory, control: ControlClient
):
    gw = await gateway(FAILOVER)
    r = await gw.post(
        "/queues/orders/messages", data=b"x", headers={"X-MS-TimeToLive": "999999999999999999"}
    )
    assert r.status == 400
    body = await r.json()
    assert body["property"] == "X-MS-TimeToLive" and "reserved" in body["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0


# -- the message's fault: every row of the table that means "the message", from sblocal ----


async def send_direct(broker: BrokerProcess, path: str, messages: list[OutboundMessage]) -> None:
    """Send through the gateway's own adapter (no edge checks), as the syphon does."""
    ns = NamespaceSettings(
        name="primary", connection_string=Secret(broker.connection_string("primary"))
    )
    client = SdkNamespaceClient(ns, TimeoutSettings(sdk_retry_total=0))
    try:
        sender = await client.open_sender(path)
        try:
            await sender.send(messages)
        finally:
            await sender.close()
    finally:
        await client.close()


async def session_queue(control: ControlClient) -> str:
    """A queue that requires sessions (created once per broker session)."""
    with contextlib.suppress(ControlError):  # 409: an earlier test created it
        await control.create_entity("primary", "sessions", "queue", {"requires_session": True})
    return "sessions"


def msg(i: str, **kw: Any) -> OutboundMessage:
    return OutboundMessage(body=b"x", message_id=i, **kw)


MESSAGE_ROWS = [
    # (why, entity, the bad message, its row, its HTTP status)
    ("decode-error", "orders", msg("ct", content_type="t\u00e9xt/plain"), MESSAGE_REFUSED, 400),
    ("not-allowed", "sessions", msg("no-session"), MESSAGE_REFUSED, 400),
    ("too-large", "orders", OutboundMessage(body=b"x" * 300_000, message_id="big"), None, 413),
    ("invalid", "orders", msg("inv", session_id="s" * 129), INVALID_MESSAGE, 400),
]


@pytest.mark.parametrize(("why", "entity", "bad", "row", "status"), MESSAGE_ROWS)
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "in-a-batch"])
async def test_every_message_row_is_the_messages_fault_against_the_broker(
    broker, control, why, entity, bad, row, status, alone
):
    await session_queue(control)
    with pytest.raises(SendFailure) as info:
        await send_direct(broker, entity, [bad] if alone else [msg("good"), bad])
    c = info.value.classification
    assert c.message_fault and not c.counts_toward_failover and not c.transient, c
    assert (c is row) if row is not None else c.kind is FailureKind.MESSAGE_TOO_LARGE
    assert info.value.status == status


async def test_refused_messages_never_fail_an_entity_over(gateway: GatewayFactory, control):
    """A sessionless message to a session entity is refused (amqp:not-allowed): four of them
    are four 400s; the entity stays healthy (failover would engage at the first counting
    failure here) and every backlog queue stays in rotation."""
    await session_queue(control)
    gw = await gateway(
        {**FAILOVER, "SBGATE_FAILOVER_INTERVAL": "0", "SBGATE_ENTITIES": "queue:sessions"}
    )
    for i in range(4):
        r = await gw.post("/queues/sessions/messages", data=f"bad-{i}".encode())
        assert r.status == 400, await r.text()
        assert (await r.json())["error"] == "upstream_message_refused"
    r = await gw.post(
        "/queues/sessions/messages",
        data=b"good",
        headers={"BrokerProperties": '{"SessionId": "a"}'},
    )
    assert r.status == 201, await r.text()
    listing = (await (await gw.get("/admin/entities")).json())["entities"]
    [sessions] = listing
    assert sessions["state"] == "healthy"
    assert all(q["inRotation"] for q in sessions["backlogQueues"])


async def test_a_backlog_queue_refusing_a_message_stays_in_rotation(
    gateway: GatewayFactory, control
):
    gw = await gateway(FAILOVER)
    assert (await gw.post("/admin/entities/orders/failover")).status == 200
    await control.add_fault("secondary", "amqp:decode-error", operation="send", count=1)
    r = await gw.post("/queues/orders/messages", data=b"refused")
    assert r.status == 400, await r.text()
    assert (await r.json())["error"] == "upstream_message_refused"
    listing = (await (await gw.get("/admin/entities")).json())["entities"]
    orders = next(e for e in listing if e["entity"] == "orders")
    assert all(q["inRotation"] for q in orders["backlogQueues"]), orders
    r = await gw.post("/queues/orders/messages", data=b"next")
    assert r.status == 202, await r.text()


async def test_innocent_requests_batched_with_a_refused_one_are_stored(
    gateway: GatewayFactory, control
):
    """A sessionless message (PartitionKey only) shares a micro-batch with SessionId'd ones
    (the same key): the broker refuses the whole batch (amqp:not-allowed). Bisected, every
    innocent request is stored (201) and only the offender gets its 400."""
    await session_queue(control)
    metrics = Metrics()
    gw = await gateway(
        {
            **FAILOVER,
            "SBGATE_FAILOVER_INTERVAL": "0",
            "SBGATE_ENTITIES": "queue:sessions",
            "SBGATE_SENDERS_PER_ENTITY": "1",
        },
        metrics=metrics,
    )
    await control.set_latency("primary", store_ms=300)  # the first send holds the sender

    def post(props: dict[str, str]) -> Any:
        return gw.post(
            "/queues/sessions/messages",
            data=b"x",
            headers={"BrokerProperties": orjson.dumps(props).decode()},
        )

    first = asyncio.create_task(post({"SessionId": "p", "MessageId": "first"}))

    async def first_is_sending() -> bool:
        return (metrics.registry.get_sample_value("sbgate_broker_sends_in_flight") or 0) > 0

    await eventually(first_is_sending, within=10)
    props = [{"SessionId": "p", "MessageId": f"good-{i}"} for i in range(10)]
    props.insert(5, {"PartitionKey": "p", "MessageId": "bad"})
    answers = await asyncio.gather(first, *(post(p) for p in props))
    statuses = {
        p["MessageId"]: r.status
        for p, r in zip([{"MessageId": "first"}, *props], answers, strict=True)
    }
    assert statuses.pop("bad") == 400
    assert set(statuses.values()) == {201}, statuses
    assert (await control.entity("primary", "sessions"))["active"] >= 11
    splits = metrics.registry.get_sample_value("sbgate_batch_splits_total")
    assert splits is not None and splits > 0, "the bad one shared a batch, which was bisected"
    listing = (await (await gw.get("/admin/entities")).json())["entities"]
    assert listing[0]["state"] == "healthy"


# -- the syphon survives any message (item 4) ----------------------------------------------

SYPHON = {
    **FAILOVER,
    "SBGATE_ENABLE_SYPHON": "true",
    "SBGATE_BACKLOG_QUEUE_COUNT": "1",  # one queue: the poison and the innocent share it
    "SBGATE_SEND_TIMEOUT": "2",
    "SBGATE_RECEIVE_WAIT": "0.5",
    "SBGATE_IDLE_CHECK_INTERVAL": "3600",
}
BACKLOG = "primary/x-servicebus-transfer/0"
NOW = dt.datetime.now(dt.UTC)

POISON = {
    # The reported one: restore() raised OverflowError and the queue's task ended for good.
    "ttl-overflow": (
        {"x-ms-path": "orders", "x-ms-timetolive": 999999999999999999},
        "RestoreFailed",
    ),
    "ttl-type": ({"x-ms-path": "orders", "x-ms-timetolive": "forever"}, "RestoreFailed"),
    "schedule-range": (
        {"x-ms-path": "orders", "x-ms-scheduledenqueuetimeutc": 2**62},
        "RestoreFailed",
    ),
    "session-too-long": ({"x-ms-path": "orders", "x-ms-sessionid": "s" * 129}, "RestoreFailed"),
    "session-vs-partition": (
        {"x-ms-path": "orders", "x-ms-sessionid": "a", "x-ms-partitionkey": "b"},
        "RestoreFailed",
    ),
    # Item 3: the syphon must not write where x-ms-path says unless this gateway serves it.
    "not-served": ({"x-ms-path": "elsewhere"}, "RestoreFailed"),
    "a-backlog-queue": ({"x-ms-path": BACKLOG}, "RestoreFailed"),
    # Restorable, but the primary refuses it for its own sake (no SessionId for a session
    # entity): dead-lettered, not retried for ever.
    "refused-by-primary": ({"x-ms-path": "sessions"}, "RefusedByPrimary"),
    # A property no REST client can send: not a text, number or timestamp.
    "odd-property": ({"x-ms-path": "orders", "odd": [1, 2]}, "RestoreFailed"),
}


async def inject(broker: BrokerProcess, queue: str, message_id: str, props: dict[str, Any]) -> None:
    """What anyone with Send on the secondary namespace can write into a backlog queue."""
    conn = broker.connection_string("secondary")
    async with ServiceBusClient.from_connection_string(conn) as sb, sb.get_queue_sender(queue) as s:
        await s.send_messages(
            ServiceBusMessage(
                b"poison",
                message_id=message_id,
                application_properties={
                    "x-ms-acceptedtimeutc": NOW,
                    **{k: amqp_value(v) for k, v in props.items()},
                },
            )
        )


@pytest.mark.parametrize("case", sorted(POISON))
async def test_a_poison_message_in_a_backlog_never_strands_the_others(
    gateway: GatewayFactory, control, broker, case
):
    props, reason = POISON[case]
    await session_queue(control)
    with contextlib.suppress(ControlError):
        await control.create_entity("primary", "elsewhere", "queue")
    gw = await gateway({**SYPHON, "SBGATE_ENTITIES": "queue:orders,queue:sessions"})
    assert (await gw.post("/admin/entities/orders/failover")).status == 200
    await inject(broker, BACKLOG, "poison", props)
    r = await gw.post(
        "/queues/orders/messages",
        data=b"innocent",
        headers={"BrokerProperties": '{"MessageId": "innocent"}'},
    )
    assert r.status == 202 and (await r.json())["backlog"] == BACKLOG
    assert (await gw.post("/admin/entities/orders/healthy")).status == 200

    async def home() -> bool:
        orders = await control.entity("primary", "orders")
        backlog = await control.entity("secondary", BACKLOG)
        return orders["active"] == 1 and backlog["active"] == 0 and backlog["dead_letter"] == 1

    await eventually(home, within=20, every=0.1)
    [dead] = await control.messages("secondary", f"{BACKLOG}/$DeadLetterQueue")
    assert dead["message_id"] == "poison" and dead["dead_letter_reason"] == reason
    [arrived] = await control.messages("primary", "orders")
    assert arrived["message_id"] == "innocent"
    for other in ("elsewhere", "sessions"):
        assert (await control.entity("primary", other))["active"] == 0
    metrics = await (await gw.get("/metrics")).text()
    assert f'sbgate_syphon_dead_lettered_total{{reason="{reason}"}} 1.0' in metrics


def test_rewrite_keeps_no_client_property_named_like_its_own():
    """Defence in depth behind the edge's 400: what the syphon reads back is the gateway's."""
    m = OutboundMessage(
        body=b"x",
        message_id="m",
        application_properties={"X-MS-Path": "elsewhere", "x-ms-timetolive": 1, "ok": 1},
    )
    stored = rewrite(m, "orders", 0.0)
    assert "X-MS-Path" not in stored.application_properties
    assert stored.application_properties["x-ms-path"] == "orders"
    back = restore(stored, 1.0)
    assert back is not None and back.entity_path == "orders"
    assert back.message.time_to_live is None and back.message.application_properties == {"ok": 1}
