"""MemoryStateStore: the single-process store (CAS on the epoch, listeners, backlogs, leases)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.state import BacklogState, EntityState, MemoryStateStore, StateStore

pytestmark = pytest.mark.timeout(10)

T0 = 1_700_000_000.0


class StepClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Listener pair that records every call and lets a test await the n-th one."""

    def __init__(self) -> None:
        self.entities: list[EntityState] = []
        self.backlogs: list[BacklogState] = []
        self._changed = asyncio.Event()

    def on_entity(self, s: EntityState) -> None:
        self.entities.append(s)
        self._changed.set()

    def on_backlog(self, b: BacklogState) -> None:
        self.backlogs.append(b)
        self._changed.set()

    async def wait_for(self, entities: int = 0, backlogs: int = 0, timeout: float = 2.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.entities) < entities or len(self.backlogs) < backlogs:
                self._changed.clear()
                await self._changed.wait()


@pytest.fixture
async def store() -> MemoryStateStore:
    s = MemoryStateStore("r1", clock=StepClock())
    await s.start()
    return s


def test_is_a_state_store() -> None:
    s: StateStore = MemoryStateStore("r1")
    assert s.replica_id == "r1"
    assert s.connected


async def test_unknown_entity_is_healthy_epoch_zero(store: MemoryStateStore) -> None:
    assert store.get("orders") == EntityState("orders")
    assert store.snapshot() == {}


async def test_transitions_bump_the_epoch_and_record_who_and_when(
    store: MemoryStateStore,
) -> None:
    failing = store.propose(store.get("orders"), "failing", "timeout", since=T0 - 5)
    assert failing == EntityState("orders", "failing", 1, T0 - 5, "r1", "timeout")
    over = store.propose(failing, "failed_over", "timeout")
    assert over == EntityState("orders", "failed_over", 2, T0, "r1", "timeout")
    healthy = store.propose(over, "healthy", "ping")
    assert healthy is not None and healthy.epoch == 3
    assert store.get("orders") == healthy
    assert store.snapshot() == {"orders": healthy}


async def test_stale_proposal_is_rejected_and_changes_nothing(store: MemoryStateStore) -> None:
    base = store.get("orders")
    first = store.propose(base, "failing", "timeout")
    assert first is not None
    assert store.propose(base, "failed_over", "timeout") is None  # built on epoch 0
    assert store.propose(EntityState("orders", "failing", 7), "healthy", "ping") is None
    assert store.get("orders") == first


async def test_listeners_run_on_the_loop_after_propose_in_order(store: MemoryStateStore) -> None:
    rec = Recorder()
    store.subscribe(rec.on_entity, rec.on_backlog)
    a = store.propose(store.get("a"), "failing", "timeout")
    assert a is not None
    b = store.propose(a, "failed_over", "timeout")
    # Not called from inside propose: the caller finishes first, like with Redis.
    assert rec.entities == []
    await rec.wait_for(entities=2)
    assert rec.entities == [a, b]


async def test_a_failing_listener_is_logged_and_others_still_run(
    store: MemoryStateStore, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: EntityState) -> None:
        raise RuntimeError("listener bug")

    rec = Recorder()
    store.subscribe(broken, rec.on_backlog)
    store.subscribe(rec.on_entity, rec.on_backlog)
    with caplog.at_level(logging.ERROR):
        first = store.propose(store.get("a"), "failing", "timeout")
        assert first is not None
        store.propose(first, "healthy", "ping")
        await rec.wait_for(entities=2)
    assert "listener bug" in caplog.text
    assert [s.epoch for s in rec.entities] == [1, 2]


async def test_backlog_disable_expires_by_the_clock() -> None:
    clock = StepClock()
    store = MemoryStateStore("r1", clock=clock)
    await store.start()
    rec = Recorder()
    store.subscribe(rec.on_entity, rec.on_backlog)
    store.disable_backlog("ns/x-servicebus-transfer/3", T0 + 30, "send failed")
    assert store.backlogs_disabled(clock()) == {"ns/x-servicebus-transfer/3"}
    assert store.backlogs_disabled(T0 + 29.9) == {"ns/x-servicebus-transfer/3"}
    clock.now = T0 + 30
    assert store.backlogs_disabled(clock()) == frozenset()
    await rec.wait_for(backlogs=1)
    assert rec.backlogs == [
        BacklogState("ns/x-servicebus-transfer/3", T0 + 30, "r1", "send failed")
    ]


async def test_backlog_later_until_wins_and_enable_puts_it_back(store: MemoryStateStore) -> None:
    rec = Recorder()
    store.subscribe(rec.on_entity, rec.on_backlog)
    store.disable_backlog("q0", T0 + 60, "first")
    store.disable_backlog("q0", T0 + 10, "shorter: ignored")
    assert store.backlogs_disabled(T0 + 30) == {"q0"}
    store.enable_backlog("q0")
    store.enable_backlog("q0")  # already in rotation: nothing to tell
    assert store.backlogs_disabled(T0) == frozenset()
    await rec.wait_for(backlogs=2)
    assert [(b.queue, b.until, b.reason) for b in rec.backlogs] == [
        ("q0", T0 + 60, "first"),
        ("q0", 0.0, ""),
    ]


async def test_lease_is_held_until_it_expires_or_is_released() -> None:
    clock = StepClock()
    store = MemoryStateStore("r1", clock=clock)
    await store.start()
    assert await store.lease_holder("ping:orders") is None
    assert await store.acquire_lease("ping:orders", 5.0)
    assert await store.lease_holder("ping:orders") == "r1"
    clock.now += 4.9
    assert await store.acquire_lease("ping:orders", 5.0)  # renewed: another 5 s
    clock.now += 4.9
    assert await store.lease_holder("ping:orders") == "r1"
    clock.now += 0.2
    assert await store.lease_holder("ping:orders") is None  # not renewed: expired
    assert await store.acquire_lease("ping:orders", 5.0)
    await store.release_lease("ping:orders")
    assert await store.lease_holder("ping:orders") is None


async def test_two_memory_stores_share_nothing() -> None:
    a, b = MemoryStateStore("a"), MemoryStateStore("b")
    await a.start()
    await b.start()
    a.propose(a.get("orders"), "failing", "timeout")
    a.disable_backlog("q0", T0 + 60, "x")
    assert b.get("orders").epoch == 0
    assert b.backlogs_disabled(T0) == frozenset()
    await a.close()
    await b.close()
