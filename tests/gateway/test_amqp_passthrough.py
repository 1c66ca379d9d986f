"""Raw passthrough end to end: the real Python SDK through the gateway's AMQP edge to the
local broker, against the same SDK sending to the broker directly.

A message the edge accepts is sent to the primary in the client's own bytes
(gateway.amqp.messages, `OutboundMessage.encoded`): what the broker stores must be what the
same sender would have stored sending directly — every application-property type, the
ids and properties, the TTL, the partition key, a client's own creation time — single,
listed or batched; and through a backlog queue and the syphon, the same content (the send
home is encoded from the fields: only the send-time stamps are the gateway's there).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageProperties

from sblocal.testing import BrokerProcess, ControlClient
from tests.gateway.test_amqp_sdk import DEADLINE, Connect, amqp_gateway, receive
from tests.gateway.test_syphon import SYPHON, backlog_total, depth
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["amqp_gateway"]  # the fixture, used by name

# Without a TTL the SDK keeps a creation time the application set: only the client's own
# bytes carry it (the gateway's own encoding stamps one only with a TTL).
CREATED_MS = 1_893_553_445_000  # 2030-01-02T03:04:05Z, in ms as the SDK takes it
STAMPS = ("creation_time", "absolute_expiry_time")


def outgoing(tag: str) -> list[Any]:
    """Messages with every application-property type the Python SDK sends."""
    props = {
        "str": "text",
        "int": 7,
        "negative": -(2**31),
        "float": 0.25,
        "bool": True,
        "datetime": dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.UTC),
        "uuid": uuid.UUID(int=42),
        "bytes": b"utf-8 bytes",
    }
    return [
        ServiceBusMessage(
            b"full",
            message_id=f"{tag}-full",
            correlation_id="c-1",
            subject="sub",
            content_type="application/json",
            reply_to="replies",
            to="somewhere",
            partition_key="pk",
            time_to_live=dt.timedelta(hours=2),
            application_properties=props,
        ),
        ServiceBusMessage("plain text", message_id=f"{tag}-plain"),
        AmqpAnnotatedMessage(
            data_body=b"annotated",
            properties=AmqpMessageProperties(message_id=f"{tag}-created", creation_time=CREATED_MS),
            application_properties={"n": 1},
        ),
    ]


def view(m: ServiceBusReceivedMessage, *, stamps: bool) -> dict[str, Any]:
    """What the broker stored and a receiver reads, with each value's type; the broker's
    own annotations (sequence number, enqueued time, lock) and, unless `stamps`, the
    send-time stamps left out."""
    raw = m.raw_amqp_message
    props = dict(raw.properties.items()) if raw.properties else {}  # type: ignore[attr-defined]
    props.pop("message_id", None)
    if not stamps:
        for name in STAMPS:
            props.pop(name, None)
    app = raw.application_properties or {}
    annotations = {k: v for k, v in (raw.annotations or {}).items() if k == b"x-opt-partition-key"}
    return {
        "ttl": raw.header.time_to_live if raw.header else None,
        "properties": props,
        "app": {k: (type(v), v) for k, v in app.items()},
        "annotations": annotations,
        "body": b"".join(m.body),
    }


async def send_all(conn: str, tag: str) -> None:
    """Single sends, a list and a `ServiceBusMessageBatch`, each message tagged apart."""
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(conn, retry_total=0) as sb:
            async with sb.get_queue_sender("orders") as sender:
                for m in outgoing(f"{tag}-one"):
                    await sender.send_messages(m)
                await sender.send_messages(outgoing(f"{tag}-list"))
                batch = await sender.create_message_batch()
                for m in outgoing(f"{tag}-batch"):
                    batch.add_message(m)
                await sender.send_messages(batch)


def by_suffix(received: list[Any], tag: str, *, stamps: bool) -> dict[str, dict[str, Any]]:
    out = {}
    for m in received:
        assert m.message_id.startswith(tag + "-")
        out[m.message_id[len(tag) + 1 :]] = view(m, stamps=stamps and m.time_to_live is None)
    return out


async def test_through_the_gateway_the_broker_stores_what_a_direct_send_stores(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    await send_all(broker.connection_string("primary"), "direct")
    direct = by_suffix(await receive(broker, 9), "direct", stamps=True)
    conn = await amqp_gateway()
    await send_all(conn, "gw")
    through = by_suffix(await receive(broker, 9), "gw", stamps=True)
    assert sorted(through) == sorted(direct) and len(direct) == 9
    for key, want in direct.items():
        assert through[key] == want, key
    # The client's own creation time arrived: the bytes were the client's.
    created = through["one-created"]["properties"]["creation_time"]
    assert created == CREATED_MS


async def test_through_a_backlog_queue_the_content_arrives_home_unchanged(
    amqp_gateway: Connect, broker: BrokerProcess, control: ControlClient
) -> None:
    await send_all(broker.connection_string("primary"), "direct")
    direct = by_suffix(await receive(broker, 9), "direct", stamps=False)
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    conn = await amqp_gateway(SYPHON)
    await send_all(conn, "gw")
    assert await backlog_total(control) == 9 and await depth(control, "primary", "orders") == 0
    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", "orders") == 9

    await eventually(home, within=30, every=0.2)
    through = by_suffix(await receive(broker, 9), "gw", stamps=False)
    assert sorted(through) == sorted(direct)
    for key, want in direct.items():
        got = dict(through[key])
        got_ttl, want_ttl = got.pop("ttl"), want.pop("ttl")
        # Home with the TTL it has left (gateway.core.backlog.restore).
        assert (got_ttl is None) == (want_ttl is None), key
        if want_ttl is not None:
            assert want_ttl - 60_000 <= got_ttl <= want_ttl, key
        assert got == want, key
