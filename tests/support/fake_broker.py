"""A Service Bus namespace at the gateway's ports, for logic tests on virtual time.

`FakeNamespace` is both a `NamespaceClient` (senders that store into its entities) and a
`BacklogPort` (peek-lock receives from them), with the faults the failover logic reacts to:
`down` (every send fails with a connection error, which counts toward failover) and `hold`
(sends wait until the test releases them: a backlog write "starting" and "completing" are
two separate steps). Pings are accepted and never stored, as Service Bus does.

Time is the running loop's (`loop.time()`): locks expire, receives wait, on virtual time.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.core.backlog import BACKLOG_LOCK_DURATION, PING_CONTENT_TYPE
from gateway.core.message import OutboundMessage
from gateway.core.ports import Received
from gateway.errors import BrokerFailure, Classification, FailureKind, SendFailure

CONNECTION = Classification(FailureKind.CONNECTION, False, True, 503, 10.0, True)
LOCK_LOST = Classification(FailureKind.SERVICE, False, False, 503, 10.0, False)


def _now() -> float:
    return asyncio.get_running_loop().time()


@dataclass(slots=True)
class Stored:
    message: OutboundMessage
    seq: int
    locked_until: float = 0.0
    token: int = 0
    deliveries: int = 0
    dead_letter_reason: str | None = None


@dataclass(slots=True)
class _Held:
    path: str
    messages: list[OutboundMessage]
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _Sender:
    def __init__(self, ns: FakeNamespace, path: str) -> None:
        self._ns, self._path = ns, path

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        await self._ns.store(self._path, list(messages))

    async def close(self) -> None:
        return None


class FakeNamespace:
    """One namespace: entities (created on first use), dead-letter queues, faults."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.entities: dict[str, list[Stored]] = {}
        self.dead_letters: dict[str, list[Stored]] = {}
        self.down = False
        self.hold = False
        self.held: list[_Held] = []
        self.pings = 0  # delivered (and, as Service Bus does, never stored)
        self.ping_attempts = 0
        self._seq = itertools.count(1)
        self._tokens = itertools.count(1)
        self._arrived = asyncio.Condition()

    # -- NamespaceClient --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    async def open_sender(self, path: str) -> _Sender:
        return _Sender(self, path)

    async def close(self) -> None:
        return None

    async def store(self, path: str, messages: list[OutboundMessage]) -> None:
        ping = bool(messages) and messages[0].content_type == PING_CONTENT_TYPE
        self.ping_attempts += ping
        if self.down:
            raise SendFailure(CONNECTION, f"{self._name} is down")
        if self.hold:
            held = _Held(path, messages)
            self.held.append(held)
            try:
                await held.done  # cancelled by the sender's deadline: nothing is stored
            finally:
                if held in self.held:
                    self.held.remove(held)
            if self.down:
                raise SendFailure(CONNECTION, f"{self._name} went down")
        if ping:
            self.pings += 1
            return
        queue = self.entities.setdefault(path, [])
        queue.extend(Stored(m, next(self._seq)) for m in messages)
        async with self._arrived:
            self._arrived.notify_all()

    def release(self, count: int | None = None) -> int:
        """Let the oldest `count` held sends (all: None) complete; returns how many."""
        ready = [h for h in self.held if not h.done.done()][:count]
        for h in ready:
            h.done.set_result(None)
        return len(ready)

    # -- BacklogPort --------------------------------------------------------------------------

    async def receive(self, path: str, max_count: int, wait: float) -> list[Received]:
        if self.down:
            raise BrokerFailure(CONNECTION, f"{self._name} is down")
        deadline = _now() + wait
        async with self._arrived:
            while True:
                got = self._lock(path, max_count)
                if got or _now() >= deadline:
                    return got
                # Wake for an arrival, or when the first lock expires, or at the deadline.
                until = min([deadline, *self._lock_expiries(path)])
                try:
                    async with asyncio.timeout(max(until - _now(), 0.0)):
                        await self._arrived.wait()
                except TimeoutError:
                    pass

    def _lock(self, path: str, max_count: int) -> list[Received]:
        now = _now()
        out: list[Received] = []
        for s in self.entities.get(path, []):
            if len(out) == max_count:
                break
            if s.locked_until > now:
                continue
            s.locked_until = now + BACKLOG_LOCK_DURATION
            s.token = next(self._tokens)
            s.deliveries += 1
            out.append(
                Received(
                    s.message, (path, s.seq, s.token), s.locked_until, s.deliveries, sequence=s.seq
                )
            )
        return out

    def _lock_expiries(self, path: str) -> list[float]:
        now = _now()
        return [s.locked_until for s in self.entities.get(path, []) if s.locked_until > now]

    def _held_lock(self, message: Received) -> Stored:
        path, seq, token = message.handle
        for s in self.entities.get(path, []):
            if s.seq == seq and s.token == token and s.locked_until > _now():
                return s
        raise BrokerFailure(LOCK_LOST, "the lock was lost")

    async def complete(self, path: str, message: Received) -> None:
        self.entities[path].remove(self._held_lock(message))

    async def abandon(self, path: str, message: Received) -> None:
        self._held_lock(message).locked_until = 0.0
        async with self._arrived:
            self._arrived.notify_all()

    async def dead_letter(
        self, path: str, message: Received, reason: str, description: str
    ) -> None:
        s = self._held_lock(message)
        self.entities[path].remove(s)
        s.dead_letter_reason = reason
        self.dead_letters.setdefault(path, []).append(s)

    async def renew(self, path: str, message: Received) -> float | None:
        s = self._held_lock(message)
        s.locked_until = _now() + BACKLOG_LOCK_DURATION
        return s.locked_until

    async def peek(
        self, path: str, from_sequence: int, max_count: int
    ) -> list[tuple[int, OutboundMessage | None]]:
        if self.down:
            raise BrokerFailure(CONNECTION, f"{self._name} is down")
        found = [s for s in self.entities.get(path, []) if s.seq >= from_sequence]
        return [(s.seq, s.message) for s in found[:max_count]]

    async def depths(self, paths: Sequence[str]) -> dict[str, int] | None:
        if self.down:
            return None
        return {p: len(self.entities.get(p, [])) for p in paths}  # locked ones count too

    async def reset(self) -> None:
        return None

    # -- for assertions -----------------------------------------------------------------------

    def ids(self, path: str) -> list[str]:
        return [s.message.message_id for s in self.entities.get(path, [])]
