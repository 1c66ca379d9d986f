"""An owned set of tasks: what an owner started and has not yet seen end.

Each task `spawn` starts is owned here until it ends; a finished task is forgotten at once
(the set never grows with the tasks that came and went), and one that raised is logged with
its traceback (nobody awaits it: its failure must not pass silently). `stop` cancels what
still runs and waits for it within a bound (`closing.stop`: it holds even when a task's
cancellation is lost); `finish` lets them end first, cancelling only what outlives its bound.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from gateway.lifetimes.closing import stop, stop_after

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskSet:
    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coro: Coroutine[Any, Any, T], name: str, context: contextvars.Context | None = None
    ) -> asyncio.Task[T]:
        """Run `coro` in a task owned here (named `name`; in `context`, when given: a fresh
        one for a task that outlives the request that started it)."""
        task = asyncio.create_task(coro, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: task %s failed", self._owner, task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        """Tasks still running (a finished one is dropped by its done callback, which runs
        a loop turn after it ends)."""
        return sum(1 for t in self._tasks if not t.done())

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter([t for t in self._tasks if not t.done()])

    async def stop(self, within: float) -> int:
        """Cancel every task still running and wait up to `within` seconds (+ the grace of
        `closing.stop`) for them to end. Returns how many still run then (each logged)."""
        return await stop(list(self._tasks), within, self._owner)

    async def finish(self, within: float) -> int:
        """Wait up to `within` seconds for every task still running to end on its own, then
        cancel the ones left and wait `closing.CANCEL_GRACE` more (`closing.stop_after`).
        Returns how many still run then (each logged)."""
        return await stop_after(list(self._tasks), within, self._owner)
