"""Every control API endpoint, over HTTP."""

from __future__ import annotations

import base64

import pytest
from azure.servicebus import ServiceBusMessage

from sblocal.server import LocalBroker
from sblocal.testing import ControlClient, ControlError, eventually

from .conftest import receive_n, sb_client


async def test_get_namespaces_matches_the_broker_info(
    broker: LocalBroker, control: ControlClient
) -> None:
    info = await control.namespaces()
    assert info == broker.info
    assert set(info["namespaces"]) == {"primary", "secondary"}
    primary = info["namespaces"]["primary"]
    assert primary["connection_string"].startswith(
        f"Endpoint=sb://localhost:{primary['amqp_port']};"
    )
    assert primary["connection_string"].endswith(";UseDevelopmentEmulator=true;")
    assert primary["management_port"] is None  # the fast test config has none


async def test_entities_list_get_and_create(control: ControlClient) -> None:
    listed = {e["path"]: e for e in await control.entities("primary")}
    assert {"orders", "orders/$DeadLetterQueue", "events", "events/Subscriptions/audit"} <= set(
        listed
    )
    assert listed["orders"]["active"] == 0 and listed["events"]["kind"] == "topic"

    created = await control.create_entity(
        "primary", "a/b/c", "queue", {"lock_duration": "PT5S", "max_delivery_count": 3}
    )
    assert created["properties"]["lock_duration"] == 5.0
    assert created["properties"]["max_delivery_count"] == 3
    await control.create_entity("primary", "t", "topic")
    sub = await control.create_entity("primary", "t/Subscriptions/s", "subscription")
    assert sub["kind"] == "subscription"
    got = await control.entity("primary", "a/b/c")
    assert got["path"] == "a/b/c" and got["active"] == 0
    dlq = await control.entity("primary", "a/b/c/$DeadLetterQueue")
    assert dlq["kind"] == "dlq"

    with pytest.raises(ControlError) as exists:
        await control.create_entity("primary", "a/b/c")
    assert exists.value.status == 409
    with pytest.raises(ControlError) as bad:
        await control.create_entity("primary", "x", "queue", {"no_such": 1})
    assert bad.value.status == 400
    with pytest.raises(ControlError) as missing:
        await control.entity("primary", "missing")
    assert missing.value.status == 404
    with pytest.raises(ControlError) as no_ns:
        await control.entities("nowhere")
    assert no_ns.value.status == 404


async def test_messages_peek_shows_body_and_properties(
    broker: LocalBroker, control: ControlClient
) -> None:
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(
                ServiceBusMessage(
                    "héllo",
                    message_id="m1",
                    correlation_id="c1",
                    session_id=None,
                    subject="s",
                    content_type="text/plain",
                    application_properties={"k": "v", "n": 2, "raw": b"\x01"},
                )
            )
            await sender.send_messages(ServiceBusMessage(b"\xff\xfe"))
        async with client.get_queue_receiver("orders") as receiver:
            [first, _] = await receive_n(receiver, 2)
            await receiver.dead_letter_message(first, reason="why", error_description="because")
    [m] = await control.messages("primary", "orders/$DeadLetterQueue")
    assert m["message_id"] == "m1" and m["correlation_id"] == "c1" and m["subject"] == "s"
    assert m["body_text"] == "héllo"
    assert base64.b64decode(m["body_base64"]) == "héllo".encode()
    assert m["application_properties"]["k"] == "v"
    assert m["application_properties"]["n"] == 2
    # The SDK may encode bytes as an AMQP string or binary: both render.
    assert m["application_properties"]["raw"] in ("\x01", {"base64": "AQ=="})
    assert m["dead_letter_reason"] == "why"
    assert m["dead_letter_error_description"] == "because"
    [binary] = await control.messages("primary", "orders", limit=10)
    assert binary["body_text"] is None and binary["locked"] is True
    assert base64.b64decode(binary["body_base64"]) == b"\xff\xfe"
    with pytest.raises(ControlError) as topic:
        await control.messages("primary", "events")
    assert topic.value.status == 400


async def test_faults_add_list_delete_and_validation(control: ControlClient) -> None:
    a = await control.add_fault("primary", "com.microsoft:server-busy", count=2)
    b = await control.add_fault("primary", "amqp:not-found", entity="orders", operation="send")
    assert {f["id"] for f in await control.faults("primary")} == {a, b}
    await control.remove_fault("primary", a)
    assert [f["id"] for f in await control.faults("primary")] == [b]
    await control.clear_faults("primary")
    assert await control.faults("primary") == []
    for bad in (
        {"condition": "x", "operation": "send"},
        {"condition": "amqp:not-found", "operation": "peek"},
        {"condition": "amqp:not-found", "mode": "explode"},
        {"condition": "amqp:not-found", "count": 0},
        {"condition": "amqp:not-found", "mode": "lose-outcome"},  # sends only
        {"condition": "amqp:not-found", "mode": "lose-outcome", "operation": "receive"},
    ):
        with pytest.raises(ControlError) as info:
            await control.request("POST", "/namespaces/primary/faults", bad)
        assert info.value.status == 400
    with pytest.raises(ControlError) as gone:
        await control.remove_fault("primary", 999)
    assert gone.value.status == 404


async def test_latency_put_and_get(control: ControlClient) -> None:
    await control.set_latency("primary", round_trip_ms=70, store_ms=10)
    assert await control.request("GET", "/namespaces/primary/latency") == {
        "round_trip_ms": 70.0,
        "store_ms": 10.0,
    }
    with pytest.raises(ControlError):
        await control.request("PUT", "/namespaces/primary/latency", {"round_trip_ms": -1})


async def test_down_up_and_drop_connections_endpoints(
    broker: LocalBroker, control: ControlClient
) -> None:
    port = broker.amqp_port("primary")
    assert await control.drop_connections("primary") == 0
    await control.down("primary")
    assert broker.info["namespaces"]["primary"]["up"] is False
    await control.up("primary")
    assert broker.amqp_port("primary") == port  # the same port again
    assert broker.info["namespaces"]["primary"]["up"] is True


async def test_counters_and_reset(broker: LocalBroker, control: ControlClient) -> None:
    async with sb_client(broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages([ServiceBusMessage("a"), ServiceBusMessage("b")])
        async with client.get_queue_receiver("orders") as receiver:
            msgs = await receive_n(receiver, 2)
            await receiver.complete_message(msgs[0])
            await receiver.abandon_message(msgs[1])
    counters = await control.counters("primary")
    assert counters["sends"] == 1
    assert counters["messages_received"] == 2
    assert counters["completes"] == 1 and counters["abandons"] == 1
    assert counters["receives"] >= 1 and counters["deliveries"] >= 2
    assert counters["connections"] == 2 and counters["cbs_tokens"] == 2
    await control.add_fault("primary", "amqp:not-found")
    await control.set_latency("primary", 5, 5)

    await control.reset()
    counters = await control.counters("primary")
    assert counters["sends"] == 0 and counters["completes"] == 0
    assert (await control.entity("primary", "orders"))["active"] == 0
    assert await control.faults("primary") == []
    assert await control.request("GET", "/namespaces/primary/latency") == {
        "round_trip_ms": 0.0,
        "store_ms": 0.0,
    }
    await control.reset("secondary")


async def test_eventually_raises_on_timeout() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(TimeoutError):
        await eventually(never, timeout=0.05, interval=0.01)
