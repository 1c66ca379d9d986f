"""Regressions for what the fuzzers found, end to end over HTTP (each was a 500 or a 503)."""

from __future__ import annotations

import orjson
import pytest

from tests.conftest import GatewayFactory
from tests.security.test_slow_clients import open_raw, read_response


@pytest.mark.parametrize(
    "header",
    [
        b"Idempotency-Key: \xff\xfe",  # invalid UTF-8 became the MessageId: 500 when sized
        b"Content-Type: text/\xff",  # the same in the content type
    ],
)
async def test_invalid_utf8_in_headers_is_400(gateway: GatewayFactory, control, header):
    gw = await gateway()
    reader, writer = await open_raw(gw.server.port)
    writer.write(
        b"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\n"
        + header
        + b"\r\n\r\nx"
    )
    status, body = await read_response(reader)
    writer.close()
    assert status == 400, body
    assert "not valid UTF-8" in orjson.loads(body)["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_a_batch_key_too_long_for_its_message_ids_is_400(gateway: GatewayFactory, control):
    """Was a 503 ``upstream_unknown`` from the SDK — an error that counts toward failover, so
    any client could push an entity toward its backlog."""
    gw = await gateway()
    resp = await gw.post(
        "/queues/orders/messages",
        data=b'[{"Body": "a"}, {"Body": "b"}]',
        headers={
            "Content-Type": "application/vnd.microsoft.servicebus.json",
            "Idempotency-Key": "k" * 127,
        },
    )
    assert resp.status == 400, await resp.text()
    assert "Idempotency-Key is too long" in (await resp.json())["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_a_reply_to_session_id_over_128_characters_is_400(gateway: GatewayFactory, control):
    """Was a 503 ``upstream_unknown`` (the SDK's ValueError), counting toward failover."""
    gw = await gateway()
    resp = await gw.post(
        "/queues/orders/messages",
        data=b"x",
        headers={"BrokerProperties": orjson.dumps({"ReplyToSessionId": "r" * 129}).decode()},
    )
    assert resp.status == 400, await resp.text()
    assert "ReplyToSessionId" in (await resp.json())["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0
