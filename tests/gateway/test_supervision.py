"""No task dies silently (issue 21 item 5): an exception injected into each long-running loop
is logged, counted in sbgate_task_restarts_total, and the loop's work goes on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from gateway.core.failover import Failover
from gateway.lifetimes import Backoff, supervised
from gateway.metrics import Metrics
from gateway.state import EntityState, RedisStateStore
from gateway.syphon.syphon import Syphon
from tests.conftest import GatewayFactory
from tests.gateway.test_syphon import SYPHON as SYPHON_ENV
from tests.support.fakes import Restarts
from tests.support.processes import RedisServer
from tests.support.waiting import eventually


def fail_once(cls_or_obj: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make method `name` raise RuntimeError on its first call, then behave."""
    original = getattr(cls_or_obj, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError(f"injected into {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(cls_or_obj, name, wrapper)
    return calls


async def test_a_loop_that_raises_is_logged_counted_and_restarted(caplog):
    runs: list[int] = []
    restarts = Restarts()

    async def loop() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="gateway.lifetimes"):
        await supervised("demo", loop, restarts, backoff=Backoff(0.01, 0.02))
    assert len(runs) == 3 and restarts.counts == {"demo": 2}
    assert caplog.records[0].exc_info is not None, "logged with its traceback"


async def test_cancelling_a_supervised_loop_stops_it_at_once():
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(supervised("demo", loop))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# One backlog queue; pings only when a test asks for them.
SYPHON = {**SYPHON_ENV, "SBGATE_BACKLOG_QUEUE_COUNT": "1", "SBGATE_PING_PRIMARY_INTERVAL": "60"}


@pytest.mark.parametrize(
    ("method", "task"),
    [("_move_once", "syphon_queue"), ("_depth_check", "syphon_supervisor")],
)
async def test_the_syphon_loops_survive_an_exception(
    gateway: GatewayFactory, control, monkeypatch, method, task
):
    calls = fail_once(Syphon, method, monkeypatch)
    metrics = Metrics()
    gw = await gateway(SYPHON, metrics=metrics)
    assert (await gw.post("/admin/entities/orders/failover")).status == 200
    assert (await gw.post("/queues/orders/messages", data=b"m")).status == 202
    assert (await gw.post("/admin/entities/orders/healthy")).status == 200

    async def home() -> bool:
        return (await control.entity("primary", "orders"))["active"] == 1

    await eventually(home, within=20, every=0.1)
    # The loop runs again after its backoff (the message may have gone home before that,
    # moved by the other loop: waking on the announcement, not on the depth check).
    await eventually(lambda: calls[0] >= 2, within=20, what=f"{method} ran again")
    assert metrics.registry.get_sample_value("sbgate_task_restarts_total", {"task": task}) >= 1


async def test_a_pinger_survives_an_exception(gateway: GatewayFactory, control, monkeypatch):
    calls = fail_once(Failover, "_ping", monkeypatch)
    metrics = Metrics()
    gw = await gateway({**SYPHON, "SBGATE_PING_PRIMARY_INTERVAL": "0.2"}, metrics=metrics)
    assert (await gw.post("/admin/entities/orders/failover")).status == 200

    async def healthy() -> bool:
        listing = (await (await gw.get("/admin/entities")).json())["entities"]
        return next(e for e in listing if e["entity"] == "orders")["state"] == "healthy"

    await eventually(healthy, within=20, every=0.1)
    assert calls[0] >= 2
    restarts = metrics.registry.get_sample_value("sbgate_task_restarts_total", {"task": "pinger"})
    assert restarts == 1


@pytest.mark.parametrize(
    ("method", "task"),
    [("_next_job", "state_writer"), ("_session_failed", "state_supervisor")],
)
async def test_the_state_loops_survive_an_exception(
    redis_server: RedisServer, monkeypatch, method, task
):
    restarts = Restarts()
    writer = RedisStateStore(
        redis_server.url, "r1", op_timeout=0.5, reconnect_backoff=Backoff(0.05, 0.3, jitter=0.25)
    )
    reader = RedisStateStore(
        redis_server.url, "r2", op_timeout=0.5, reconnect_backoff=Backoff(0.05, 0.3, jitter=0.25)
    )
    writer.task_observer = restarts
    calls = fail_once(writer, method, monkeypatch)
    if method == "_session_failed":
        fail_once(writer, "_session", monkeypatch)  # the failure it is told about
    await writer.start()
    await reader.start()
    try:
        await eventually(lambda: writer.connected, within=10)
        st = writer.get("orders")
        assert writer.propose(st, "failed_over", "test") is not None

        def seen() -> bool:
            state: EntityState = reader.get("orders")
            return state.status == "failed_over"

        await eventually(seen, within=10)
        assert calls[0] >= 1 and restarts.counts == {task: 1}
    finally:
        await reader.close()
        await writer.close()
