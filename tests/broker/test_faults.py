"""Injected faults surface in the SDK as the exceptions docs/design.md#errors-the-sdk-raises
lists."""

from __future__ import annotations

import asyncio
import time

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import (
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from sblocal.entities import QueueProperties
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.support.waiting import no_hang

from .conftest import receive_n, sb_client

CONDITIONS = [
    ("amqp:not-found", MessagingEntityNotFoundError),
    ("com.microsoft:server-busy", ServiceBusServerBusyError),
    ("com.microsoft:timeout", OperationTimeoutError),
    ("amqp:internal-error", ServiceBusError),
    ("com.microsoft:entity-disabled", MessagingEntityDisabledError),
    ("amqp:unauthorized-access", ServiceBusAuthorizationError),
    ("amqp:resource-limit-exceeded", ServiceBusQuotaExceededError),
    ("amqp:link:detach-forced", ServiceBusConnectionError),
]


async def test_every_rejected_send_condition_maps_to_its_sdk_exception(
    broker: LocalBroker, control: ControlClient
) -> None:
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            for condition, exc_type in CONDITIONS:
                await control.add_fault(
                    "primary", condition, operation="send", entity="orders", count=1
                )
                with pytest.raises(exc_type) as info:
                    await sender.send_messages(ServiceBusMessage("x"))
                assert type(info.value) is exc_type or condition == "amqp:internal-error", (
                    condition,
                    type(info.value),
                )
                # The same sender recovers once the rule is used up.
                await sender.send_messages(ServiceBusMessage("ok"))
    counters = await control.counters("primary")
    assert counters["faults_applied"] == len(CONDITIONS)
    assert (await control.entity("primary", "orders"))["active"] == len(CONDITIONS)


async def test_fault_until_cleared_and_scoped_to_one_entity(
    broker: LocalBroker, control: ControlClient
) -> None:
    rule = await control.add_fault("primary", "com.microsoft:server-busy", entity="orders")
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            for _ in range(3):
                with pytest.raises(ServiceBusServerBusyError):
                    await sender.send_messages(ServiceBusMessage("x"))
            async with client.get_topic_sender("events") as other:
                await other.send_messages(ServiceBusMessage("unaffected"))
            [listed] = await control.faults("primary")
            assert listed["id"] == rule and listed["hits"] == 3 and listed["count"] is None
            await control.remove_fault("primary", rule)
            await sender.send_messages(ServiceBusMessage("x"))


@pytest.mark.slow  # waits out a hung send
@pytest.mark.parametrize(("mode", "stored"), [("hang", 0), ("lose-outcome", 1)])
async def test_hang_and_lose_outcome_accept_the_transfer_and_never_settle(
    broker: LocalBroker, control: ControlClient, mode: str, stored: int
) -> None:
    """`hang` stores nothing; `lose-outcome` stores the message, as when a connection fails
    after Service Bus stored it: either way the sender cannot tell."""
    await control.add_fault("primary", "amqp:internal-error", operation="send", mode=mode, count=1)
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await sender.send_messages(ServiceBusMessage("sent", message_id="m-1"))
        assert (await control.entity("primary", "orders"))["active"] == stored
        async with client.get_queue_receiver("orders") as receiver:
            got = await receive_n(receiver, stored)
    assert [(m.message_id, b"".join(m.body)) for m in got] == [("m-1", b"sent")] * stored
    assert (await control.counters("primary"))["faults_applied"] == 1


async def test_detach_mode_detaches_the_sender_link(
    broker: LocalBroker, control: ControlClient
) -> None:
    await control.add_fault(
        "primary", "amqp:link:detach-forced", operation="send", mode="detach", count=1
    )
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            with pytest.raises(ServiceBusError):
                async with asyncio.timeout(10):
                    await sender.send_messages(ServiceBusMessage("x"))
            await sender.send_messages(ServiceBusMessage("after"))  # reattaches
    assert (await control.entity("primary", "orders"))["active"] == 1


async def test_receive_fault_detaches_the_receiver(
    broker: LocalBroker, control: ControlClient
) -> None:
    await control.add_fault(
        "primary", "com.microsoft:entity-disabled", operation="receive", entity="orders", count=1
    )
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_receiver("orders") as receiver:
            with pytest.raises(MessagingEntityDisabledError):
                await receiver.receive_messages(max_message_count=1, max_wait_time=2)


@pytest.mark.slow  # waits out injected latency
async def test_latency_delays_settlement_without_blocking_the_broker(
    broker: LocalBroker, control: ControlClient
) -> None:
    await control.set_latency("primary", round_trip_ms=150, store_ms=50)
    async with (
        sb_client(broker.connection_string("primary")) as client,
        sb_client(broker.connection_string("secondary")) as other_client,
        client.get_queue_sender("orders") as sender,
    ):
        start = time.monotonic()
        await sender.send_messages(ServiceBusMessage("slow"))
        assert time.monotonic() - start >= 0.19
        broker.namespace("secondary").create_queue("q", QueueProperties())
        async with other_client.get_queue_sender("q") as other:
            await other.send_messages(ServiceBusMessage("warm"))
            # While a 3 s settlement is pending, the reactor still serves everyone else: the
            # other send completes while the slow one is still waiting.
            await control.set_latency("primary", round_trip_ms=3000)
            slow = asyncio.create_task(sender.send_messages(ServiceBusMessage("slower")))
            try:
                await other.send_messages(ServiceBusMessage("fast"))
                assert not slow.done()
            finally:
                await slow
        await control.set_latency("primary", 0, 0)
        await sender.send_messages(ServiceBusMessage("fast"))


async def test_namespace_down_then_up_the_same_client_reconnects(
    broker: LocalBroker, control: ControlClient
) -> None:
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(ServiceBusMessage("before"))
            await control.down("primary")
            assert (await control.namespaces())["namespaces"]["primary"]["up"] is False
            async with no_hang("a send to a namespace that is down"):
                with pytest.raises(ServiceBusConnectionError):
                    await sender.send_messages(ServiceBusMessage("during"))
            # The other namespace is unaffected.
            async with sb_client(broker.connection_string("secondary")) as other:
                assert other is not None
            await control.up("primary")
            await sender.send_messages(ServiceBusMessage("after"))
    info = await control.entity("primary", "orders")
    assert info["active"] == 2


@pytest.mark.slow  # waits for the SDK to reconnect
async def test_drop_connections_forces_a_reconnect(
    broker: LocalBroker, control: ControlClient
) -> None:
    async with sb_client(broker.connection_string("primary"), retry_total=2) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(ServiceBusMessage("one"))
            assert await control.drop_connections("primary") == 1
            await sender.send_messages(ServiceBusMessage("two"))  # the SDK retries/reconnects
        async with client.get_queue_receiver("orders") as receiver:
            msgs = await receive_n(receiver, 2)
            for m in msgs:
                await receiver.complete_message(m)
    counters = await control.counters("primary")
    assert counters["connections"] >= 3


async def test_disabled_entity_status_rejects_sends(broker: LocalBroker) -> None:
    import dataclasses

    ns = broker.namespace("primary")
    props = ns.get_queue("orders")
    assert props is not None
    ns.update_queue("orders", dataclasses.replace(props, status="Disabled"))
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            with pytest.raises(MessagingEntityDisabledError):
                await sender.send_messages(ServiceBusMessage("x"))


async def test_wrong_sas_key_is_rejected(broker: LocalBroker) -> None:
    good = broker.connection_string("primary")
    bad = good.replace("SharedAccessKey=", "SharedAccessKey=AAAA")
    async with sb_client(bad) as client:
        async with asyncio.timeout(20):
            # $cbs answers 401 (like Service Bus): the SDK raises an authentication error.
            with pytest.raises(ServiceBusAuthenticationError):
                async with client.get_queue_sender("orders") as sender:
                    await sender.send_messages(ServiceBusMessage("x"))
    assert broker.namespace("primary").counters.cbs_rejected >= 1
    assert broker.namespace("primary").counters.messages_received == 0


@pytest.mark.slow  # waits out a hung receive
async def test_receive_hang_delivers_nothing_until_a_new_link(
    broker: LocalBroker, control: ControlClient
) -> None:
    await control.add_fault("primary", "amqp:internal-error", operation="receive", mode="hang")
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(ServiceBusMessage("waiting"))
        async with client.get_queue_receiver("orders") as receiver:
            assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.5) == []
        await control.clear_faults("primary")
        async with client.get_queue_receiver("orders") as receiver:
            [m] = await receive_n(receiver, 1)
            assert m.delivery_count == 0
            await receiver.complete_message(m)
