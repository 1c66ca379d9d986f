"""Contract: one message sent over a pooled sender by `gateway.servicebus.internals.lean` is
the SDK's send — the same message at the broker, the same failure for every fault.

Each case sends over the lean path and over the SDK's own `send_messages` on the same kind
of pooled sender, against the local broker, and compares what the broker stored or what
`SdkSender.send` raised.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.core.message import OutboundMessage
from gateway.errors import SendFailure
from gateway.servicebus.client import SdkNamespaceClient
from gateway.servicebus.internals import lean
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.broker.conftest import FastClient, pooled_client


@pytest.fixture
async def pooled(broker: LocalBroker) -> AsyncIterator[SdkNamespaceClient]:
    async with pooled_client(broker, connections=1) as client:
        yield client


FULL = OutboundMessage(
    body=b'{"n": 1}' * 50,
    message_id="m-1",
    content_type="application/json",
    correlation_id="corr",
    session_id=None,
    subject="created",
    reply_to="replies",
    reply_to_session_id="rs",
    to="billing",
    time_to_live=dt.timedelta(hours=1, milliseconds=250),
    scheduled_enqueue_time_utc=None,
    application_properties={"text": "héllo", "int": 42, "big": 2**40, "flag": True, "raw": b"b"},
)


async def _received(broker: LocalBroker, count: int) -> list[Any]:
    async with FastClient.from_connection_string(broker.connection_string("primary")) as sb:
        async with sb.get_queue_receiver("orders", max_wait_time=5) as receiver:
            got: list[Any] = []
            while len(got) < count:
                batch = await receiver.receive_messages(max_message_count=count, max_wait_time=5)
                assert batch, "the messages did not arrive"
                for m in batch:
                    await receiver.complete_message(m)
                got += batch
            return got


def _fields(m: Any) -> dict[str, Any]:
    return {
        "body": b"".join(m.body),
        "message_id": m.message_id,
        "content_type": m.content_type,
        "correlation_id": m.correlation_id,
        "subject": m.subject,
        "reply_to": m.reply_to,
        "reply_to_session_id": m.reply_to_session_id,
        "to": m.to,
        "time_to_live": m.time_to_live,
        "application_properties": m.application_properties,
        "has_expiry": m.expires_at_utc is not None,
    }


async def test_one_message_goes_the_lean_way_and_arrives_as_the_sdks_send_does(
    pooled: SdkNamespaceClient, broker: LocalBroker
) -> None:
    sender = await pooled.open_sender("orders")
    try:
        assert lean.usable(sender._sender), "the lean path must be the one under test"
        await sender.send([FULL])
        await sender._send_via_sdk([FULL])
    finally:
        await sender.close()
    ours, sdk = await _received(broker, 2)
    assert _fields(ours) == _fields(sdk)


@pytest.mark.parametrize(
    ("condition", "mode"),
    [
        ("com.microsoft:server-busy", "reject"),
        ("amqp:not-found", "reject"),
        ("amqp:unauthorized-access", "reject"),
        ("amqp:link:message-size-exceeded", "reject"),
        ("amqp:internal-error", "reject"),
        ("amqp:link:detach-forced", "detach"),
        ("amqp:not-found", "detach"),
    ],
)
async def test_every_fault_fails_the_lean_send_as_it_fails_the_sdks(
    pooled: SdkNamespaceClient, control: ControlClient, condition: str, mode: str
) -> None:
    outcomes: list[tuple[Any, ...]] = []
    for lean_way in (True, False):
        sender = await pooled.open_sender("orders")
        try:
            assert lean.usable(sender._sender)
            fault = await control.add_fault(
                "primary", condition, operation="send", entity="orders", count=2, mode=mode
            )
            with pytest.raises(SendFailure) as caught:
                if lean_way:
                    await sender.send([FULL])
                else:
                    await sender._send_via_sdk([FULL])
            # How many attempts the fault met: the same retries either way.
            left = [
                (f["count"], f["hits"]) for f in await control.faults("primary") if f["id"] == fault
            ]
            await control.clear_faults("primary")
        finally:
            await sender.close()
        error = caught.value
        outcomes.append(
            (error.kind, error.classification, error.status, type(error.__cause__).__name__, left)
        )
    assert outcomes[0] == outcomes[1]
