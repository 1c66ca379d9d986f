"""The metrics dashboards assume: standard collectors, no `_created`, failover state by name,
and the backlog's depth, head age and dwell time — driven through the real failover and
syphon on virtual time (`tests/support/failover_rig.py`)."""

from __future__ import annotations

import dataclasses

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.backlog import rewrite
from gateway.metrics import Metrics
from gateway.state import StoreStats
from gateway.syphon.syphon import BUSY_CHECK_INTERVAL
from tests.support.failover_rig import FAILOVER, ORDERS, QUEUES, Replica, messages
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import FakeRedis
from tests.support.virtual_time import VirtualTimeLoop, elapse


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_standard_collectors_are_there_and_no_created_series() -> None:
    text = generate_latest(Metrics().registry).decode()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"):
        assert f"\n{name}" in text or text.startswith(name), name
    assert "python_gc_collections_total" in text
    assert "_created" not in text


def test_the_state_stores_counts_are_read_at_scrape_time() -> None:
    m = Metrics()
    stats = StoreStats()
    m.bind_state(stats)
    assert samples(m)[("sbgate_redis_data_lost_total", ())] == 0
    stats.data_losses += 2  # Redis lost its data twice (the dataset mark: docs/state.md)
    stats.invalid_values["event"] = 1
    got = samples(m)
    assert got[("sbgate_redis_data_lost_total", ())] == 2
    assert got[("sbgate_state_invalid_values_total", (("source", "event"),))] == 1


def test_failover_state_by_name_one_series_per_state() -> None:
    m = Metrics()
    m.entity_state("orders", "failed_over")
    got = samples(m)
    states = {
        dict(labels)["sbgate_failover_status"]: v
        for (name, labels), v in got.items()
        if name == "sbgate_failover_status" and dict(labels)["entity"] == "orders"
    }
    assert states == {"healthy": 0.0, "failing": 0.0, "failed_over": 1.0}
    assert got[("sbgate_failover_state", (("entity", "orders"),))] == 2.0


def test_backlog_gauges_and_dwell_follow_a_failover() -> None:
    loop = VirtualTimeLoop()
    metrics = Metrics()

    async def scenario() -> None:
        redis, primary, secondary = FakeRedis(), FakeNamespace("p"), FakeNamespace("s")
        no_pings = dataclasses.replace(FAILOVER, ping_primary_interval=3600)
        r = Replica("r0", redis, primary, secondary, metrics=metrics, failover=no_pings)
        await r.start()
        assert r.syphon is not None
        try:
            await elapse(2)
            idle_checks = r.syphon.stats.operations["depth_check"]
            await elapse(10 * BUSY_CHECK_INTERVAL)
            assert r.syphon.stats.operations["depth_check"] == idle_checks, "idle: no checks"

            r.failover.force_failover(ORDERS)
            await elapse(0.1)
            accepted = loop.time()
            assert (await r.failover.submit(ORDERS, messages("a", "b"))).route == "backlog"
            [queue] = [q for q in QUEUES if secondary.ids(q)]
            before = r.syphon.stats.operations["depth_check"]
            await elapse(3 * BUSY_CHECK_INTERVAL + 1)
            checks = r.syphon.stats.operations["depth_check"] - before
            assert checks >= 3, "busy: a depth check every BUSY_CHECK_INTERVAL"
            got = samples(metrics)
            assert got[("sbgate_backlog_messages", (("queue", queue),))] == 2.0
            oldest = ("sbgate_backlog_oldest_message_timestamp_seconds", (("queue", queue),))
            assert got[oldest] == accepted, "the head of the queue, seen by a blocked receive"

            r.failover.mark_healthy(ORDERS)
            await elapse(5)
            assert sorted(primary.ids("orders")) == ["a", "b"]
            await elapse(BUSY_CHECK_INTERVAL + 1)
            got = samples(metrics)
            assert got[("sbgate_backlog_messages", (("queue", queue),))] == 0.0
            assert oldest not in got, "absent once the queue is empty"
            dwell = got[("sbgate_backlog_dwell_seconds_count", (("entity", "orders"),))]
            total = got[("sbgate_backlog_dwell_seconds_sum", (("entity", "orders"),))]
            assert dwell == 2.0 and total >= 2 * 3 * BUSY_CHECK_INTERVAL
        finally:
            await r.stop()

    try:
        loop.run(scenario())
    finally:
        loop.close()


def test_a_message_without_an_acceptance_time_has_no_dwell() -> None:
    loop = VirtualTimeLoop()
    metrics = Metrics()

    async def scenario() -> None:
        primary, secondary = FakeNamespace("p"), FakeNamespace("s")
        r = Replica("r0", FakeRedis(), primary, secondary, metrics=metrics)
        await r.start()
        try:
            stored = rewrite(messages("old")[0], "orders", 0.0)
            props = {k: v for k, v in stored.application_properties.items() if "accepted" not in k}
            await secondary.store(
                QUEUES[0], [dataclasses.replace(stored, application_properties=props)]
            )
            assert r.syphon is not None
            r.syphon.request_check()
            await elapse(5)
            assert primary.ids("orders") == ["old"]
            assert ("sbgate_backlog_dwell_seconds_count", (("entity", "orders"),)) not in samples(
                metrics
            )
        finally:
            await r.stop()

    try:
        loop.run(scenario())
    finally:
        loop.close()
