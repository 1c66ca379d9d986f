"""The event ledger as the gateway writes it: accepted, rejected, failover, ping, syphoned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from gateway.ledger import LEDGER_VERSION
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually


def read_events(directory: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for f in sorted(directory.rglob("*.jsonl"))
        for line in f.read_bytes().splitlines()
        if line
    ]


async def test_the_gateway_writes_every_event_kind(
    gateway: GatewayFactory, control, tmp_path: Path
):
    env = {
        "SBGATE_LEDGER": str(tmp_path),
        "SBGATE_REPLICA_ID": "gw-test",
        "SBGATE_ENABLE_FAILOVER": "true",
        "SBGATE_ENABLE_SYPHON": "true",
        "SBGATE_FAILOVER_INTERVAL": "0",
        "SBGATE_PING_PRIMARY_INTERVAL": "0.2",
        "SBGATE_BACKLOG_QUEUE_COUNT": "2",
        "SBGATE_SDK_RETRY_TOTAL": "0",
        "SBGATE_RECEIVE_WAIT": "0.5",
    }
    gw = await gateway(env)
    assert (
        await gw.post(
            "/orders/messages",
            data=b"a",
            headers={"Idempotency-Key": "led-1", "BrokerProperties": '{"SessionId": "s-1"}'},
        )
    ).status == 201
    assert (
        await gw.post(
            "/orders/messages", data=b"b", headers={"BrokerProperties": '{"TimeToLive": -1}'}
        )
    ).status == 400
    fault = await control.add_fault(
        "primary", "amqp:internal-error", operation="send", entity="orders"
    )
    assert (
        await gw.post("/orders/messages", data=b"c", headers={"Idempotency-Key": "led-2"})
    ).status == 202
    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return (await control.entity("primary", "orders"))["active"] == 2

    await eventually(home, within=20, every=0.1)

    async def written() -> bool:
        kinds = {e["event"] for e in read_events(tmp_path)}
        return {"accepted", "failover_start", "ping", "failover_end", "syphoned"} <= kinds

    await eventually(written, within=10, every=0.1)
    events = read_events(tmp_path)
    assert all(
        e["v"] == LEDGER_VERSION and e["replica"] == "gw-test" and e["event_id"] for e in events
    )
    accepted = {e["message_id"]: e for e in events if e["event"] == "accepted"}
    assert accepted["led-1"]["route"] == "primary" and accepted["led-2"]["route"] == "backlog"
    # The audit's per-session order check reads these two (docs/pipeline.md).
    assert (accepted["led-1"]["session_id"], accepted["led-2"]["session_id"]) == ("s-1", None)
    assert accepted["led-1"]["seq"] < accepted["led-2"]["seq"]
    assert accepted["led-2"]["backlog"].startswith("primary/x-servicebus-transfer/")
    assert [e["message_id"] for e in events if e["event"] == "syphoned"] == ["led-2"]
    assert len({e["event_id"] for e in events}) == len(events)
    assert list(tmp_path.glob("dt=*/hour=*/gw-test.jsonl"))
    metrics = await (await gw.get("/metrics")).text()
    assert "sbgate_ledger_events_written_total" in metrics
