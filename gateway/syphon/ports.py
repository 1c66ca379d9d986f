"""The syphon's ports: the backlog queues it drains, and the clock it waits on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.message import OutboundMessage


@dataclass(frozen=True, slots=True)
class Received:
    """One message received in peek-lock from a backlog queue."""

    message: OutboundMessage  # as it is stored in the backlog (rewritten properties)
    handle: Any  # the adapter's own message object, for settling
    locked_until: float | None  # unix time the lock expires
    delivery_count: int
    # Why the adapter could not read it as a message (a property of a type no REST client can
    # send, say): the syphon dead-letters it. `message` then holds only its MessageId.
    unreadable: str | None = None


class BacklogPort(Protocol):
    """Peek-lock access to the backlog queues of one secondary namespace.

    Every method is one broker operation (the syphon counts them) and may hang: the caller
    owns the deadline. Failures raise `SendFailure` (translated by the adapter).
    """

    async def receive(self, path: str, max_count: int, wait: float) -> list[Received]: ...

    async def complete(self, path: str, message: Received) -> None: ...

    async def abandon(self, path: str, message: Received) -> None: ...

    async def dead_letter(
        self, path: str, message: Received, reason: str, description: str
    ) -> None: ...

    async def renew(self, path: str, message: Received) -> float | None:
        """Renew the lock; returns the new locked-until (unix time)."""
        ...

    async def depths(self, paths: Sequence[str]) -> dict[str, int] | None:
        """Active message counts of `paths` in one management call (None if unavailable)."""
        ...

    async def reset(self) -> None:
        """Close every open receiver (they are reopened on next use); never raises."""
        ...

    async def close(self) -> None: ...


class Clock(Protocol):
    """Time as the syphon sees it: real in production, driven by the test for the idle-cost
    test (a simulated hour without a real hour)."""

    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait until `event` is set (True) or `seconds` pass (False)."""
        ...


class RealClock:
    def now(self) -> float:
        return time.time()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
                return True
        return event.is_set()
