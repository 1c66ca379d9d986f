"""The AMQP edge end to end: the real Python SDK (7.15.0), unmodified, given only a
connection string that names the gateway, sends through it to the local broker.

The gateway runs in process (`create_app`, the production runner); the SDK dials its plain
listener (``UseDevelopmentEmulator=true``). Every SDK call is under a deadline: a protocol
mismatch shows as a client that waits forever, and must fail the test instead.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusError,
    ServiceBusServerBusyError,
)

from gateway.app import AMQP_SERVER
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_ledger_wiring import read_events
from tests.gateway.test_poison import session_queue
from tests.gateway.test_syphon import SYPHON, backlog_total, depth, receive_all
from tests.support.processes import GatewayProcess, broker_env, free_port
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEND_KEY = "c2VuZGVyLWtleS1mb3ItdGVzdHMtb25seS0wMDAwMDAwMDA="
OTHER_KEY = "b3RoZXIta2V5LWZvci10ZXN0cy1vbmx5LTAwMDAwMDAwMDA="
RULES = json.dumps(
    {
        "rules": [
            {"name": "sender", "primary_key": SEND_KEY, "rights": ["Send"], "entities": ["*"]},
            {
                "name": "orders-only",
                "primary_key": OTHER_KEY,
                "rights": ["Send"],
                "entities": ["orders"],
            },
        ]
    }
)
AUTH = {"SBGATE_AUTH_RULES": RULES, "SBGATE_PUBLIC_HOSTS": "localhost"}
DEADLINE = 30.0  # every SDK call; the gateway answers within admission + send timeouts

Connect = Callable[..., Awaitable[str]]


def connection_string(port: int, key_name: str = "sender", key: str = SEND_KEY) -> str:
    return (
        f"Endpoint=sb://localhost:{port};SharedAccessKeyName={key_name};"
        f"SharedAccessKey={key};UseDevelopmentEmulator=true"
    )


@pytest.fixture
async def amqp_gateway(gateway: GatewayFactory) -> AsyncIterator[Connect]:
    """Start a gateway with the AMQP plain listener; returns its connection string."""

    async def start(env: dict[str, str] | None = None, **kw: Any) -> str:
        gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH, **(env or {})})
        port = gw.app[AMQP_SERVER].ports["plain"]
        return connection_string(port, **kw)

    yield start


async def send(conn: str, entity: str, messages: Any, *, topic: bool = False) -> None:
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            sender = sb.get_topic_sender(entity) if topic else sb.get_queue_sender(entity)
            async with sender:
                await sender.send_messages(messages)


async def receive(broker: BrokerProcess, count: int, queue: str = "orders") -> list[Any]:
    out: list[ServiceBusReceivedMessage] = []

    async def enough() -> bool:
        out.extend(await receive_all(broker, queue))
        return len(out) >= count

    await eventually(enough, within=20, every=0.2)
    assert len(out) == count
    return out


async def test_a_single_message_arrives_with_its_properties(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    sent = ServiceBusMessage(
        b"hello",
        message_id="m-1",
        correlation_id="c-1",
        subject="greeting",
        content_type="text/plain",
        time_to_live=dt.timedelta(hours=1),
        application_properties={"tenant": "t1", "n": 7, "ratio": 0.5, "ok": True},
    )
    await send(conn, "orders", sent)
    [got] = await receive(broker, 1)
    assert got.message_id == "m-1" and got.correlation_id == "c-1"
    assert got.subject == "greeting" and got.content_type == "text/plain"
    assert b"".join(got.body) == b"hello"
    assert got.time_to_live == dt.timedelta(hours=1)
    props = {k.decode(): v for k, v in (got.application_properties or {}).items()}
    assert props == {"tenant": b"t1", "n": 7, "ratio": 0.5, "ok": True}


async def test_a_list_and_a_batch_arrive_whole(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    await send(conn, "orders", [ServiceBusMessage(f"l-{i}", message_id=f"l-{i}") for i in range(5)])
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                batch = await sender.create_message_batch()
                for i in range(20):
                    batch.add_message(ServiceBusMessage(f"b-{i}", message_id=f"b-{i}"))
                await sender.send_messages(batch)
    got = await receive(broker, 25)
    assert sorted(m.message_id for m in got) == sorted(
        [f"l-{i}" for i in range(5)] + [f"b-{i}" for i in range(20)]
    )


async def test_concurrent_sends_on_one_sender_never_run_out_of_credit(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient, monkeypatch: Any
) -> None:
    # An app's tasks sharing one Python sender send at once. When the SDK's link runs out of
    # credit it stops waiting for the receiver's FLOW: it resets its own count, writes a FLOW
    # of its own (`SenderLink.update_pending_deliveries`) and its sends then wait out its
    # 0.2 s socket reads, up to seconds a send. Service Bus grants a sender 1,000; a gateway
    # that grants fewer than the app has in flight puts its SDK on that path.
    from azure.servicebus._pyamqp.aio._sender_async import SenderLink

    ran_out: list[int] = []
    update = SenderLink.update_pending_deliveries

    async def watched(self: SenderLink) -> None:
        if self.current_link_credit <= 0:  # the SDK is about to send past the credit
            ran_out.append(self.current_link_credit)
        await update(self)

    monkeypatch.setattr(SenderLink, "update_pending_deliveries", watched)
    conn = await amqp_gateway()
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                for r in range(3):
                    await asyncio.gather(
                        *(
                            sender.send_messages(ServiceBusMessage(b"x", message_id=f"{r}-{i}"))
                            for i in range(50)
                        )
                    )
    assert ran_out == [], "the sender ran out of credit"
    got = await receive(broker, 150)
    assert len({m.message_id for m in got}) == 150


async def test_a_topic_send_reaches_its_subscription(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    await send(conn, "events", ServiceBusMessage(b"evt", message_id="e-1"), topic=True)
    [got] = await receive_all(broker, sub=("events", "audit"))
    assert got.message_id == "e-1"


async def test_an_unknown_entity_raises_not_found(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    with pytest.raises(MessagingEntityNotFoundError):
        await send(conn, "nope", ServiceBusMessage(b"x"))


async def test_a_wrong_key_raises_an_authentication_error(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway(key=OTHER_KEY)  # "sender" signed with another key
    with pytest.raises(ServiceBusAuthenticationError):
        await send(conn, "orders", ServiceBusMessage(b"x"))


async def test_a_key_for_another_entity_raises_an_authorization_error(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway(key_name="orders-only", key=OTHER_KEY)
    await send(conn, "orders", ServiceBusMessage(b"allowed"))
    with pytest.raises(ServiceBusAuthorizationError):
        await send(conn, "events", ServiceBusMessage(b"x"), topic=True)
    assert await depth(control, "primary", "orders") == 1


async def test_a_message_over_the_limit_raises_size_exceeded(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway({"SBGATE_MAX_MESSAGE_BYTES": "2048"})
    with pytest.raises(MessageSizeExceededError):
        await send(conn, "orders", ServiceBusMessage(b"x" * 4000))


async def test_a_receiver_is_refused_clearly(amqp_gateway: Connect, control: ControlClient) -> None:
    conn = await amqp_gateway()
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            with pytest.raises(ServiceBusError, match="only accepts senders"):
                async with sb.get_queue_receiver("orders") as receiver:
                    await receiver.receive_messages(max_wait_time=1)


async def test_scheduling_goes_to_the_primary_with_its_sequence_numbers(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    when = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                numbers = await sender.schedule_messages(
                    [ServiceBusMessage(b"a", message_id="s-a"), ServiceBusMessage(b"b")], when
                )
                assert len(numbers) == 2 and all(isinstance(n, int) for n in numbers)
                assert (await control.entity("primary", "orders"))["scheduled"] == 2
                await sender.cancel_scheduled_messages(numbers[0])
                assert (await control.entity("primary", "orders"))["scheduled"] == 1
                # A scheduled enqueue time on a plain send is carried (failover-capable).
                await sender.send_messages(
                    ServiceBusMessage(b"later", message_id="s-1", scheduled_enqueue_time_utc=when)
                )
    assert (await control.entity("primary", "orders"))["scheduled"] == 2


async def test_while_failed_over_scheduling_is_server_busy_and_sending_is_not(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    await control.add_fault("primary", "amqp:internal-error", operation="send")
    conn = await amqp_gateway(SYPHON)
    when = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages(
                    ServiceBusMessage(b"later", message_id="s-2", scheduled_enqueue_time_utc=when)
                )  # to a backlog queue: the entity fails over
                with pytest.raises(ServiceBusServerBusyError):
                    await sender.schedule_messages(ServiceBusMessage(b"x"), when)
    assert await backlog_total(control) == 1


async def test_other_management_operations_are_refused_clearly(
    amqp_gateway: Connect, control: ControlClient
) -> None:
    conn = await amqp_gateway()
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            with pytest.raises(ServiceBusError, match="only accepts senders"):
                async with sb.get_queue_receiver("orders") as receiver:
                    await receiver.peek_messages()


async def test_with_the_primary_down_sends_return_and_arrive_home_once_intact(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    conn = await amqp_gateway(SYPHON)
    ids = [str(uuid.uuid4()) for _ in range(6)]
    tag = uuid.uuid4()  # an AMQP uuid: carried with its type through the backlog queue
    props = {"tenant": "t1", "n": 7, "ratio": 0.25, "ok": False, "tag": tag}
    for i, mid in enumerate(ids[:3]):
        await send(
            conn,
            "orders",
            ServiceBusMessage(
                f"body-{i}",
                message_id=mid,
                session_id=None,
                subject="lbl",
                correlation_id=f"c-{i}",
                content_type="text/plain",
                time_to_live=dt.timedelta(hours=1),
                application_properties=props,
            ),
        )
    await send(
        conn, "orders", [ServiceBusMessage(f"body-{i}", message_id=ids[i]) for i in range(3, 6)]
    )
    assert await backlog_total(control) == 6 and await depth(control, "primary", "orders") == 0

    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", "orders") == 6

    await eventually(home, within=30, every=0.2)
    got = {m.message_id: m for m in await receive(broker, 6)}
    assert sorted(got) == sorted(ids), "each message home once"
    m = got[ids[1]]
    assert b"".join(m.body) == b"body-1" and m.subject == "lbl" and m.correlation_id == "c-1"
    assert m.content_type == "text/plain"
    assert dt.timedelta(minutes=59) < m.time_to_live <= dt.timedelta(hours=1)
    app = {k.decode(): v for k, v in (m.application_properties or {}).items()}
    assert app == {"tenant": b"t1", "n": 7, "ratio": 0.25, "ok": False, "tag": tag}


async def test_shutdown_drains_under_load_and_no_acknowledged_send_is_lost(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
) -> None:
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AUTH})
    conn = connection_string(gw.app[AMQP_SERVER].ports["plain"])
    acknowledged: list[str] = []
    failures: list[BaseException] = []
    started = asyncio.Event()

    async def sender_loop(n: int) -> None:
        try:
            async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
                async with sb.get_queue_sender("orders") as sender:
                    for i in range(1000):
                        mid = f"d-{n}-{i}"
                        await sender.send_messages(ServiceBusMessage(b"x", message_id=mid))
                        acknowledged.append(mid)
                        started.set()
        except ServiceBusError as exc:  # the drain's connection:forced, or a refused connect
            failures.append(exc)

    async with asyncio.timeout(DEADLINE):
        loops = [asyncio.create_task(sender_loop(n)) for n in range(4)]
        try:
            await started.wait()
            await gw.close()  # the app's cleanup: the AMQP edge drains before the router
            await asyncio.gather(*loops)
        finally:
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
    assert failures, "the senders saw the gateway go away"
    stored = {m.message_id for m in await receive_all(broker, "orders")}
    assert set(acknowledged) <= stored, "every acknowledged send was stored"


async def test_gateway_serve_takes_an_sdk_sender_on_its_own_event_loop(
    broker: BrokerProcess, control: ControlClient, tmp_path: Path
) -> None:
    """`gateway serve` as deployed (a process, uvloop when installed), stopped by SIGTERM."""
    amqp_port = free_port()
    env = broker_env(broker, SBGATE_AMQP_PLAIN_PORT=str(amqp_port), SBGATE_DRAIN_DELAY="0", **AUTH)
    async with GatewayProcess("gateway", env, port=free_port(), log_dir=tmp_path) as gw:
        await send(
            connection_string(amqp_port), "orders", ServiceBusMessage(b"p", message_id="p-1")
        )
        gw.terminate()
        assert await gw.wait(30) == 0
    assert b"Traceback" not in gw.output(), gw.tail()
    [got] = await receive(broker, 1)
    assert got.message_id == "p-1"


async def test_a_session_enabled_queue_gets_its_session_ids_directly_and_through_a_backlog(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    queue = await session_queue(control)
    conn = await amqp_gateway({**SYPHON, "SBGATE_ENTITIES": f"queue:orders,queue:{queue}"})
    await send(conn, queue, ServiceBusMessage(b"1", message_id="ss-1", session_id="s-a"))
    # A message without a SessionId is the broker's refusal, passed on as its own condition.
    with pytest.raises(ServiceBusError):
        await send(conn, queue, ServiceBusMessage(b"3", message_id="ss-3"))
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    await send(conn, queue, ServiceBusMessage(b"2", message_id="ss-2", session_id="s-b"))
    assert await backlog_total(control) == 1
    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", queue) == 2

    await eventually(home, within=30, every=0.2)
    stored = {m["message_id"]: m for m in await control.messages("primary", queue)}
    assert {k: m["session_id"] for k, m in stored.items()} == {"ss-1": "s-a", "ss-2": "s-b"}


async def test_deliveries_reach_the_ledger_as_requests_do(
    amqp_gateway: Connect, control: ControlClient, tmp_path: Path
) -> None:
    """What the audit pipeline reconciles: an accepted event per stored message, whatever
    the edge."""
    ledger = tmp_path / "ledger"
    conn = await amqp_gateway({"SBGATE_LEDGER": str(ledger), "SBGATE_REPLICA_ID": "gw-amqp"})
    await send(conn, "orders", [ServiceBusMessage(b"1", message_id=f"led-{i}") for i in range(3)])

    def events() -> list[dict[str, Any]]:
        return read_events(ledger) if ledger.exists() else []

    await eventually(lambda: len(events()) >= 3, within=10)
    accepted = sorted(e["message_id"] for e in events() if e["event"] == "accepted")
    assert accepted == ["led-0", "led-1", "led-2"]
    assert all(e["route"] == "primary" for e in events() if e["event"] == "accepted")
