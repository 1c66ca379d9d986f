"""Hostile traffic, mixed with good, through failover, failback and the syphon (issue 21
item 7): a property-based test against the local broker over real AMQP.

Hypothesis generates a mix of good requests and hostile ones — reserved property names,
undecodable fields, sessionless sends to a session entity (alone, and sharing a micro-batch
with good ones), oversized and over-nested bodies, chunked bodies over the body limit (good
ones are chunked too: no Content-Length), and poison written straight into a backlog
queue — and runs it twice: all healthy, then with a broker fault on `orders` (it fails over;
its good requests are answered 202) that is then lifted (a ping fails it back and the syphon
moves its backlog home). The properties:

* every hostile request is a 4xx, every good one a 2xx;
* every good 2xx message reaches its entity, once the backlog has drained;
* no entity changes state without an injected broker fault (`sessions` never; `orders` only
  while its fault is on);
* no backlog queue leaves rotation (none has a fault);
* the poison in the backlog is dead-lettered there, never delivered.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.metrics import Metrics
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_poison import inject, session_queue
from tests.gateway.test_syphon import BACKLOGS, SYPHON
from tests.support.waiting import eventually

ENV = {**SYPHON, "SBGATE_ENTITIES": "queue:orders,queue:sessions"}
RESERVED = [
    "x-ms-path",
    "x-ms-timetolive",
    "x-ms-sessionid",
    "x-ms-scheduledenqueuetimeutc",
    "x-ms-partitionkey",
    "x-ms-acceptedtimeutc",
    "x-ms-fencetoken",
]
BATCH = "application/vnd.microsoft.servicebus.json"
_ids = itertools.count()


@dataclass
class Request:
    kind: str
    entity: str
    good: bool
    data: bytes
    headers: dict[str, str]
    ids: list[str]  # the MessageIds a good request stores
    chunks: int = 0  # > 0: sent chunked, in this many pieces (no Content-Length)


def _props(**kw: Any) -> str:
    return orjson.dumps(kw).decode()


def build(kind: str, variant: int) -> Request:
    """One request of `kind`; `variant` picks among its forms (a name's letter case, say)."""
    n = next(_ids)
    mid = f"m{n}"
    if kind == "good":
        return Request(
            kind, "orders", True, b"ok", {"BrokerProperties": _props(MessageId=mid)}, [mid]
        )
    if kind == "good-chunked":
        body = f"ok-{mid}-".encode() * (1 + variant * 50)
        props = {"BrokerProperties": _props(MessageId=mid)}
        return Request(kind, "orders", True, body, props, [mid], chunks=1 + variant % 4)
    if kind == "good-session":
        props = _props(MessageId=mid, SessionId="p")
        return Request(kind, "sessions", True, b"ok", {"BrokerProperties": props}, [mid])
    if kind == "good-batch":
        items = [
            {
                "Body": "ok",
                "BrokerProperties": {"MessageId": f"{mid}-{i}"},
                "UserProperties": {"i": i},
            }
            for i in range(1 + variant % 3)
        ]
        ids = [f"{mid}-{i}" for i in range(len(items))]
        return Request(kind, "orders", True, orjson.dumps(items), {"Content-Type": BATCH}, ids)
    if kind == "reserved-header":
        name = RESERVED[variant % len(RESERVED)]
        name = name.upper() if variant % 2 else name
        return Request(kind, "orders", False, b"x", {name: "999999999999999999"}, [])
    if kind == "reserved-user-property":
        name = RESERVED[variant % len(RESERVED)].title()
        items = [{"Body": "ok"}, {"Body": "bad", "UserProperties": {name: "elsewhere"}}]
        return Request(kind, "orders", False, orjson.dumps(items), {"Content-Type": BATCH}, [])
    if kind == "non-ascii-content-type":
        items = [{"Body": "x", "BrokerProperties": {"ContentType": "t\u00e9xt/plain"}}]
        return Request(kind, "orders", False, orjson.dumps(items), {"Content-Type": BATCH}, [])
    if kind == "sessionless-to-session":
        # PartitionKey "p" shares the good session requests' batch key: a shared micro-batch.
        props = _props(MessageId=mid, PartitionKey="p") if variant % 2 else _props(MessageId=mid)
        return Request(kind, "sessions", False, b"x", {"BrokerProperties": props}, [])
    if kind == "oversized":
        return Request(kind, "orders", False, b"x" * 300_000, {}, [])
    if kind == "oversized-chunked":  # over the body limit (1 MiB), with no length to refuse
        return Request(kind, "orders", False, b"x" * (1 << 20) + b"y", {}, [], chunks=2 + variant)
    if kind == "too-many-items":
        return Request(
            kind, "orders", False, b"[" + b"{}," * 5000 + b"{}]", {"Content-Type": BATCH}, []
        )
    if kind == "over-nested":
        body = b'[{"Body": "x", "UserProperties": {"a": ' + b"[" * 50 + b"]" * 50 + b"}}]"
        return Request(kind, "orders", False, body, {"Content-Type": BATCH}, [])
    if kind == "bad-ttl":
        props = _props(MessageId=mid, TimeToLive=-1 - variant)
        return Request(kind, "orders", False, b"x", {"BrokerProperties": props}, [])
    raise AssertionError(kind)


GOOD = ["good", "good-session", "good-batch", "good-chunked"]
HOSTILE = [
    "oversized-chunked",
    "reserved-header",
    "reserved-user-property",
    "non-ascii-content-type",
    "sessionless-to-session",
    "oversized",
    "too-many-items",
    "over-nested",
    "bad-ttl",
]
requests = st.lists(
    st.tuples(st.sampled_from(GOOD + HOSTILE), st.integers(0, 11)), min_size=4, max_size=14
)
POISON = [
    {"x-ms-path": "orders", "x-ms-timetolive": 999999999999999999},
    {"x-ms-path": "elsewhere"},
    {"x-ms-path": "sessions"},  # restorable, refused by the primary (no SessionId)
]


async def send_all(gw: Any, plan: list[tuple[str, int]]) -> list[Request]:
    """Send the plan's requests concurrently (so they share micro-batches); check answers."""
    reqs = [build(kind, variant) for kind, variant in plan]

    async def pieces(data: bytes, n: int) -> AsyncIterator[bytes]:
        size = -(-len(data) // n)
        for i in range(0, len(data), size):
            yield data[i : i + size]

    async def one(r: Request) -> tuple[Request, int, str]:
        data = pieces(r.data, r.chunks) if r.chunks else r.data
        resp = await gw.post(f"/queues/{r.entity}/messages", data=data, headers=r.headers)
        return r, resp.status, await resp.text()

    for r, status, text in await asyncio.gather(*(one(r) for r in reqs)):
        if r.good:
            assert status in (201, 202), (r.kind, status, text)
        else:
            assert status in (400, 413), (r.kind, status, text)
    return [r for r in reqs if r.good]


def transitions(metrics: Metrics, entity: str) -> float:
    return sum(
        metrics.registry.get_sample_value(
            "sbgate_failover_transitions_total", {"entity": entity, "state": s}
        )
        or 0.0
        for s in ("failing", "failed_over")
    )


async def at_home(control: ControlClient, entity: str) -> dict[str, str | None]:
    """The messages at `entity`: MessageId → body (as text)."""
    listed = await control.messages("primary", entity, limit=1000)
    return {m["message_id"]: m["body_text"] for m in listed}


@pytest.mark.timeout(120)
@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(healthy_plan=requests, failover_plan=requests)
async def test_hostile_traffic_never_hurts_good_traffic(
    gateway: GatewayFactory,
    control: ControlClient,
    broker: BrokerProcess,
    healthy_plan: list[tuple[str, int]],
    failover_plan: list[tuple[str, int]],
) -> None:
    await control.reset()
    await session_queue(control)
    metrics = Metrics()
    gw = await gateway(ENV, metrics=metrics)
    try:
        await scenario(gw, control, broker, metrics, healthy_plan, failover_plan)
    finally:
        await gw.close()  # one gateway (and syphon) per example


async def scenario(
    gw: Any,
    control: ControlClient,
    broker: BrokerProcess,
    metrics: Metrics,
    healthy_plan: list[tuple[str, int]],
    failover_plan: list[tuple[str, int]],
) -> None:
    good = await send_all(gw, healthy_plan)
    assert transitions(metrics, "orders") == transitions(metrics, "sessions") == 0

    # A broker fault on orders: it fails over, its good requests go to a backlog queue.
    fault = await control.add_fault(
        "primary", "amqp:internal-error", entity="orders", operation="send"
    )
    trigger = build("good", 0)
    r = await gw.post("/queues/orders/messages", data=trigger.data, headers=trigger.headers)
    assert r.status == 202
    good.append(trigger)
    for i, props in enumerate(POISON):
        await inject(broker, BACKLOGS[i % 2], f"poison-{i}", props)
    good += await send_all(gw, failover_plan)
    await control.remove_fault("primary", fault)

    async def drained() -> bool:
        listing = (await (await gw.get("/admin/entities")).json())["entities"]
        if any(e["state"] != "healthy" for e in listing):
            return False
        depths = [await control.entity("secondary", q) for q in BACKLOGS]
        return all(d["active"] == 0 for d in depths)

    await eventually(drained, within=30, every=0.1)
    for entity in ("orders", "sessions"):
        expected = {i for r in good if r.entity == entity for i in r.ids}
        home = await at_home(control, entity)
        missing = expected - home.keys()
        assert not missing, f"good messages lost for {entity}: {sorted(missing)}"
        for r in good:  # a chunked body arrives whole
            if r.chunks and r.entity == entity:
                assert home[r.ids[0]] == r.data.decode(), r
    assert transitions(metrics, "sessions") == 0, "sessions changed state with no fault"
    assert metrics.registry.get_sample_value("sbgate_backlog_queues_out_of_rotation") == 0
    failed = [
        metrics.registry.get_sample_value(
            "sbgate_backlog_sends_total", {"queue": q, "outcome": "failed"}
        )
        for q in BACKLOGS
    ]
    assert not any(failed), failed
    dead = [await control.entity("secondary", q) for q in BACKLOGS]
    assert sum(d["dead_letter"] for d in dead) == len(POISON)
