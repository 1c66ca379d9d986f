"""The unmodified async azure-servicebus SDK against the broker, over real sockets."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusMessageState,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusError,
)

from sblocal.entities import QueueProperties, SubscriptionProperties
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient, eventually
from tests.support.waiting import eventually as wait_until

from .conftest import receive_n, sb_client


def full_message(i: int) -> ServiceBusMessage:
    return ServiceBusMessage(
        f"body-{i}",
        message_id=f"mid-{i}",
        correlation_id=f"cid-{i}",
        subject=f"subject-{i}",
        reply_to="replies",
        reply_to_session_id=f"rs-{i}",
        to=f"to-{i}",
        content_type="application/json",
        time_to_live=dt.timedelta(minutes=30),
        application_properties={
            "s": f"text-{i}",
            "i": i,
            "f": 1.5,
            "b": True,
            "bin": b"\x00\x01",
        },
    )


def assert_round_trip(received: object, i: int) -> None:
    m = received
    assert str(m) == f"body-{i}"
    assert m.message_id == f"mid-{i}"  # type: ignore[attr-defined]
    assert m.correlation_id == f"cid-{i}"  # type: ignore[attr-defined]
    assert m.subject == f"subject-{i}"  # type: ignore[attr-defined]
    assert m.reply_to == "replies"  # type: ignore[attr-defined]
    assert m.reply_to_session_id == f"rs-{i}"  # type: ignore[attr-defined]
    assert m.to == f"to-{i}"  # type: ignore[attr-defined]
    assert m.content_type == "application/json"  # type: ignore[attr-defined]
    assert m.time_to_live == dt.timedelta(minutes=30)  # type: ignore[attr-defined]
    props = m.application_properties  # type: ignore[attr-defined]
    assert props[b"s"] == f"text-{i}".encode()
    assert props[b"i"] == i
    assert props[b"f"] == 1.5
    assert props[b"b"] is True
    assert props[b"bin"] == b"\x00\x01"
    assert m.sequence_number >= 1  # type: ignore[attr-defined]
    assert m.enqueued_time_utc is not None  # type: ignore[attr-defined]


async def test_single_list_and_batch_sends_round_trip_every_property(
    client: ServiceBusClient,
) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(full_message(0))
        await sender.send_messages([full_message(1), full_message(2)])
        batch = await sender.create_message_batch()
        for i in range(3, 6):
            batch.add_message(full_message(i))
        await sender.send_messages(batch)
    async with client.get_queue_receiver("orders") as receiver:
        msgs = await receive_n(receiver, 6)
        for i, m in enumerate(sorted(msgs, key=lambda m: m.sequence_number)):
            assert_round_trip(m, i)
            assert m.delivery_count == 0
            assert m.lock_token is not None
            assert m.locked_until_utc is not None
            await receiver.complete_message(m)


async def test_session_id_partition_key_and_scheduled_time_round_trip(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_queue("sessions", QueueProperties(requires_session=True))
    at = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    msg = ServiceBusMessage(
        "s", session_id="sess-1", partition_key="sess-1", scheduled_enqueue_time_utc=at
    )
    async with client.get_queue_sender("sessions") as sender:
        await sender.send_messages(msg)
    ns = broker.namespace("primary")
    entity = ns.receive_source("sessions")
    assert entity is not None
    [stored] = ns.peek(entity, 0, 10)
    assert stored.session_id == "sess-1"
    # Read it back through the session receiver's peek (state scheduled).
    async with client.get_queue_receiver("sessions", session_id="sess-1") as receiver:
        [peeked] = await receiver.peek_messages(5)
    assert peeked.session_id == "sess-1"
    assert peeked.partition_key == "sess-1"
    assert peeked.state == ServiceBusMessageState.SCHEDULED
    assert peeked.scheduled_enqueue_time_utc is not None
    assert abs((peeked.scheduled_enqueue_time_utc - at).total_seconds()) < 0.01


async def test_peek_lock_renew_and_complete(broker: LocalBroker, client: ServiceBusClient) -> None:
    broker.namespace("primary").create_queue(
        "short-lock", QueueProperties(lock_duration=dt.timedelta(seconds=5))
    )
    async with client.get_queue_sender("short-lock") as sender:
        await sender.send_messages(ServiceBusMessage("x"))
    async with client.get_queue_receiver("short-lock") as receiver:
        [m] = await receive_n(receiver, 1)
        first = m.locked_until_utc
        assert first is not None
        # A renewal is visible once the wall clock has moved past the lock's start (the
        # broker stamps milliseconds): wait for that, not for a fixed time.
        locked_at = first - dt.timedelta(seconds=5)
        await wait_until(
            lambda: dt.datetime.now(dt.UTC) - locked_at > dt.timedelta(milliseconds=2), every=0.001
        )
        renewed = await receiver.renew_message_lock(m)
        assert renewed > first
        await receiver.complete_message(m)
        assert await receiver.peek_messages(5) == []
    counters = broker.namespace("primary").counters.snapshot()
    assert counters["completes"] == 1
    assert counters["lock_renewals"] == 1


async def test_abandon_redelivers_with_delivery_count_plus_one(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(ServiceBusMessage("again", message_id="a1"))
    async with client.get_queue_receiver("orders") as receiver:
        [m] = await receive_n(receiver, 1)
        assert m.delivery_count == 0
        await receiver.abandon_message(m)
        [again] = await receive_n(receiver, 1)
        assert again.message_id == "a1"
        assert again.delivery_count == 1
        assert again.sequence_number == m.sequence_number
        await receiver.complete_message(again)


async def test_dead_letter_with_reason_is_received_from_the_dlq(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(ServiceBusMessage("bad", message_id="dl1"))
    async with client.get_queue_receiver("orders") as receiver:
        [m] = await receive_n(receiver, 1)
        await receiver.dead_letter_message(m, reason="poison", error_description="cannot parse")
    async with client.get_queue_receiver("orders", sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        [d] = await receive_n(dlq, 1)
        assert d.message_id == "dl1"
        assert d.dead_letter_reason == "poison"
        assert d.dead_letter_error_description == "cannot parse"
        await dlq.complete_message(d)


async def test_max_delivery_count_moves_the_message_to_the_dlq(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_queue("fragile", QueueProperties(max_delivery_count=2))
    async with client.get_queue_sender("fragile") as sender:
        await sender.send_messages(ServiceBusMessage("x", message_id="f1"))
    async with client.get_queue_receiver("fragile") as receiver:
        for _ in range(2):
            [m] = await receive_n(receiver, 1)
            await receiver.abandon_message(m)
        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
    async with client.get_queue_receiver(
        "fragile", sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as dlq:
        [d] = await receive_n(dlq, 1)
        assert d.dead_letter_reason == "MaxDeliveryCountExceeded"
        assert d.delivery_count == 2
        await dlq.complete_message(d)


async def test_lock_expiry_redelivers(broker: LocalBroker, client: ServiceBusClient) -> None:
    broker.namespace("primary").create_queue(
        "expiring-lock", QueueProperties(lock_duration=dt.timedelta(milliseconds=200))
    )
    async with client.get_queue_sender("expiring-lock") as sender:
        await sender.send_messages(ServiceBusMessage("x"))
    async with client.get_queue_receiver("expiring-lock") as receiver:
        [m] = await receive_n(receiver, 1)
        [again] = await receive_n(receiver, 1, timeout=5)  # after the lock lapsed
        assert again.delivery_count == 1
        with pytest.raises(MessageLockLostError):
            await receiver.complete_message(m)
        await receiver.complete_message(again)


async def test_defer_then_receive_deferred_and_complete(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(ServiceBusMessage("later", message_id="d1"))
    async with client.get_queue_receiver("orders") as receiver:
        [m] = await receive_n(receiver, 1)
        seq = m.sequence_number
        await receiver.defer_message(m)
        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
        [peeked] = await receiver.peek_messages(5, sequence_number=1)
        assert peeked.state == ServiceBusMessageState.DEFERRED
        [deferred] = await receiver.receive_deferred_messages([seq])
        assert deferred.message_id == "d1"
        assert deferred.lock_token is not None
        await receiver.complete_message(deferred)
        assert await receiver.peek_messages(5, sequence_number=1) == []


async def test_receive_and_delete(broker: LocalBroker, client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages([ServiceBusMessage(f"r{i}") for i in range(3)])
    async with client.get_queue_receiver(
        "orders", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    ) as receiver:
        msgs = await receive_n(receiver, 3)
        assert sorted(str(m) for m in msgs) == ["r0", "r1", "r2"]
        assert all(m.lock_token is None for m in msgs)
    entity = broker.namespace("primary").receive_source("orders")
    assert entity is not None and entity.messages == {}


async def test_peek_does_not_lock_or_remove(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(
            [ServiceBusMessage(f"p{i}", message_id=f"p{i}") for i in range(3)]
        )
    async with client.get_queue_receiver("orders") as receiver:
        first = await receiver.peek_messages(2)
        assert [m.message_id for m in first] == ["p0", "p1"]
        rest = await receiver.peek_messages(5)  # continues after the last peeked
        assert [m.message_id for m in rest] == ["p2"]
        msgs = await receive_n(receiver, 3)
        for m in msgs:
            await receiver.complete_message(m)


async def test_schedule_and_cancel(broker: LocalBroker, client: ServiceBusClient) -> None:
    # Opening the management link takes ~0.5 s: leave room to see all three scheduled.
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.5)
    far = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    async with client.get_queue_sender("orders") as sender:
        [seq_soon] = await sender.schedule_messages(ServiceBusMessage("soon"), soon)
        seq_far = await sender.schedule_messages(
            [ServiceBusMessage("far1"), ServiceBusMessage("far2")], far
        )
        assert len(seq_far) == 2
        info = await broker.control_client().entity("primary", "orders")
        assert info["scheduled"] == 3
        await sender.cancel_scheduled_messages(seq_far)
    async with client.get_queue_receiver("orders") as receiver:
        [m] = await receive_n(receiver, 1, timeout=5)
        assert str(m) == "soon"
        assert m.sequence_number == seq_soon
        assert m.enqueued_time_utc is not None and m.enqueued_time_utc >= soon.replace(
            microsecond=soon.microsecond // 1000 * 1000
        ) - dt.timedelta(milliseconds=1)
        await receiver.complete_message(m)
    info = await broker.control_client().entity("primary", "orders")
    assert info["scheduled"] == 0 and info["active"] == 0


async def test_ttl_expiry_dead_letters_when_enabled(
    broker: LocalBroker, client: ServiceBusClient, control: ControlClient
) -> None:
    ns = broker.namespace("primary")
    ns.create_queue("ttl-dlq", QueueProperties(dead_lettering_on_message_expiration=True))
    ns.create_queue(
        "ttl-drop", QueueProperties(default_message_time_to_live=dt.timedelta(milliseconds=100))
    )
    async with client.get_queue_sender("ttl-dlq") as sender:
        await sender.send_messages(
            # The SDK drops sub-second TTLs (it sends whole seconds): one second is the minimum.
            ServiceBusMessage("short", message_id="t1", time_to_live=dt.timedelta(seconds=1))
        )
    async with client.get_queue_sender("ttl-drop") as sender:
        await sender.send_messages(ServiceBusMessage("capped"))  # capped by the entity default

    async def expired() -> bool:
        a = await control.entity("primary", "ttl-dlq")
        b = await control.entity("primary", "ttl-drop")
        return a["active"] == 0 and a["dead_letter"] == 1 and b["active"] == 0

    await eventually(expired, timeout=5)
    assert (await control.entity("primary", "ttl-drop"))["dead_letter"] == 0
    async with client.get_queue_receiver(
        "ttl-dlq", sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as dlq:
        [d] = await receive_n(dlq, 1)
        assert d.message_id == "t1"
        assert d.dead_letter_reason == "TTLExpiredException"
        await dlq.complete_message(d)


async def test_locked_message_does_not_expire(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_queue(
        "ttl-locked", QueueProperties(dead_lettering_on_message_expiration=True)
    )
    async with client.get_queue_sender("ttl-locked") as sender:
        await sender.send_messages(ServiceBusMessage("x", time_to_live=dt.timedelta(seconds=10)))
    async with client.get_queue_receiver("ttl-locked") as receiver:
        [m] = await receive_n(receiver, 1)
        ns = broker.namespace("primary")
        entity = ns.receive_source("ttl-locked")
        assert entity is not None
        [stored] = entity.messages.values()
        assert stored.expires_ms is not None
        # Run the expiry pass as if the TTL had long passed: a locked message is kept.
        ns.housekeeping(now=stored.expires_ms + 1000)
        await receiver.complete_message(m)
    info = broker.namespace("primary").describe(
        broker.namespace("primary").receive_source("ttl-locked")
    )  # type: ignore[arg-type]
    assert info["dead_letter"] == 0 and info["active"] == 0


async def test_duplicate_detection_drops_a_repeated_message_id(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_queue(
        "dedup", QueueProperties(requires_duplicate_detection=True)
    )
    async with client.get_queue_sender("dedup") as sender:
        await sender.send_messages(ServiceBusMessage("one", message_id="same"))
        await sender.send_messages(ServiceBusMessage("two", message_id="same"))  # accepted
        await sender.send_messages(ServiceBusMessage("three", message_id="other"))
    counters = broker.namespace("primary").counters.snapshot()
    assert counters["duplicates"] == 1
    async with client.get_queue_receiver("dedup") as receiver:
        msgs = await receive_n(receiver, 2)
        assert sorted(str(m) for m in msgs) == ["one", "three"]


async def test_session_enabled_entity_rejects_a_message_without_session_id(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_queue(
        "needs-session", QueueProperties(requires_session=True)
    )
    async with client.get_queue_sender("needs-session") as sender:
        with pytest.raises(ServiceBusError) as info:
            await sender.send_messages(ServiceBusMessage("no session"))
        assert "SessionId" in str(info.value)
        await sender.send_messages(ServiceBusMessage("ok", session_id="s1"))


async def test_oversize_message_is_rejected(broker: LocalBroker, client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(ServiceBusMessage(b"x" * (256 * 1024 + 1)))
        await sender.send_messages(ServiceBusMessage(b"x" * (200 * 1024)))  # fits


async def test_server_side_size_limit_uses_the_entity_setting(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    # The SDK checks the link's max-message-size first; both sides agree on the limit.
    broker.namespace("primary").create_queue(
        "small", QueueProperties(max_message_size_in_kilobytes=1)
    )
    async with client.get_queue_sender("small") as sender:
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(ServiceBusMessage(b"x" * 2048))
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(
                [ServiceBusMessage(b"x" * 600), ServiceBusMessage(b"y" * 600)]
            )
        await sender.send_messages(ServiceBusMessage(b"x" * 100))


async def test_topic_fans_out_to_every_subscription(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_subscription("events", "billing", SubscriptionProperties())
    async with client.get_topic_sender("events") as sender:
        await sender.send_messages([ServiceBusMessage("e1"), ServiceBusMessage("e2")])
    for sub in ("audit", "billing"):
        async with client.get_subscription_receiver("events", sub) as receiver:
            msgs = await receive_n(receiver, 2)
            assert sorted(str(m) for m in msgs) == ["e1", "e2"]
            for m in msgs:
                await receiver.complete_message(m)


async def test_unknown_entity_is_not_found(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("nope") as sender:
        with pytest.raises(MessagingEntityNotFoundError):
            await sender.send_messages(ServiceBusMessage("x"))
    async with client.get_queue_receiver("nope") as receiver:
        with pytest.raises(MessagingEntityNotFoundError):
            await receiver.receive_messages(max_message_count=1, max_wait_time=1)


async def test_entity_names_with_slashes(broker: LocalBroker) -> None:
    secondary = broker.namespace("secondary")
    path = "primary/x-servicebus-transfer/0"
    secondary.create_queue(path, QueueProperties(max_delivery_count=2147483647))
    async with sb_client(broker.connection_string("secondary")) as client:
        async with client.get_queue_sender(path) as sender:
            await sender.send_messages(
                ServiceBusMessage("backlog", application_properties={"x-ms-path": "orders"})
            )
        async with client.get_queue_receiver(path) as receiver:
            [m] = await receive_n(receiver, 1)
            assert m.application_properties[b"x-ms-path"] == b"orders"
            await receiver.dead_letter_message(m, reason="r")
        async with client.get_queue_receiver(path, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
            [d] = await receive_n(dlq, 1)
            assert d.dead_letter_reason == "r"
            await dlq.complete_message(d)


async def test_ping_is_accepted_counted_and_never_delivered(
    broker: LocalBroker, client: ServiceBusClient, control: ControlClient
) -> None:
    ping = ServiceBusMessage(
        b"", content_type="application/vnd.ms-servicebus-ping", time_to_live=dt.timedelta(seconds=1)
    )
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(ping)
        await sender.send_messages(ServiceBusMessage("real"))
    async with client.get_queue_receiver("orders") as receiver:
        [m] = await receive_n(receiver, 1)
        assert str(m) == "real"
        await receiver.complete_message(m)
        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
    counters = await control.counters("primary")
    assert counters["pings"] == 1
    assert counters["messages_received"] == 1
    assert (await control.entity("primary", "orders"))["pings"] == 1


async def test_released_messages_return_without_a_delivery_count(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(3)])
    # Prefetch 3 but close after taking one: the SDK releases the buffered rest.
    async with client.get_queue_receiver("orders", prefetch_count=3) as receiver:
        [first] = await receive_n(receiver, 1)
        await receiver.complete_message(first)
    async with client.get_queue_receiver("orders") as receiver:
        rest = await receive_n(receiver, 2)
        assert all(m.delivery_count == 0 for m in rest)
        for m in rest:
            await receiver.complete_message(m)


async def test_settlement_through_the_management_link(client: ServiceBusClient) -> None:
    """Deferred messages are settled with update-disposition: every outcome works."""
    async with client.get_queue_sender("orders") as sender:
        await sender.send_messages(
            [ServiceBusMessage(f"d{i}", message_id=f"d{i}") for i in range(3)]
        )
    async with client.get_queue_receiver("orders") as receiver:
        msgs = await receive_n(receiver, 3)
        seqs = sorted(m.sequence_number for m in msgs)
        for m in msgs:
            await receiver.defer_message(m)
        d0, d1, d2 = await receiver.receive_deferred_messages(seqs)
        await receiver.renew_message_lock(d0)
        await receiver.complete_message(d0)
        await receiver.dead_letter_message(d1, reason="mgmt", error_description="via mgmt")
        await receiver.abandon_message(d2)  # stays deferred
        [again] = await receiver.receive_deferred_messages([d2.sequence_number])
        await receiver.complete_message(again)
    async with client.get_queue_receiver("orders", sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        [d] = await receive_n(dlq, 1)
        assert d.dead_letter_reason == "mgmt"
        await dlq.complete_message(d)


async def test_many_messages_keep_order_and_count(client: ServiceBusClient) -> None:
    n = 250
    async with client.get_queue_sender("orders") as sender:
        batch = await sender.create_message_batch()
        for i in range(n):
            batch.add_message(ServiceBusMessage(str(i), message_id=str(uuid.uuid4())))
        await sender.send_messages(batch)
    async with client.get_queue_receiver("orders", prefetch_count=50) as receiver:
        msgs = await receive_n(receiver, n, timeout=20)
        assert [int(str(m)) for m in msgs] == list(range(n))
        for m in msgs:
            await receiver.complete_message(m)
