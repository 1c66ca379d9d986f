"""Session receivers against the broker, with the unmodified SDK: filtering by session,
next-available sessions, the session lock and session state."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time

import pytest
from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusMessage, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import (
    OperationTimeoutError,
    ServiceBusError,
    SessionCannotBeLockedError,
    SessionLockLostError,
)

from sblocal.entities import QueueProperties, SubscriptionProperties
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.support.waiting import eventually

from .conftest import receive_n, sb_client

SDK_DEADLINE = 15.0


def session_queue(broker: LocalBroker, path: str = "sessions", **props: object) -> None:
    broker.namespace("primary").create_queue(
        path,
        QueueProperties(requires_session=True, **props),  # type: ignore[arg-type]
    )


async def waiting_attaches(broker: LocalBroker, path: str = "sessions") -> bool:
    """Whether a next-available-session attach waits at the broker (read on its reactor)."""
    key = id(broker.namespace("primary").receive_source(path))
    rt = broker.amqp.runtimes["primary"]
    return await asyncio.wrap_future(broker.amqp.call(lambda: bool(rt.pending_sessions.get(key))))


async def send_interleaved(
    client: ServiceBusClient, path: str, sessions: list[str], per_session: int
) -> None:
    """``per_session`` messages for each session, round-robin, so that sessions interleave."""
    batch = [
        ServiceBusMessage(f"{s}:{i}", session_id=s) for i in range(per_session) for s in sessions
    ]
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_sender(path) as sender:
            await sender.send_messages(batch)


async def test_a_session_receiver_gets_only_its_session_in_order(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    sessions = [f"s{n}" for n in range(10)]
    await send_interleaved(client, "sessions", sessions, 10)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="s3") as receiver:
            got = await receive_n(receiver, 10)
            for m in got:
                await receiver.complete_message(m)
            # Nothing of another session comes after the session's own messages.
            rest = await receiver.receive_messages(max_message_count=10, max_wait_time=0.5)
    assert [str(m) for m in got] == [f"s3:{i}" for i in range(10)]
    assert {m.session_id for m in got} == {"s3"}
    assert rest == []
    seqs = [m.sequence_number or 0 for m in got]
    assert seqs == sorted(seqs)


async def test_next_available_session_gives_each_unlocked_session_once(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    sessions = [f"n{n}" for n in range(4)]
    await send_interleaved(client, "sessions", sessions, 3)
    got: dict[str, list[str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        # All held at once: each next-available receiver gets a session nobody holds.
        for _ in sessions:
            async with asyncio.timeout(SDK_DEADLINE):
                receiver = await stack.enter_async_context(
                    client.get_queue_receiver(
                        "sessions", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=5
                    )
                )
                session_id = receiver.session.session_id
                assert session_id not in got
                messages = await receive_n(receiver, 3)
                got[session_id] = [str(m) for m in messages]
                for m in messages:
                    await receiver.complete_message(m)
    assert got == {s: [f"{s}:{i}" for i in range(3)] for s in sessions}


async def test_next_available_session_times_out_when_none_is_available(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["held"], 1)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="held"):
            started = time.monotonic()
            # As on Service Bus: the broker holds the attach for the wait the SDK asked for
            # (not its 60 s default), then refuses it with com.microsoft:timeout, which the
            # SDK raises from the receiver's open.
            with pytest.raises(OperationTimeoutError):
                async with client.get_queue_receiver(
                    "sessions", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1
                ):
                    pass
    assert 0.5 < time.monotonic() - started < 5


async def test_a_waiting_next_available_receiver_gets_a_session_sent_meanwhile(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)

    async def accept() -> tuple[str, list[str]]:
        async with client.get_queue_receiver(
            "sessions", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=10
        ) as receiver:
            messages = await receive_n(receiver, 1)
            await receiver.complete_message(messages[0])
            return receiver.session.session_id, [str(m) for m in messages]

    async with asyncio.timeout(SDK_DEADLINE):
        waiting = asyncio.create_task(accept())
        try:
            # The attach is pending at the broker before the message exists.
            await eventually(
                lambda: waiting_attaches(broker), what="the next-available attach is waiting"
            )
            await send_interleaved(client, "sessions", ["late"], 1)
            assert await waiting == ("late", ["late:0"])
        finally:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting


async def test_a_locked_session_cannot_be_accepted_twice(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["one"], 2)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="one") as first:
            # Refused with the attach: the SDK raises it from the receiver's open.
            with pytest.raises(SessionCannotBeLockedError):
                async with client.get_queue_receiver("sessions", session_id="one"):
                    pass
            messages = await receive_n(first, 2)
            assert [str(m) for m in messages] == ["one:0", "one:1"]


async def test_closing_the_receiver_releases_the_session_and_its_messages(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["r"], 2)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="r") as first:
            [m] = await receive_n(first, 1)  # delivered, never settled
            assert str(m) == "r:0"
        async with client.get_queue_receiver("sessions", session_id="r") as second:
            messages = await receive_n(second, 2)
            assert [str(m) for m in messages] == ["r:0", "r:1"]
            assert messages[0].delivery_count == 0  # released, not abandoned
            for m in messages:
                await second.complete_message(m)


async def test_the_session_lock_is_reported_renewed_and_extends_past_its_duration(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker, lock_duration=dt.timedelta(seconds=1))
    await send_interleaved(client, "sessions", ["k"], 1)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="k") as receiver:
            session = receiver.session
            first = session.locked_until_utc
            now = dt.datetime.now(dt.UTC)
            assert first is not None
            assert now < first <= now + dt.timedelta(seconds=1.5)
            [m] = await receive_n(receiver, 1)
            started = time.monotonic()

            async def renewed_past_the_first_lock() -> bool:
                await session.renew_lock()
                return time.monotonic() - started > 1.5

            await eventually(renewed_past_the_first_lock, every=0.2, what="renewed for 1.5 s")
            assert session.locked_until_utc is not None
            assert session.locked_until_utc > first
            # Still ours: another receiver is refused and the message still settles.
            with pytest.raises(SessionCannotBeLockedError):
                async with client.get_queue_receiver("sessions", session_id="k"):
                    pass
            await receiver.complete_message(m)


async def test_an_expired_session_lock_lets_another_receiver_take_the_session(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker, lock_duration=dt.timedelta(milliseconds=500))
    await send_interleaved(client, "sessions", ["x"], 1)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="x") as first:
            [m] = await receive_n(first, 1)
            ns = broker.namespace("primary")
            entity = ns.receive_source("sessions")
            assert entity is not None
            await eventually(lambda: not entity.session_locks, what="the session lock lapses")
            with pytest.raises(SessionLockLostError):
                await first.complete_message(m)
        async with client.get_queue_receiver("sessions", session_id="x") as second:
            [again] = await receive_n(second, 1)
            assert str(again) == "x:0"
            assert again.delivery_count == 1  # the lapsed lock counts a delivery
            await second.complete_message(again)


async def test_session_state_is_kept_per_session(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="st") as receiver:
            assert await receiver.session.get_state() is None
            await receiver.session.set_state(b"step-2")
            assert await receiver.session.get_state() == b"step-2"
        async with client.get_queue_receiver("sessions", session_id="other") as receiver:
            assert await receiver.session.get_state() is None
        async with client.get_queue_receiver("sessions", session_id="st") as receiver:
            assert await receiver.session.get_state() == b"step-2"
            await receiver.session.set_state(None)
            assert await receiver.session.get_state() is None


async def test_peek_on_a_session_receiver_shows_its_session_only(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["p", "q"], 3)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="q") as receiver:
            peeked = await receiver.peek_messages(10)
    assert [str(m) for m in peeked] == ["q:0", "q:1", "q:2"]


async def test_a_session_queue_refuses_messages_without_session_and_plain_receivers(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_sender("sessions") as sender:
            with pytest.raises(ServiceBusError):
                await sender.send_messages(ServiceBusMessage("no session"))
        with pytest.raises(ServiceBusError):
            async with client.get_queue_receiver("sessions"):
                pass
    assert broker.namespace("primary").counters.rejected_sends == 1


async def test_a_session_receiver_on_a_plain_queue_is_refused(client: ServiceBusClient) -> None:
    async with asyncio.timeout(SDK_DEADLINE):
        with pytest.raises(ServiceBusError):
            async with client.get_queue_receiver("orders", session_id="s"):
                pass


async def test_a_session_enabled_subscription_serves_sessions(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    broker.namespace("primary").create_subscription(
        "events", "by-session", SubscriptionProperties(requires_session=True)
    )
    batch = [ServiceBusMessage(f"{s}:{i}", session_id=s) for i in range(3) for s in "ab"]
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_topic_sender("events") as sender:
            await sender.send_messages(batch)
        async with client.get_subscription_receiver(
            "events", "by-session", session_id="b"
        ) as receiver:
            messages = await receive_n(receiver, 3)
    assert [str(m) for m in messages] == ["b:0", "b:1", "b:2"]


async def test_the_dead_letter_queue_of_a_session_queue_is_read_without_sessions(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["d"], 1)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="d") as receiver:
            [m] = await receive_n(receiver, 1)
            await receiver.dead_letter_message(m, reason="bad")
        async with client.get_queue_receiver(
            "sessions", sub_queue=ServiceBusSubQueue.DEAD_LETTER
        ) as dlq:
            [dead] = await receive_n(dlq, 1)
            await dlq.complete_message(dead)
    assert (str(dead), dead.session_id, dead.dead_letter_reason) == ("d:0", "d", "bad")


async def test_a_dropped_connection_releases_its_sessions(
    broker: LocalBroker, client: ServiceBusClient, control: ControlClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["c"], 1)
    entity = broker.namespace("primary").receive_source("sessions")
    assert entity is not None
    async with asyncio.timeout(SDK_DEADLINE):
        async with sb_client(broker.connection_string("primary")) as other:
            receiver = other.get_queue_receiver("sessions", session_id="c")
            await receiver.__aenter__()
            await receive_n(receiver, 1)  # delivered, unsettled
            assert "c" in entity.session_locks
            await control.drop_connections("primary")
            await eventually(lambda: not entity.session_locks, what="the session is released")
            with contextlib.suppress(ServiceBusError):
                await receiver.close()
        async with client.get_queue_receiver("sessions", session_id="c") as again:
            [back] = await receive_n(again, 1)
            await again.complete_message(back)
    assert (str(back), back.delivery_count) == ("c:0", 0)


async def test_receivers_of_every_session_at_once_each_get_their_own_in_order(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    sessions = [f"c{n}" for n in range(6)]
    await send_interleaved(client, "sessions", sessions, 8)

    async def drain(session: str) -> list[str]:
        async with client.get_queue_receiver("sessions", session_id=session) as receiver:
            messages = await receive_n(receiver, 8)
            for m in messages:
                await receiver.complete_message(m)
            return [str(m) for m in messages]

    async with asyncio.timeout(SDK_DEADLINE):
        got = await asyncio.gather(*(drain(s) for s in sessions))
    assert got == [[f"{s}:{i}" for i in range(8)] for s in sessions]
    assert broker.namespace("primary").receive_source("sessions").messages == {}  # type: ignore[union-attr]


async def test_an_abandoned_message_comes_back_first_in_its_session(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["a", "b"], 3)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="a") as receiver:
            first, second = await receive_n(receiver, 2)
            await receiver.abandon_message(first)
            await receiver.complete_message(second)
            rest = await receive_n(receiver, 2)
            for m in rest:
                await receiver.complete_message(m)
    assert [str(m) for m in rest] == ["a:0", "a:2"]
    assert rest[0].delivery_count == 1


async def test_a_session_receiver_with_the_sdk_defaults_and_iteration(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    """No prefetch (the SDK releases what arrives outside a receive call) and `async for`."""
    session_queue(broker)
    await send_interleaved(client, "sessions", ["i", "j"], 4)
    got: list[str] = []
    async with asyncio.timeout(SDK_DEADLINE):
        async with ServiceBusClient.from_connection_string(
            broker.connection_string("primary"), retry_total=0
        ) as plain:
            async with plain.get_queue_receiver(
                "sessions", session_id="j", max_wait_time=2
            ) as receiver:
                async for m in receiver:
                    got.append(str(m))
                    await receiver.complete_message(m)
                    if len(got) == 4:
                        break
    assert got == ["j:0", "j:1", "j:2", "j:3"]


async def test_list_sessions_names_those_with_messages_or_state(
    broker: LocalBroker, client: ServiceBusClient
) -> None:
    session_queue(broker)
    await send_interleaved(client, "sessions", ["m2", "m1"], 2)
    async with asyncio.timeout(SDK_DEADLINE):
        async with client.get_queue_receiver("sessions", session_id="stateful") as receiver:
            before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
            await receiver.session.set_state(b"s")
        listed = [s async for s in client.list_queue_sessions("sessions", timeout=5)]
        updated = [
            s
            async for s in client.list_queue_sessions(
                "sessions", state_updated_after=before, timeout=5
            )
        ]
        none_yet = [
            s
            async for s in client.list_queue_sessions(
                "sessions", state_updated_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
            )
        ]
    assert listed == ["m1", "m2", "stateful"]
    assert updated == ["stateful"]
    assert none_yet == []
