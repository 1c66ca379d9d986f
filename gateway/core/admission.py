"""Explicit backpressure: a FIFO byte budget for accepted-but-unsettled messages."""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.errors import Saturated


class AdmissionGate:
    """A counting semaphore over bytes, fair (FIFO), with a bounded wait.

    `acquire(n, wait)` waits at most `wait` seconds for `n` bytes of room and raises
    `Saturated` (HTTP 503 + Retry-After) when there is none, so memory held by pending
    messages never exceeds `capacity`. Cancellation while waiting leaves the gate consistent.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def used(self) -> int:
        return self._used

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self, n: int) -> bool:
        """Take `n` bytes of room if there is room now and nobody waits for it: `acquire`'s
        path that does not wait, without a coroutine (the caller on the hot path awaits
        `acquire` only when this says no)."""
        n = min(n, self._capacity)  # one oversized request may still pass alone
        if not self._waiters and self._used + n <= self._capacity:
            self._used += n
            return True
        return False

    async def acquire(self, n: int, wait: float) -> None:
        n = min(n, self._capacity)  # one oversized request may still pass alone
        if self.try_acquire(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(wait):
                await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # granted at the very moment the deadline fired: keep the room
            self._remove(entry)
            raise Saturated(
                f"the gateway is saturated: no room for this request within {wait:g}s; retry later"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)
            else:
                self._remove(entry)
            raise

    def _remove(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        self._wake()

    def release(self, n: int) -> None:
        n = min(n, self._capacity)
        self._used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self._used + n > self._capacity:
                return
            self._waiters.popleft()
            self._used += n
            fut.set_result(None)
