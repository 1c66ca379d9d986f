"""The failback edges end to end: the real SDK, the local broker, the gateway's HTTP API.

The deterministic proofs (every interleaving, virtual time) are in `test_failback_edges.py`
and `test_failback_property.py`; these drive the same reproductions as an operator would.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import time
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.app import default_backlog_factory, default_client_factory, shared_credential
from gateway.config import NamespaceSettings, load_settings
from gateway.core.backlog import is_backlog_path
from gateway.core.failover import MARKED_HEALTHY, PING_DELIVERED
from gateway.core.message import OutboundMessage
from gateway.core.ports import BacklogPort, NamespaceClient, Sender
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.support.processes import broker_env
from tests.support.waiting import eventually

BACKLOGS = [f"primary/x-servicebus-transfer/{i}" for i in range(3)]
ENV = {
    "SBGATE_ENABLE_FAILOVER": "true",
    "SBGATE_ENABLE_SYPHON": "true",
    "SBGATE_FAILOVER_INTERVAL": "0",
    "SBGATE_PING_PRIMARY_INTERVAL": "60",
    "SBGATE_BACKLOG_QUEUE_COUNT": "3",
    "SBGATE_SDK_RETRY_TOTAL": "0",
    "SBGATE_SEND_TIMEOUT": "3",
    "SBGATE_RECEIVE_WAIT": "1",
    # The slow safety check would eventually rescue a message nobody woke the syphon for;
    # at its default (15 min) it is far beyond every deadline below.
    "SBGATE_IDLE_CHECK_INTERVAL": "900",
}


async def entity(gw: Any, name: str = "orders") -> dict[str, Any]:
    body = await (await gw.get("/admin/entities")).json()
    [row] = [e for e in body["entities"] if e["entity"] == name]
    return row  # type: ignore[no-any-return]


async def backlog_total(control: ControlClient) -> int:
    return sum([(await control.entity("secondary", q))["active"] for q in BACKLOGS])


async def home_ids(control: ControlClient, path: str = "orders") -> list[str]:
    return sorted(m["message_id"] for m in await control.messages("primary", path))


async def test_a_forced_failover_holds_until_a_ping_after_the_interval(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway({**ENV, "SBGATE_PING_PRIMARY_INTERVAL": "1.5"})
    started = time.monotonic()
    resp = await gw.post("/admin/entities/orders/failover")
    assert (await resp.json())["status"] == "failed_over"
    assert (await gw.post("/orders/messages", data=b"held")).status == 202
    await eventually(lambda: _state(gw, "healthy"), within=15)
    assert time.monotonic() - started >= 1.5, "not before ping_primary_interval"
    row = await entity(gw)
    assert row["reason"] == PING_DELIVERED and row["nextPing"] is None
    assert (await control.counters("primary")).get("pings", 0) >= 1


async def test_an_operator_ends_a_forced_failover_and_the_admin_view_says_so(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway(ENV)
    before = time.time()
    await gw.post("/admin/entities/orders/failover")
    await eventually(lambda: _next_ping_set(gw))
    row = await entity(gw)
    assert row["state"] == "failed_over" and row["nextPing"] >= before + 60
    assert (await gw.post("/admin/entities/orders/healthy")).status == 200
    row = await entity(gw)
    assert (row["state"], row["reason"]) == ("healthy", MARKED_HEALTHY)
    assert (await control.counters("primary")).get("pings", 0) == 0


class Gate:
    """Holds backlog writes on their way to the broker until the test opens it: the field
    report's writes still in flight (a backlog sender still opening) when the failback
    comes. Counts the messages it holds."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.held = 0


class GatedSender:
    def __init__(self, inner: Sender, gate: Gate) -> None:
        self._inner, self._gate = inner, gate

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        self._gate.held += len(messages)
        await self._gate.open.wait()
        await self._inner.send(messages)

    async def close(self) -> None:
        await self._inner.close()


class GatedClient:
    def __init__(self, inner: NamespaceClient, gate: Gate) -> None:
        self.inner, self._gate = inner, gate

    @property
    def name(self) -> str:
        return self.inner.name

    async def open_sender(self, path: str) -> Sender:
        sender = await self.inner.open_sender(path)
        return GatedSender(sender, self._gate) if is_backlog_path(path) else sender

    async def close(self) -> None:
        await self.inner.close()


async def test_backlog_writes_completing_after_the_failback_are_moved_home(
    gateway: GatewayFactory, control: ControlClient, broker: BrokerProcess
) -> None:
    gate = Gate()
    settings = load_settings(broker_env(broker, **ENV))
    credential = shared_credential(settings)  # the app owns it and closes it
    make = default_client_factory(settings, credential)

    def clients(ns: NamespaceSettings) -> NamespaceClient:
        return GatedClient(make(ns), gate)

    def backlogs(ns: NamespaceSettings, client: NamespaceClient) -> BacklogPort | None:
        assert isinstance(client, GatedClient)
        return default_backlog_factory(ns, client.inner)

    gw = await gateway(ENV, client_factory=clients, backlog_factory=backlogs, credential=credential)
    await gw.post("/admin/entities/orders/failover")
    sends = [
        asyncio.ensure_future(gw.post("/orders/messages", data=b"x", headers=_id(f"race-{i}")))
        for i in range(4)
    ]
    await eventually(lambda: gate.held == 4, what="4 backlog writes in flight")
    checks = await _depth_checks(gw)
    await gw.post("/admin/entities/orders/healthy")
    await eventually(lambda: _depth_checks_above(gw, checks), what="the failback's depth check")
    assert await backlog_total(control) == 0, "the writes are still on their way"
    gate.open.set()
    assert [r.status for r in await asyncio.gather(*sends)] == [202] * 4
    want = [f"race-{i}" for i in range(4)]
    # Well within TIME_TO_HOME (1 + 1 + 3 s here); without a wake-up they would wait 15 min.
    await eventually(lambda: _home_is(control, want), within=10)
    # Each is completed in the backlog after it is home: under load that can come a little later.
    await eventually(lambda: _backlog_is_empty(control), within=10, what="the backlog emptied")
    assert await home_ids(control) == want, "and nothing came home twice"


async def test_a_scheduled_message_goes_home_expiring_at_its_schedule_plus_ttl(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway(ENV)
    await gw.post("/admin/entities/orders/failover")
    schedule = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(seconds=90)
    sent = {}
    for mid, ttl in (("short", 10), ("long", 3600)):
        props = {
            "MessageId": mid,
            "TimeToLive": ttl,
            "ScheduledEnqueueTimeUtc": email.utils.format_datetime(schedule, usegmt=True),
        }
        resp = await gw.post(
            "/orders/messages",
            data=b"s",
            headers=_props(props),
        )
        assert resp.status == 202
        sent[mid] = ttl
    await gw.post("/admin/entities/orders/healthy")
    await eventually(lambda: _home_is(control, sorted(sent)), within=10)
    for m in await control.messages("primary", "orders"):
        assert m["state"] == "scheduled"
        assert _ts(m["scheduled_enqueue_time"]) == schedule.timestamp()
        expires = schedule.timestamp() + sent[m["message_id"]]
        assert _ts(m["expires_at"]) == expires, "expires at the original schedule + TTL"


def _props(props: dict[str, Any]) -> dict[str, str]:
    return {"BrokerProperties": orjson.dumps(props).decode()}


def _id(message_id: str) -> dict[str, str]:
    return _props({"MessageId": message_id})


def _ts(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def _state(gw: Any, state: str) -> bool:
    return (await entity(gw))["state"] == state


async def _next_ping_set(gw: Any) -> bool:
    return (await entity(gw))["nextPing"] is not None


async def _home_is(control: ControlClient, ids: list[str]) -> bool:
    return await home_ids(control) == ids


async def _backlog_is_empty(control: ControlClient) -> bool:
    return await backlog_total(control) == 0


async def _depth_checks(gw: Any) -> float:
    text = await (await gw.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith('sbgate_syphon_broker_operations_total{kind="depth_check"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _depth_checks_above(gw: Any, n: float) -> bool:
    return await _depth_checks(gw) > n
