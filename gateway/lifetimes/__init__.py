"""One kit for task lifetimes: every background task of the gateway has an owner that uses it.

* `supervised` — a long-running loop that raises is logged, counted and restarted after a
  backoff; one that returns is done; one that is cancelled stops;
* `Backoff` — capped exponential backoff, as a value;
* `TaskSet` — an owner's tasks: finished ones are forgotten, `stop` ends the rest within a
  bound;
* `stop` / `stop_after` — cancel tasks and wait for them within a bound, however they
  handle the cancellation; `Closer` and `close_quietly` — a close bounded by us.

Note that `asyncio.timeout` bounds only code that honours the cancellation it sends: the
Service Bus SDK does not always (`closing` says when), so a bound that must hold around SDK
code is `Closer`'s or `stop`'s, which wait with `asyncio.wait`. A new loop uses this kit; it
never invents another way to close.
"""

from __future__ import annotations

from gateway.lifetimes.backoff import Backoff
from gateway.lifetimes.closing import CANCEL_GRACE, Closer, close_quietly, stop, stop_after
from gateway.lifetimes.supervision import TaskObserver, supervised
from gateway.lifetimes.taskset import TaskSet

__all__ = [
    "CANCEL_GRACE",
    "Backoff",
    "Closer",
    "TaskObserver",
    "TaskSet",
    "close_quietly",
    "stop",
    "stop_after",
    "supervised",
]
