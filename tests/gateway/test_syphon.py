"""The syphon end to end: backlogged during an outage, moved home after recovery, through
the real SDK and the local broker."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import orjson
from azure.servicebus.aio import ServiceBusClient

from gateway.core.ports import Received
from gateway.errors import CONNECTION, SendFailure
from gateway.servicebus.client import SdkNamespaceClient
from gateway.servicebus.receiver import SdkBacklogPort
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually

SYPHON = {
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_ENABLE_SYPHON": "true",
    "SBGATE_FAILOVER_INTERVAL": "0",
    "SBGATE_PING_PRIMARY_INTERVAL": "0.2",
    "SBGATE_BACKLOG_QUEUE_COUNT": "2",
    "SBGATE_SDK_RETRY_TOTAL": "0",
    "SBGATE_SEND_TIMEOUT": "2",
    "SBGATE_RECEIVE_WAIT": "0.5",
    "SBGATE_IDLE_CHECK_INTERVAL": "3600",
}
BACKLOGS = ["primary/x-servicebus-transfer/0", "primary/x-servicebus-transfer/1"]


async def depth(control: ControlClient, ns: str, path: str, key: str = "active") -> int:
    return int((await control.entity(ns, path))[key])


async def backlog_total(control: ControlClient) -> int:
    return sum([await depth(control, "secondary", q) for q in BACKLOGS])


async def receive_all(
    broker: BrokerProcess, queue: str | None = None, sub: tuple[str, str] | None = None
) -> list[Any]:
    out: list[Any] = []
    async with ServiceBusClient.from_connection_string(broker.connection_string("primary")) as sb:
        r = sb.get_queue_receiver(queue) if queue else sb.get_subscription_receiver(*sub)  # type: ignore[misc]
        async with r:
            while batch := await r.receive_messages(max_message_count=50, max_wait_time=1):
                for m in batch:
                    await r.complete_message(m)
                out.extend(batch)
    return out


async def test_backlogged_messages_arrive_home_with_their_properties(
    gateway: GatewayFactory, control, broker
):
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw = await gateway(SYPHON)
    sent = []
    for i in range(10):
        props = {
            "MessageId": f"q-{i}",
            "SessionId": f"s-{i % 2}",
            "TimeToLive": 3600,
            "Label": "lbl",
            "CorrelationId": f"c-{i}",
        }
        r = await gw.post(
            "/queues/orders/messages",
            data=f"body-{i}".encode(),
            headers={
                "BrokerProperties": orjson.dumps(props).decode(),
                "Content-Type": "text/plain",
                "Tenant": '"t1"',
            },
        )
        assert r.status == 202, await r.text()
        sent.append(f"q-{i}")
    r = await gw.post(
        "/topics/events/messages", data=b"evt", headers={"BrokerProperties": '{"MessageId": "t-1"}'}
    )
    assert r.status == 202
    assert await backlog_total(control) == 11
    assert await depth(control, "primary", "orders") == 0

    await control.remove_fault("primary", fault)  # the pinger notices; the syphon follows

    async def drained() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", "orders") == 10

    await eventually(drained, within=20, every=0.1)

    got = {m.message_id: m for m in await receive_all(broker, "orders")}
    assert sorted(got) == sorted(sent)
    m = got["q-3"]
    assert m.session_id == "s-1" and m.subject == "lbl" and m.correlation_id == "c-3"
    assert m.content_type == "text/plain" and b"".join(m.body) == b"body-3"
    assert dt.timedelta(minutes=59) < m.time_to_live <= dt.timedelta(hours=1), "remaining TTL"
    app = {(k.decode() if isinstance(k, bytes) else k) for k in (m.application_properties or {})}
    assert app == {"Tenant"}, "the backlog properties are translated back, nothing else left"
    [evt] = await receive_all(broker, sub=("events", "audit"))
    assert evt.message_id == "t-1"
    metrics = await (await gw.get("/metrics")).text()
    assert 'sbgate_syphon_moved_total{entity="orders"} 10.0' in metrics


async def test_expired_messages_are_dead_lettered_in_the_backlog_never_sent(
    gateway: GatewayFactory, control
):
    await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw = await gateway({**SYPHON, "SBGATE_PING_PRIMARY_INTERVAL": "60"})
    r = await gw.post(
        "/orders/messages",
        data=b"short",
        headers={"BrokerProperties": '{"MessageId": "ttl-1", "TimeToLive": 0.5}'},
    )
    assert r.status == 202
    backlog = (await r.json())["backlog"]
    expires = time.time() + 0.5
    await eventually(lambda: time.time() > expires, within=5)
    await control.clear_faults("primary")
    assert (await gw.post("/admin/entities/orders/healthy")).status == 200

    async def dead_lettered() -> bool:
        return await depth(control, "secondary", backlog, "dead_letter") == 1

    await eventually(dead_lettered, within=15, every=0.1)
    [dlq] = await control.messages("secondary", f"{backlog}/$DeadLetterQueue")
    assert dlq["message_id"] == "ttl-1" and dlq["dead_letter_reason"] == "TTLExpiredException"
    assert await depth(control, "primary", "orders") == 0


async def test_two_syphons_drain_one_backlog_without_loss(gateway: GatewayFactory, control, broker):
    await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw1 = await gateway(
        {**SYPHON, "SBGATE_ENABLE_SYPHON": "false", "SBGATE_PING_PRIMARY_INTERVAL": "60"}
    )
    for i in range(120):
        r = await gw1.post(
            "/orders/messages",
            data=b"x",
            headers={"BrokerProperties": f'{{"MessageId": "two-{i}"}}'},
        )
        assert r.status == 202
    await control.clear_faults("primary")
    # Two more replicas whose syphons compete on the same backlog queues (peek-lock).
    await gateway({**SYPHON, "SBGATE_MAX_BATCH": "10"})
    await gateway({**SYPHON, "SBGATE_MAX_BATCH": "10"})

    async def drained() -> bool:
        return await depth(control, "primary", "orders") == 120

    await eventually(drained, within=30, every=0.2)
    ids = [m.message_id for m in await receive_all(broker, "orders")]
    assert sorted(ids) == sorted(f"two-{i}" for i in range(120))
    assert await backlog_total(control) == 0


async def test_primary_down_again_mid_drain_loses_nothing(gateway: GatewayFactory, control, broker):
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw = await gateway(
        {**SYPHON, "SBGATE_ENABLE_SYPHON": "false", "SBGATE_PING_PRIMARY_INTERVAL": "60"}
    )
    for i in range(60):
        assert (
            await gw.post(
                "/orders/messages",
                data=b"x",
                headers={"BrokerProperties": f'{{"MessageId": "mid-{i}"}}'},
            )
        ).status == 202
    await control.remove_fault("primary", fault)
    await gateway({**SYPHON, "SBGATE_MAX_BATCH": "5"})

    async def some_moved() -> bool:
        return await depth(control, "primary", "orders") > 0

    await eventually(some_moved, within=15, every=0.05)
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    await control.remove_fault("primary", fault)

    async def all_home() -> bool:
        return await depth(control, "primary", "orders") == 60

    await eventually(all_home, within=30, every=0.2)
    ids = sorted(m.message_id for m in await receive_all(broker, "orders"))
    assert ids == sorted(f"mid-{i}" for i in range(60))


class CompleteFailsOnce(SdkBacklogPort):
    """A syphon that 'crashes' between send and complete: the first complete is lost."""

    failed = 0

    async def complete(self, path: str, message: Received) -> None:
        if CompleteFailsOnce.failed == 0:
            CompleteFailsOnce.failed += 1
            raise SendFailure(CONNECTION, "lost")
        await super().complete(path, message)


async def test_a_lost_outcome_and_its_backlog_copy_are_stored_once_at_home(
    gateway: GatewayFactory, control, broker
):
    """The primary stored the message but its outcome never came back: the send timed out,
    so the gateway failed the entity over and wrote the message to a backlog queue too
    (202). Once the primary answers again, the syphon moves that copy home with its
    MessageId, and duplicate detection keeps one."""
    await control.create_entity(
        "primary", "lost-home", "queue", {"requires_duplicate_detection": True}
    )
    await control.add_fault(
        "primary", "amqp:internal-error", operation="send", mode="lose-outcome", count=1
    )
    backlogs = [f"lostns/x-servicebus-transfer/{i}" for i in range(2)]
    gw = await gateway(
        {
            **SYPHON,
            "SBGATE_ENTITIES": "queue:lost-home",
            "SBGATE_PRIMARY_NAME": "lostns",
            "SBGATE_SEND_TIMEOUT": "1",
            "SBGATE_SENDERS_PER_ENTITY": "1",
        }
    )
    resp = await gw.post(
        "/queues/lost-home/messages",
        data=b"once",
        headers={"BrokerProperties": '{"MessageId": "lost-1"}'},
    )
    assert resp.status == 202, await resp.text()

    async def moved_home() -> bool:
        depths = [await depth(control, "secondary", q) for q in backlogs]
        return sum(depths) == 0 and await depth(control, "primary", "lost-home", "sends") >= 2

    await eventually(moved_home, within=30, every=0.2)
    got = await receive_all(broker, "lost-home")
    assert [(m.message_id, b"".join(m.body)) for m in got] == [("lost-1", b"once")]


async def test_crash_between_send_and_complete_is_delivered_once_with_duplicate_detection(
    gateway: GatewayFactory, control, broker
):
    await control.create_entity("primary", "dedup", "queue", {"requires_duplicate_detection": True})
    # Fresh backlog paths (another primary name) with a short lock, so the unsettled message
    # comes back quickly: an existing backlog queue is used as it is.
    backlogs = [f"crashns/x-servicebus-transfer/{i}" for i in range(2)]
    for q in backlogs:
        await control.create_entity("secondary", q, "queue", {"lock_duration": 1})
    env = {**SYPHON, "SBGATE_ENTITIES": "queue:dedup", "SBGATE_PRIMARY_NAME": "crashns"}
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw = await gateway(
        {**env, "SBGATE_ENABLE_SYPHON": "false", "SBGATE_PING_PRIMARY_INTERVAL": "60"}
    )
    assert (
        await gw.post(
            "/dedup/messages", data=b"once", headers={"BrokerProperties": '{"MessageId": "once-1"}'}
        )
    ).status == 202
    await control.remove_fault("primary", fault)

    def port(ns: Any, client: Any) -> CompleteFailsOnce:
        assert isinstance(client, SdkNamespaceClient)
        return CompleteFailsOnce(client.sdk_client, ns)

    await gateway(env, backlog_factory=port)

    async def settled() -> bool:
        depths = [await depth(control, "secondary", q) for q in backlogs]
        return CompleteFailsOnce.failed == 1 and sum(depths) == 0

    await eventually(settled, within=30, every=0.2)
    got = await receive_all(broker, "dedup")
    assert [m.message_id for m in got] == ["once-1"]
    entity = await control.entity("primary", "dedup")
    assert entity["sends"] >= 2, "sent twice, stored once (duplicate detection)"


async def test_syphon_mode_serves_health_only_and_turns_unready_on_a_namespace_fault(
    gateway: GatewayFactory, control, broker
):
    from azure.servicebus import ServiceBusMessage

    from sblocal.testing import ControlError

    try:
        await control.create_entity("secondary", BACKLOGS[0], "queue")
    except ControlError:
        pass  # provisioned by an earlier test: used as it is
    async with ServiceBusClient.from_connection_string(broker.connection_string("secondary")) as sb:
        async with sb.get_queue_sender(BACKLOGS[0]) as s:  # something for the syphon to take
            await s.send_messages(
                ServiceBusMessage(b"x", application_properties={"x-ms-path": "orders"})
            )
    await control.add_fault("secondary", "amqp:link:detach-forced", operation="receive")
    gw = await gateway({**SYPHON, "SBGATE_FAULT_UNREADY_SECONDS": "60"}, mode="syphon")
    assert (await gw.post("/queues/orders/messages", data=b"x")).status == 404
    assert (await gw.get("/metrics")).status == 200

    async def unready() -> bool:
        r = await gw.get("/readyz")
        return r.status == 503 and (await r.json())["status"] == "namespace fault"

    await eventually(unready, within=15, every=0.1)
    await control.clear_faults("secondary")
