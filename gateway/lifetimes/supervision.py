"""Supervised long-running loops: one that raises is logged, counted and restarted.

Every background loop of the gateway (a syphon queue, the syphon's supervisor, a pinger, the
state store's writer and supervisor, the ledger's writer, a pooled AMQP connection's reader)
runs inside `supervised`. The
dispatcher's sender workers are not restarted in place: one that meets an unexpected error
fails the requests it held, is logged and counted the same way, and the lane's next request
starts another. A loop that returns is done; a
loop that is cancelled stops (its owner cancels and awaits it); a loop that raises anything
else has met a bug or a value nobody foresaw: its traceback is logged, the restart is counted
(`sbgate_task_restarts_total{task=...}`, alert `SbgateTaskRestarting`) and the loop starts
again after a capped exponential backoff. Nothing dies quietly, and nothing spins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.lifetimes.backoff import Backoff

log = logging.getLogger(__name__)

# The first restart waits BACKOFF_MIN seconds, each further one twice as long up to
# BACKOFF_MAX; a run that lasted BACKOFF_MAX without failing starts the backoff over.
BACKOFF_MIN, BACKOFF_MAX = 0.5, 30.0
RESTARTS = Backoff(BACKOFF_MIN, BACKOFF_MAX)


class TaskObserver(Protocol):
    def task_restarted(self, task: str) -> None:
        """Loop `task` (a kind, not an instance: "syphon_queue", "pinger", ...) raised and
        is being restarted."""


async def supervised(
    task: str,
    run: Callable[[], Awaitable[None]],
    observer: TaskObserver | None = None,
    *,
    backoff: Backoff = RESTARTS,
) -> None:
    """Run `run()` until it returns; restart it when it raises (see the module docstring).
    Cancellation propagates at once, from the loop or from the backoff wait."""
    delay: float | None = None
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            if loop.time() - started >= backoff.cap:
                delay = None  # it ran well for a while: a new failure, not a streak
            delay = backoff.next(delay)
            log.exception("task %s failed; restarting it in %.1fs", task, delay)
        if observer is not None:
            observer.task_restarted(task)
        await asyncio.sleep(backoff.wait(delay))
