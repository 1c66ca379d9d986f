"""The cyclic collector kept off the stored messages (the `python -m sblocal` process only).

A broker holds every message it has not delivered. Under a load test that is hundreds of
thousands of objects, and CPython's full collections walk every one of them: measured with
~100,000 messages stored, 60 to 140 ms each, every few seconds while the store grows. A
collection holds the interpreter: every thread of the broker, every link's transfers, waits
for it, so a load test through the broker measured the broker's collector more than the code
it tested
(docs/performance-results.md, "The local broker's full collections").

What this does, with `install` (undone by `uninstall`):

* after every collection of the middle or the oldest generation, what survived it is
  **frozen** (`gc.freeze`): the collector never walks it again. An object that lived
  through two young collections is a stored message, a connection or a link, not garbage;
  frozen objects freed by their reference count are freed at once, as usual. So the oldest
  generation stays nearly empty and a full collection costs next to nothing.
* what freezing gives up is reclaiming **cycles formed among frozen objects** after they
  were frozen (a connection's objects, say, once it closes). While the process is **idle**
  (`IDLE_CPU` seconds of CPU or less over the last `IDLE_WINDOW`, all threads) and the
  frozen objects have grown by `GROWTH` since the last time (CPython's own rule for full
  collections: a quarter more long-lived objects), everything is handed back to the
  collector (`gc.unfreeze`) and one full collection reclaims those cycles with nobody
  waiting; its survivors are frozen again.

Only the broker's own process: the gateway's embedded broker runs as this process too
(gateway.embedded), and a process that imports `sblocal` as a library (the tests) keeps its
own collector settings.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

# The process is idle when its threads used at most IDLE_CPU seconds of CPU over the last
# IDLE_WINDOW seconds (a broker serving a load uses a good part of a CPU; one answering a
# test's occasional call, a few milliseconds).
IDLE_WINDOW: Final = 1.0
IDLE_CPU: Final = 0.02
# An idle full collection waits until the frozen objects are this many times as many as the
# last one left (or as few as they have been since: frozen objects die by reference count).
GROWTH: Final = 1.25

_log = logging.getLogger("sblocal.collector")


class FrozenSurvivors:
    """The policy above; `check` is its idle test, called every `every` seconds by a daemon
    thread (`start`), or directly with a fake CPU clock by the tests."""

    def __init__(
        self, cpu: Callable[[], float] = time.process_time, every: float = IDLE_WINDOW
    ) -> None:
        self._cpu = cpu
        self._every = every
        self._cpu_before = cpu()
        self._reclaimed_at = 0  # objects frozen after the last reclaim (its low-water mark)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.freezes = 0  # collections whose survivors were frozen
        self.reclaims = 0  # idle full collections over everything unfrozen
        self.failures = 0  # checks that raised (logged; the thread goes on)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # After the collection (its survivors now in the oldest generation): `gc.freeze`
        # only moves the generations' lists onto the permanent one, allocating nothing.
        if phase == "stop" and info["generation"] >= 1:
            gc.freeze()
            self.freezes += 1

    def check(self) -> bool:
        """Reclaim (unfreeze, collect, and freeze the survivors again) when the process was
        idle since the last check and the frozen objects grew by `GROWTH` since the last
        reclaim; whether it did. Under load it costs one clock read (counting the frozen
        objects walks them, so it waits for idleness)."""
        now = self._cpu()
        used, self._cpu_before = now - self._cpu_before, now
        if used > IDLE_CPU:
            return False
        frozen = gc.get_freeze_count()
        self._reclaimed_at = min(self._reclaimed_at, frozen)
        if frozen <= self._reclaimed_at * GROWTH:
            return False
        gc.unfreeze()
        gc.collect()  # its survivors are frozen again by `_on_collection`
        self.reclaims += 1
        self._reclaimed_at = gc.get_freeze_count()
        self._cpu_before = self._cpu()  # the collection's own CPU is not activity
        return True

    def install(self) -> None:
        """Freeze after each middle or full collection from now on."""
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        """Stop freezing and the idle thread; hand everything frozen back to the collector."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._every)
            self._thread = None
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        gc.unfreeze()

    def start(self) -> None:
        """`install`, and check for idleness every `every` seconds in a daemon thread."""
        self.install()
        self._thread = threading.Thread(target=self._run, name="sblocal collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.check()
            except Exception:  # never expected; the thread goes on checking
                self.failures += 1
                _log.exception("the idle collection failed (%d so far)", self.failures)
