"""Fakes at the syphon's ports (clock, backlog), shared by tests and benchmarks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.core.message import OutboundMessage
from gateway.core.ports import Received
from gateway.errors import CONNECTION, BrokerFailure
from tests.support.waiting import eventually


class FakeClock:
    """Simulated time: `wait` parks until the test advances the clock or the event fires."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.t + seconds, fut)
        self.sleepers.append(entry)
        waiter = asyncio.create_task(event.wait())
        try:
            await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if entry in self.sleepers:
                self.sleepers.remove(entry)
        return event.is_set()

    def parked(self) -> bool:
        """Someone is waiting on the clock (and has not been woken yet)."""
        return any(not f.done() for _, f in self.sleepers)

    async def advance(self) -> None:
        """Jump to the earliest sleeper's deadline and wake it."""
        await eventually(self.parked, within=5)
        deadline = min(d for d, f in self.sleepers if not f.done())
        self.t = max(self.t, deadline)
        for d, fut in list(self.sleepers):
            if d <= self.t and not fut.done():
                fut.set_result(None)


class FakeBacklog:
    """Counts every broker operation; backlog queues are empty unless told otherwise."""

    def __init__(self, fail_receive: bool = False) -> None:
        self.ops: list[str] = []
        self.fail_receive = fail_receive
        self.reset_called = asyncio.Event()
        self.resets = 0

    async def receive(self, path: str, max_count: int, wait: float) -> list[Received]:
        self.ops.append("receive")
        if self.fail_receive:
            raise BrokerFailure(CONNECTION, "namespace unreachable")
        return []

    async def complete(self, path: str, message: Received) -> None:
        self.ops.append("complete")

    async def abandon(self, path: str, message: Received) -> None:
        self.ops.append("abandon")

    async def dead_letter(
        self, path: str, message: Received, reason: str, description: str
    ) -> None:
        self.ops.append("dead_letter")

    async def renew(self, path: str, message: Received) -> float | None:
        self.ops.append("renew")
        return None

    async def peek(
        self, path: str, from_sequence: int, max_count: int
    ) -> list[tuple[int, OutboundMessage | None]]:
        self.ops.append("peek")
        return []

    async def depths(self, paths: Sequence[str]) -> dict[str, int] | None:
        self.ops.append("depths")
        return {p: (1 if self.fail_receive else 0) for p in paths}

    async def reset(self) -> None:
        self.resets += 1
        self.reset_called.set()

    async def close(self) -> None:
        return None
