"""Fakes at the NamespaceClient port, for pure dispatcher and syphon logic (tests, bench), and
a `TaskObserver` that records restarts."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from gateway.core.message import OutboundMessage

Behaviour = Callable[[str, Sequence[OutboundMessage]], Awaitable[None]]


async def ok(path: str, messages: Sequence[OutboundMessage]) -> None:
    return None


class FakeSender:
    def __init__(self, client: FakeClient, path: str, serial: int) -> None:
        self.client, self.path, self.serial = client, path, serial
        self.closed = False
        self.busy = False

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        assert not self.busy, "a sender must be used by one send at a time"
        self.busy = True
        try:
            self.client.batches.append((self.path, [m.message_id for m in messages]))
            await self.client.behaviour(self.path, messages)
        finally:
            self.busy = False

    async def close(self) -> None:
        self.closed = True
        self.client.closed_senders += 1


class FakeClient:
    def __init__(self, name: str = "primary", behaviour: Behaviour = ok) -> None:
        self._name = name
        self.behaviour = behaviour
        self.batches: list[tuple[str, list[str]]] = []
        self.opened = 0
        self.closed_senders = 0
        self.release = asyncio.Event()

    @property
    def name(self) -> str:
        return self._name

    async def open_sender(self, path: str) -> FakeSender:
        self.opened += 1
        return FakeSender(self, path, self.opened)

    async def close(self) -> None:
        return None

    def sent_ids(self, path: str | None = None) -> list[str]:
        return [i for p, ids in self.batches if path is None or p == path for i in ids]


class ReopensHang(FakeClient):
    """Opens each path's first sender at once; a later open of a path hangs until `reopen`."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: set[str] = set()
        self.reopening = asyncio.Event()
        self.reopen = asyncio.Event()

    async def open_sender(self, path: str) -> FakeSender:
        if path in self.paths:
            self.reopening.set()
            await self.reopen.wait()
        self.paths.add(path)
        return await super().open_sender(path)


def msg(i: int | str, size: int = 10, session: str | None = None) -> OutboundMessage:
    return OutboundMessage(body=b"x" * size, message_id=str(i), session_id=session)


class Restarts:
    """A `gateway.lifetimes.TaskObserver` that counts the restarts, by kind of task."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def task_restarted(self, task: str) -> None:
        self.counts[task] += 1
