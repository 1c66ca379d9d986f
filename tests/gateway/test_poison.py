"""One bad message never hurts another (issue 21), end to end: the real SDK over AMQP
against the local broker. Each test reproduces one report; each failed before its fix."""

from __future__ import annotations

import orjson

from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.security.test_slow_clients import open_raw, read_response

FAILOVER = {
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_FAILOVER_INTERVAL": "10",
    "SBGATE_PING_PRIMARY_INTERVAL": "60",
    "SBGATE_BACKLOG_QUEUE_COUNT": "2",
    "SBGATE_SDK_RETRY_TOTAL": "0",
}


async def entity_states(gw) -> dict[str, str]:
    listing = await (await gw.get("/admin/entities")).json()
    return {e["entity"]: e["state"] for e in listing["entities"]}


async def test_a_non_ascii_content_type_is_400_at_the_edge(gateway: GatewayFactory, control):
    """Four of these took `orders` and every backlog queue down (amqp:decode-error counted
    as a service failure). The edge knows an AMQP symbol is ASCII: none reaches the broker."""
    gw = await gateway(FAILOVER)
    for _ in range(4):
        reader, writer = await open_raw(gw.server.port)
        writer.write(
            b"POST /queues/orders/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
            b"Content-Type: t\xc3\xa9xt/plain\r\n\r\nx"
        )
        status, body = await read_response(reader)
        writer.close()
        assert status == 400, body
        assert "ASCII" in orjson.loads(body)["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0
    assert (await entity_states(gw))["orders"] == "healthy"


async def test_a_reserved_header_is_400_and_never_stored(
    gateway: GatewayFactory, control: ControlClient
):
    gw = await gateway(FAILOVER)
    r = await gw.post(
        "/queues/orders/messages", data=b"x", headers={"X-MS-TimeToLive": "999999999999999999"}
    )
    assert r.status == 400
    body = await r.json()
    assert body["property"] == "X-MS-TimeToLive" and "reserved" in body["message"]
    assert (await control.counters("primary")).get("sends", 0) == 0
