"""sblocal's collector policy (sblocal.collector): survivors frozen, cycles reclaimed when idle.

In process, with the CPU clock faked (the idle test's port); each test hands everything back
to the collector (`uninstall`) so the test process is left as it was.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from sblocal import collector
from sblocal.collector import FrozenSurvivors


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


class FakeCpu:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def policy() -> Iterator[tuple[FrozenSurvivors, FakeCpu]]:
    cpu = FakeCpu()
    survivors = FrozenSurvivors(cpu=cpu)
    gc.collect()
    try:
        yield survivors, cpu
    finally:
        survivors.uninstall()
    assert gc.get_freeze_count() == 0
    assert survivors._on_collection not in gc.callbacks


def _frozen_cycle() -> weakref.ref[Node]:
    """A two-node cycle, frozen by a middle collection, then dropped: garbage the collector
    no longer sees."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect(1)  # its survivors (the cycle among them) frozen by the policy
    ref = weakref.ref(a)
    del a, b
    return ref


def test_survivors_of_a_middle_collection_are_frozen(
    policy: tuple[FrozenSurvivors, FakeCpu],
) -> None:
    survivors, _ = policy
    survivors.install()
    kept = [Node() for _ in range(5_000)]
    gc.collect(0)
    assert survivors.freezes == 0  # a young collection freezes nothing
    gc.collect(1)
    assert survivors.freezes == 1
    assert gc.get_freeze_count() >= len(kept)


def test_a_cycle_among_frozen_objects_is_reclaimed_only_when_idle(
    policy: tuple[FrozenSurvivors, FakeCpu],
) -> None:
    survivors, cpu = policy
    survivors.install()
    ref = _frozen_cycle()
    gc.collect()
    assert ref() is not None  # frozen: not even a full collection frees it

    cpu.now += collector.IDLE_CPU * 10  # busy since the last check
    assert survivors.check() is False
    assert ref() is not None

    cpu.now += collector.IDLE_CPU / 2  # idle
    assert survivors.check() is True
    assert ref() is None
    assert survivors.reclaims == 1
    assert gc.get_freeze_count() > 0  # the reclaim's survivors frozen again

    cpu.now += collector.IDLE_CPU / 2
    assert survivors.check() is False  # nothing grew since: no second full collection
    assert survivors.reclaims == 1


def test_an_idle_reclaim_waits_for_the_frozen_objects_to_grow_by_a_quarter(
    policy: tuple[FrozenSurvivors, FakeCpu],
) -> None:
    survivors, cpu = policy
    survivors.install()
    kept = [Node() for _ in range(20_000)]
    gc.collect(1)
    assert survivors.check() is True  # idle (the fake clock stands still), frozen: reclaim
    after = gc.get_freeze_count()

    more = [Node() for _ in range(after // 10)]  # a tenth more: not yet
    gc.collect(1)
    assert survivors.check() is False
    more += [Node() for _ in range(after // 5)]  # over a quarter more in all
    gc.collect(1)
    assert survivors.check() is True
    assert survivors.reclaims == 2

    cpu.now += collector.IDLE_CPU * 10
    more += [Node() for _ in range(after)]
    gc.collect(1)
    assert survivors.check() is False  # grown, but busy
    assert survivors.reclaims == 2
    assert len(kept) + len(more) > after


def test_no_reclaim_before_anything_was_frozen(policy: tuple[FrozenSurvivors, FakeCpu]) -> None:
    survivors, _ = policy
    survivors.install()
    assert survivors.check() is False
    assert survivors.reclaims == 0


def test_uninstall_hands_every_frozen_object_back(policy: tuple[FrozenSurvivors, FakeCpu]) -> None:
    survivors, _ = policy
    survivors.install()
    ref = _frozen_cycle()
    survivors.uninstall()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None
    gc.collect(1)
    assert survivors.freezes == 1  # no longer freezing


def test_the_idle_thread_logs_and_counts_a_failed_check_and_goes_on(
    policy: tuple[FrozenSurvivors, FakeCpu], caplog: pytest.LogCaptureFixture
) -> None:
    survivors, _ = policy
    calls = 0
    third = threading.Event()

    def broken_cpu() -> float:
        nonlocal calls
        calls += 1
        if calls >= 3:
            third.set()
        raise RuntimeError("no clock")

    survivors._cpu = broken_cpu
    survivors._every = 0.01
    survivors.start()
    # A third call means the first two checks failed and the thread went on.
    assert third.wait(timeout=10)
    assert survivors.failures >= 2
    assert "the idle collection failed" in caplog.text
