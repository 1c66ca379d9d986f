"""Deadlines that hold even when the code under them mishandles a cancellation.

`asyncio.timeout` ends an await by cancelling it, so it bounds only code that honours the
cancel, and a task stops only if its cancel is not lost. The Service Bus SDK does not always
honour one:

* on Python 3.11, `asyncio.wait_for` (which the SDK's AMQP layer uses for every frame it reads)
  drops a cancellation that arrives as the awaited read completes (CPython gh-86296): the
  cancelled open or send carries on as if nothing happened;
* a cancelled open runs the SDK's cleanup close on its way out, with no deadline when no
  per-try timeout is configured: the one cancel our deadline sends is spent, and that close
  can wait for as long as the link takes to answer.

Either way a shutdown waiting on that task can hang. So shutdown code here never waits on a
cancel alone: `stop` cancels tasks and waits for them with `asyncio.wait`, which returns on
time whatever the tasks do, and cancels again those that outlive the bound; `Closer` runs a
close in a task of its own, waits for it at most a bound, and owns what outlives it until
its own `aclose`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any

log = logging.getLogger(__name__)

# How long a task cancelled (again) at its bound gets to end before it is given up on.
CANCEL_GRACE = 1.0


async def stop(tasks: Iterable[asyncio.Task[Any]], within: float, what: str) -> int:
    """Cancel `tasks` and wait up to `within` seconds for them to end (`stop_after`): a task
    whose cancel was lost, or whose cleanup outlives the bound, is cancelled again. At most
    `within + CANCEL_GRACE`."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    return await stop_after(tasks, within, what)


async def stop_after(tasks: Iterable[asyncio.Task[Any]], within: float, what: str) -> int:
    """Wait up to `within` seconds for `tasks` to end, then cancel the ones still running and
    wait `CANCEL_GRACE` more. Returns how many still run then (each logged as an error; they
    end with the loop). If the caller is cancelled, so are the tasks."""
    pending = {t for t in tasks if not t.done()}
    try:
        for bound in (within, CANCEL_GRACE):
            if not pending:
                break
            _, pending = await asyncio.wait(pending, timeout=bound)
            for t in pending:
                t.cancel()
    except asyncio.CancelledError:
        for t in pending:
            t.cancel()
        raise
    for t in pending:
        log.error("%s: task %s did not stop in time", what, t.get_name())
    return len(pending)


class Closer:
    """Runs closes bounded whether or not they honour cancellation, and owns the ones that
    outlive their bound (or whose caller was cancelled) until `aclose`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._left: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Closes still running (owned here)."""
        return sum(1 for t in self._left if not t.done())

    def spawn(self, what: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coro` (a close, or a cleanup) in a task owned here; its errors are logged."""
        task = asyncio.create_task(_quietly(what, coro), name=f"{self._name}: {what}")
        self._left.add(task)
        task.add_done_callback(self._left.discard)
        return task

    async def run(self, what: str, coro: Coroutine[Any, Any, None], within: float) -> bool:
        """Run `coro` (see `spawn`) and wait at most `within` seconds for it; then cancel it
        and go on (it stays owned here). True when it finished in time. If the caller is
        cancelled meanwhile, the close goes on, owned here."""
        task = self.spawn(what, coro)
        done, _ = await asyncio.wait({task}, timeout=within)
        if done:
            return True
        task.cancel()
        log.warning("%s: %s did not finish within %gs", self._name, what, within)
        return False

    async def aclose(self) -> None:
        """Cancel the closes still running and wait for them (`stop`: at most
        2 * `CANCEL_GRACE`)."""
        await stop(list(self._left), CANCEL_GRACE, self._name)


async def close_quietly(what: str, close: Awaitable[None], within: float) -> None:
    """Await `close` for at most `within` seconds (`asyncio.timeout`: for a close that honours
    cancellation, such as one already bounded by a `Closer`); its failure or timeout is
    logged at DEBUG, not raised: what is being closed is discarded either way."""
    try:
        async with asyncio.timeout(within):
            await close
    except asyncio.CancelledError:
        raise
    except Exception:  # closing a broken link may fail in any way; it is gone either way
        log.debug("%s failed", what, exc_info=True)


async def _quietly(what: str, coro: Coroutine[Any, Any, None]) -> None:
    try:
        await coro
    except Exception:  # closing a broken link may fail in any way; it is discarded anyway
        log.debug("%s failed", what, exc_info=True)
