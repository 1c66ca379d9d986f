"""The gateway core end to end: HTTP → gateway → real azure-servicebus SDK → local broker.

Every property mapping is verified by receiving the message with the real SDK.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import socket
import time
from typing import Any

import orjson
import pytest
from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient

from sblocal.testing import BrokerProcess
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually, no_hang


async def receive(
    broker: BrokerProcess,
    queue: str | None = None,
    topic_sub: tuple[str, str] | None = None,
    count: int = 1,
    within: float = 5.0,
) -> list[ServiceBusReceivedMessage]:
    """Receive (and complete) `count` messages with the real SDK, failing after `within` s."""
    out: list[ServiceBusReceivedMessage] = []
    async with ServiceBusClient.from_connection_string(broker.connection_string("primary")) as sb:
        receiver = (
            sb.get_queue_receiver(queue) if queue else sb.get_subscription_receiver(*topic_sub)  # type: ignore[misc]
        )
        async with asyncio.timeout(within + 5), receiver:
            deadline = time.monotonic() + within
            while len(out) < count and time.monotonic() < deadline:
                batch = await receiver.receive_messages(
                    max_message_count=count - len(out), max_wait_time=1
                )
                for m in batch:
                    await receiver.complete_message(m)
                out.extend(batch)
    assert len(out) == count, f"expected {count} messages, received {len(out)}"
    return out


async def test_single_message_every_property_round_trips(gateway: GatewayFactory, broker):
    gw = await gateway()
    props = {
        "MessageId": "order-1",
        "CorrelationId": "corr-1",
        "SessionId": "sess-1",
        "Label": "created",
        "ReplyTo": "replies",
        "ReplyToSessionId": "rs-1",
        "To": "billing",
        "TimeToLive": 3600,
        "PartitionKey": "sess-1",
    }
    resp = await gw.post(
        "/queues/orders/messages",
        data=b'{"total": 42}',
        headers={
            "Content-Type": "application/json",
            "BrokerProperties": orjson.dumps(props).decode(),
            "Priority": '"High"',
            "Retries": "3",
            "Ratio": "0.25",
            "Urgent": "true",
            "Authorization": "not copied",
        },
    )
    assert resp.status == 201, await resp.text()
    body = await resp.json()
    assert body == {"messageIds": ["order-1"], "entity": "orders", "route": "primary"}
    assert resp.headers["X-Route"] == "primary" and resp.headers["X-Request-Id"]
    [m] = await receive(broker, "orders")
    assert b"".join(m.body) == b'{"total": 42}'
    assert m.message_id == "order-1" and m.correlation_id == "corr-1"
    assert m.session_id == "sess-1" and m.subject == "created" and m.reply_to == "replies"
    assert m.reply_to_session_id == "rs-1" and m.to == "billing"
    assert m.content_type == "application/json" and m.partition_key == "sess-1"
    assert m.time_to_live == dt.timedelta(hours=1)
    app = {
        k.decode() if isinstance(k, bytes) else k: v
        for k, v in (m.application_properties or {}).items()
    }
    app = {k: v.decode() if isinstance(v, bytes) else v for k, v in app.items()}
    assert app == {"Priority": "High", "Retries": 3, "Ratio": 0.25, "Urgent": True}


async def test_scheduled_message_keeps_its_schedule(gateway: GatewayFactory, control):
    gw = await gateway()
    when = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    resp = await gw.post(
        "/orders/messages",
        data=b"later",
        headers={"BrokerProperties": orjson.dumps({"ScheduledEnqueueTimeUtc": when}).decode()},
    )
    assert resp.status == 201
    entity = await control.entity("primary", "orders")
    assert entity["scheduled"] == 1 and entity["active"] == 0


async def test_batch_with_base64_and_user_properties(gateway: GatewayFactory, broker):
    gw = await gateway()
    items = [
        {
            "Body": "first",
            "BrokerProperties": {"MessageId": "b-1", "Label": "x"},
            "UserProperties": {"n": 1, "ok": True, "s": "v"},
        },
        {
            "Body": base64.b64encode(b"\x00\xffbin").decode(),
            "IsBodyBase64": True,
            "BrokerProperties": {"MessageId": "b-2"},
        },
    ]
    resp = await gw.post(
        "/queues/orders/messages",
        data=orjson.dumps(items),
        headers={"Content-Type": "application/vnd.microsoft.servicebus.json", "Custom": "ignored"},
    )
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["messageIds"] == ["b-1", "b-2"]
    got = {m.message_id: m for m in await receive(broker, "orders", count=2)}
    assert b"".join(got["b-1"].body) == b"first" and got["b-1"].subject == "x"
    assert b"".join(got["b-2"].body) == b"\x00\xffbin"
    props = {
        k.decode() if isinstance(k, bytes) else k: v
        for k, v in (got["b-1"].application_properties or {}).items()
    }
    assert props == {"n": 1, "ok": True, "s": b"v"} or props == {"n": 1, "ok": True, "s": "v"}
    assert not got["b-2"].application_properties, "custom headers are not applied to batch items"


async def test_topic_message_reaches_the_subscription(gateway: GatewayFactory, broker):
    gw = await gateway()
    resp = await gw.post(
        "/topics/events/messages", data=b"evt", headers={"Idempotency-Key": "evt-9"}
    )
    assert resp.status == 201 and (await resp.json())["messageIds"] == ["evt-9"]
    [m] = await receive(broker, topic_sub=("events", "audit"))
    assert m.message_id == "evt-9"


async def test_concurrent_requests_are_micro_batched_and_all_stored(
    gateway: GatewayFactory, control
):
    gw = await gateway({"SBGATE_SENDERS_PER_ENTITY": "2"})
    before = await control.counters("primary")
    resps = await asyncio.gather(
        *(
            gw.post("/queues/orders/messages", data=b"m", headers={"Idempotency-Key": f"c-{i}"})
            for i in range(200)
        )
    )
    assert [r.status for r in resps] == [201] * 200
    entity = await control.entity("primary", "orders")
    assert entity["active"] == 200
    after = await control.counters("primary")
    transfers = {k: after[k] - before.get(k, 0) for k in after if "transfer" in k or "send" in k}
    assert entity["sends"] < 200 or transfers, "200 concurrent requests went out in batches"


@pytest.mark.parametrize(
    ("condition", "status", "code"),
    [
        ("com.microsoft:server-busy", 503, "upstream_server_busy"),
        ("amqp:not-found", 503, "upstream_entity_not_found"),
        ("amqp:unauthorized-access", 503, "upstream_unauthorized"),
        ("amqp:internal-error", 503, "upstream_service"),
    ],
)
async def test_broker_errors_are_answered_per_the_table(
    gateway: GatewayFactory, control, condition, status, code
):
    gw = await gateway({"SBGATE_SDK_RETRY_TOTAL": "0"})
    await control.add_fault("primary", condition, operation="send", entity="orders")
    resp = await gw.post("/queues/orders/messages", data=b"x")
    body = await resp.json()
    assert resp.status == status and body["error"] == code, body
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await control.entity("primary", "orders"))["active"] == 0


async def test_a_hanging_broker_is_answered_within_send_timeout(gateway: GatewayFactory, control):
    gw = await gateway({"SBGATE_SEND_TIMEOUT": "1", "SBGATE_SENDERS_PER_ENTITY": "1"})
    await control.add_fault(
        "primary", "amqp:internal-error", operation="send", mode="hang", count=1
    )
    # The broker never answers this send: an answer at all is send_timeout at work.
    async with no_hang("a send the broker never answers"):
        resp = await gw.post("/queues/orders/messages", data=b"x")
    assert resp.status == 503 and (await resp.json())["error"] == "upstream_timeout"
    # The suspect sender was replaced: the next request goes through.
    resp = await gw.post("/queues/orders/messages", data=b"y", headers={"Idempotency-Key": "after"})
    assert resp.status == 201, await resp.text()
    metrics = await (await gw.get("/metrics")).text()
    assert 'sbgate_senders_recreated_total{namespace="primary"}' in metrics


async def test_a_send_whose_outcome_was_lost_is_503_and_its_retry_is_stored_once(
    gateway: GatewayFactory, control, broker: BrokerProcess
):
    """A 503 after a send attempt means "outcome unknown", not "not stored" (docs/errors.md):
    here the broker stores the message and its disposition never comes back. The client's
    retry with the same MessageId is stored once by a queue with duplicate detection."""
    # A name of its own: the broker lives for the whole session.
    await control.create_entity(
        "primary", "lost-outcome", "queue", {"requires_duplicate_detection": True}
    )
    gw = await gateway(
        {
            "SBGATE_ENTITIES": "queue:lost-outcome",
            "SBGATE_SEND_TIMEOUT": "1",
            "SBGATE_SENDERS_PER_ENTITY": "1",
            "SBGATE_SDK_RETRY_TOTAL": "0",
        }
    )
    await control.add_fault(
        "primary", "amqp:internal-error", operation="send", mode="lose-outcome", count=1
    )
    headers = {"Idempotency-Key": "order-7"}
    async with no_hang("a send whose outcome never comes back"):
        first = await gw.post("/queues/lost-outcome/messages", data=b"x", headers=headers)
    assert first.status == 503 and (await first.json())["error"] == "upstream_timeout"
    assert (await control.entity("primary", "lost-outcome"))["active"] == 1  # stored all the same
    retry = await gw.post("/queues/lost-outcome/messages", data=b"x", headers=headers)
    assert retry.status == 201, await retry.text()
    entity = await control.entity("primary", "lost-outcome")
    assert entity["active"] == 1 and entity["sends"] >= 2, entity
    [m] = await receive(broker, "lost-outcome")
    assert m.message_id == "order-7"


async def test_namespace_down_then_up_recovers(gateway: GatewayFactory, control):
    gw = await gateway({"SBGATE_SDK_RETRY_TOTAL": "0", "SBGATE_SEND_TIMEOUT": "2"})
    assert (await gw.post("/orders/messages", data=b"1")).status == 201
    await control.down("primary")
    try:
        resp = await gw.post("/orders/messages", data=b"2")
        assert resp.status == 503
    finally:
        await control.up("primary")
    for _ in range(20):  # the SDK reconnects; no sleep: each attempt is bounded by send_timeout
        resp = await gw.post("/orders/messages", data=b"3")
        if resp.status == 201:
            break
    assert resp.status == 201


async def test_saturation_is_503_with_retry_after(gateway: GatewayFactory, control):
    gw = await gateway(
        {
            "SBGATE_MAX_IN_FLIGHT": "1",
            "SBGATE_SENDERS_PER_ENTITY": "1",
            "SBGATE_ADMISSION_TIMEOUT": "0.05",
            "SBGATE_MAX_PENDING_BYTES": "300000",
            "SBGATE_SEND_TIMEOUT": "10",
        }
    )

    async def warm() -> bool:
        return (await gw.post("/orders/messages", data=b"warm")).status == 201

    # The sender opens on first use (a request may expire while it opens): once one request
    # is stored, the requests below wait for a busy sender, not for an opening one.
    await eventually(warm)
    warmed = (await control.entity("primary", "orders"))["active"]
    await control.set_latency("primary", round_trip_ms=300, store_ms=0)
    resps = await asyncio.gather(
        *(gw.post("/orders/messages", data=b"x" * 100_000) for _ in range(12))
    )
    statuses = sorted(r.status for r in resps)
    assert 201 in statuses and 503 in statuses, statuses
    saturated = [r for r in resps if r.status == 503]
    assert [(await r.json())["error"] for r in saturated] == ["saturated"] * len(saturated)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in saturated)
    stored = (await control.entity("primary", "orders"))["active"] - warmed
    assert stored == statuses.count(201), "exactly the accepted requests were stored"


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "code"),
    [
        ("/queues/nope/messages", {}, 404, "entity_not_found"),
        ("/queues/events/messages", {}, 404, "entity_not_found"),
        ("/orders/$DeadLetterQueue/messages", {}, 400, "invalid_entity_path"),
        ("/primary/x-servicebus-transfer/0/messages", {}, 400, "invalid_entity_path"),
        ("/queues/orders/messages", {"headers": {"BrokerProperties": "{"}}, 400, "bad_request"),
        (
            "/queues/orders/messages",
            {"headers": {"BrokerProperties": '{"TimeToLive": -5}'}},
            400,
            "bad_request",
        ),
        ("/queues/orders/messages", {"data": b"x" * 300_000}, 413, "payload_too_large"),
        (
            "/queues/orders/messages",
            {"headers": {"Content-Encoding": "gzip"}},
            415,
            "unsupported_media_type",
        ),
        (
            "/queues/orders/messages",
            {
                "headers": {"Content-Type": "application/vnd.microsoft.servicebus.json"},
                "data": b"{",
            },
            400,
            "bad_request",
        ),
    ],
)
async def test_bad_input_is_a_clear_4xx_and_nothing_is_sent(
    gateway: GatewayFactory, control, path, kwargs, status, code
):
    gw = await gateway()
    kwargs.setdefault("data", b"x")
    resp = await gw.post(path, **kwargs)
    assert resp.status == status
    body: dict[str, Any] = await resp.json()
    assert body["error"] == code and body["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0


def raw_request(port: int, request_line: str) -> bytes:
    """Send a request exactly as written (clients normalise '..' and '%2F' away)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            f"{request_line}\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    "target",
    [
        "/queues/a/../orders/messages",
        "/queues/orders%2Fx/messages",
        "/queues/./orders/messages",
        "/orders%2F..%2Fsecret/messages",
        "/queues//orders/messages",
    ],
)
async def test_raw_path_tricks_are_400(gateway: GatewayFactory, control, target):
    gw = await gateway()
    port = gw.server.port
    assert port is not None
    reply = await asyncio.to_thread(raw_request, port, f"POST {target} HTTP/1.1")
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"invalid_entity_path" in reply
    assert b"X-Request-Id: " in reply, "every answer carries a request id"
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_health_ready_and_metrics(gateway: GatewayFactory):
    gw = await gateway()
    assert (await gw.get("/healthz")).status == 200
    assert (await (await gw.get("/readyz")).json()) == {"status": "ready"}
    await gw.post("/orders/messages", data=b"x")
    text = await (await gw.get("/metrics")).text()
    for name in (
        "sbgate_http_requests_total",
        "sbgate_messages_total",
        "sbgate_broker_send_duration_seconds",
        "sbgate_broker_batch_messages",
        "sbgate_build_info",
        "sbgate_ready 1.0",
    ):
        assert name in text


async def test_a_message_the_sdk_refuses_to_build_is_a_client_error_that_never_counts():
    from gateway.core.message import OutboundMessage
    from gateway.errors import FailureKind, SendFailure
    from gateway.servicebus.client import SdkSender

    class NeverUsed:  # the SDK sender is never reached: building the message fails first
        async def send_messages(self, *_: object) -> None:
            raise AssertionError("nothing may be sent")

    sender = SdkSender("primary", "orders", NeverUsed())  # type: ignore[arg-type]
    with pytest.raises(SendFailure) as info:
        await sender.send([OutboundMessage(body=b"x", message_id="m" * 200)])
    failure = info.value
    assert failure.kind is FailureKind.INVALID_MESSAGE and failure.status == 400
    assert not failure.classification.counts_toward_failover


async def test_sub_second_ttl_reaches_the_broker_in_milliseconds(gateway: GatewayFactory, control):
    gw = await gateway()
    resp = await gw.post(
        "/orders/messages", data=b"x", headers={"BrokerProperties": '{"TimeToLive": 0.5}'}
    )
    assert resp.status == 201
    [m] = await control.messages("primary", "orders")
    assert m["time_to_live_ms"] == 500, "the SDK alone would have truncated 0.5 s to no TTL"


async def test_draining_responses_say_connection_close(gateway: GatewayFactory):
    from gateway.web.handlers import EDGE

    gw = await gateway()
    gw.app[EDGE].lifecycle.draining = True
    resp = await gw.get("/healthz")
    assert resp.headers["Connection"] == "close"
    assert (await gw.get("/readyz")).status == 503


async def test_ttl_beyond_amqp_range_is_sent_without_one_and_fails_no_neighbour(
    gateway: GatewayFactory, control
):
    """AMQP carries a TTL as 32-bit milliseconds (~49.7 days) and the SDK cannot encode more.
    Service Bus caps a TTL at the entity's default anyway, so a longer one is sent as none
    (the entity's default applies: never shorter than asked). It must neither fail the
    request nor the other requests batched with it."""
    gw = await gateway()
    long_ttl = 60 * 86400  # 60 days
    batch = [
        {"Body": "long", "BrokerProperties": {"MessageId": "long", "TimeToLive": long_ttl}},
        {"Body": "short", "BrokerProperties": {"MessageId": "short", "TimeToLive": 60}},
    ]
    single = gw.post(
        "/orders/messages",
        data=b"x",
        headers={"BrokerProperties": '{"MessageId": "single", "TimeToLive": 5184000}'},
    )
    batched = gw.post(
        "/orders/messages",
        data=orjson.dumps(batch),
        headers={"Content-Type": "application/vnd.microsoft.servicebus.json"},
    )
    responses = await asyncio.gather(single, batched)
    assert [r.status for r in responses] == [201, 201]
    stored = {m["message_id"]: m for m in await control.messages("primary", "orders")}
    assert set(stored) == {"long", "short", "single"}
    assert stored["short"]["time_to_live_ms"] == 60_000
    assert not stored["long"]["time_to_live_ms"] and not stored["single"]["time_to_live_ms"]
