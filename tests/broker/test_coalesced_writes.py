"""Contract: the frames of many links on one pooled connection leave together
(gateway.servicebus.internals.pool, `_Coalescing`), and each send still gets its own outcome.

The real SDK (its handlers on our pooled connection) against the local broker. The sends of
one `gather` run in one loop turn, so their TRANSFERs go out in shared socket writes: the
tests count those writes, then check what the broker stored, per queue, and what each send
was told — a refused entity among healthy ones included, and a connection lost under
buffered frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from azure.servicebus._pyamqp.error import ErrorCondition

from gateway.core.message import OutboundMessage
from gateway.errors import FailureKind, SendFailure
from gateway.servicebus.client import SdkNamespaceClient, SdkSender
from gateway.servicebus.internals import pool
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.broker.conftest import pooled_client, running_queues

QUEUES = [f"q{i}" for i in range(40)]
DEADLINE = 30.0  # on every client call: an SDK mismatch must fail the test, not hang it


@pytest.fixture
async def broker() -> AsyncIterator[LocalBroker]:
    async with running_queues(QUEUES) as b:
        yield b


@pytest.fixture
async def pooled(broker: LocalBroker) -> AsyncIterator[SdkNamespaceClient]:
    async with pooled_client(broker, connections=1) as client:
        yield client


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of frames in each socket write of every pooled connection."""
    counts: list[int] = []
    flush = pool._Coalescing.flush

    def counted(self: Any) -> None:
        if self._frames:
            counts.append(len(self._frames))
        flush(self)

    monkeypatch.setattr(pool._Coalescing, "flush", counted)
    yield counts


def _msg(queue: str, n: int) -> OutboundMessage:
    return OutboundMessage(body=f"{queue}-{n}".encode(), message_id=f"{queue}-{n}")


async def _open_all(client: SdkNamespaceClient, queues: list[str]) -> list[SdkSender]:
    async with asyncio.timeout(DEADLINE):
        return list(await asyncio.gather(*(client.open_sender(q) for q in queues)))


async def _stored_ids(control: ControlClient, queue: str) -> list[str]:
    return [m["message_id"] for m in await control.messages("primary", queue, limit=1000)]


async def test_concurrent_sends_on_many_links_share_socket_writes_and_each_lands_in_its_queue(
    pooled: SdkNamespaceClient, control: ControlClient, writes: list[int]
) -> None:
    senders = await _open_all(pooled, QUEUES)
    assert pooled.pool.open_connections() == 1
    writes.clear()
    async with asyncio.timeout(DEADLINE):
        for n in range(3):
            # One message per link, and a request of two (one transfer, all or none).
            await asyncio.gather(
                *(s.send([_msg(q, n)]) for q, s in zip(QUEUES, senders, strict=False))
            )
            await asyncio.gather(
                *(
                    s.send([_msg(q, 10 + n), _msg(q, 20 + n)])
                    for q, s in zip(QUEUES, senders, strict=False)
                )
            )
    # 40 TRANSFERs issued in one loop turn: written together, not one write each.
    assert max(writes) >= 10, writes
    assert sum(writes) > len(writes) * 2
    for q in QUEUES:
        expected = sorted(f"{q}-{n}" for n in (0, 1, 2, 10, 11, 12, 20, 21, 22))
        assert sorted(await _stored_ids(control, q)) == expected
    async with asyncio.timeout(DEADLINE):
        await asyncio.gather(*(s.close() for s in senders))


async def test_a_refused_entity_fails_its_own_sends_only_among_healthy_ones_in_the_same_writes(
    pooled: SdkNamespaceClient, control: ControlClient, writes: list[int]
) -> None:
    senders = await _open_all(pooled, QUEUES)
    bad = QUEUES[7]
    await control.add_fault("primary", "com.microsoft:entity-disabled", entity=bad)
    writes.clear()
    async with asyncio.timeout(DEADLINE):
        outcomes = await asyncio.gather(
            *(s.send([_msg(q, 0)]) for q, s in zip(QUEUES, senders, strict=False)),
            return_exceptions=True,
        )
    assert max(writes) >= 10, writes  # the refused entity's TRANSFER went out with the others'
    for q, outcome in zip(QUEUES, outcomes, strict=False):
        if q == bad:
            assert isinstance(outcome, SendFailure), outcome
            assert outcome.kind == FailureKind.ENTITY_DISABLED
        else:
            assert outcome is None, (q, outcome)
            assert await _stored_ids(control, q) == [f"{q}-0"]
    assert await _stored_ids(control, bad) == []
    # The connection and the other links are unharmed: the next round is all stored.
    await control.clear_faults("primary")
    async with asyncio.timeout(DEADLINE):
        await asyncio.gather(*(s.send([_msg(q, 1)]) for q, s in zip(QUEUES, senders, strict=False)))
    assert await _stored_ids(control, bad) == [f"{bad}-1"]
    assert pooled.pool.open_connections() == 1
    async with asyncio.timeout(DEADLINE):
        await asyncio.gather(*(s.close() for s in senders))


async def test_a_connection_lost_under_buffered_frames_fails_or_resends_each_send_never_hangs(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    senders = await _open_all(pooled, QUEUES[:12])
    conn: Any = pooled.pool._slots[0]._conn
    async with asyncio.timeout(DEADLINE):
        sends = [
            asyncio.ensure_future(s.send([_msg(q, 0)]))
            for q, s in zip(QUEUES, senders, strict=False)
        ]
        # The TRANSFERs are buffered this turn; the socket goes before they are flushed.
        await asyncio.sleep(0)
        buffered = conn._transport.write.__self__
        assert len(buffered._frames) == len(sends)
        conn._transport.writer.transport.abort()
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
    # Each send was told its own outcome: stored (the SDK's retry on a new connection) or
    # a classified failure, and a failure was not stored.
    for q, outcome in zip(QUEUES, outcomes, strict=False):
        assert outcome is None or isinstance(outcome, SendFailure), (q, outcome)
        stored = await _stored_ids(control, q)
        assert stored == ([f"{q}-0"] if outcome is None else []), (q, outcome, stored)
    # The flush met the lost socket (and the reader too): the connection's error, as a
    # failed write or read is in pyamqp; the handlers raised it and the SDK retried.
    assert buffered.failure is not None
    assert conn._error is not None and conn._error.condition == ErrorCondition.SocketError
    # The pool replaced the connection: every link sends again.
    async with asyncio.timeout(DEADLINE):
        await asyncio.gather(*(s.send([_msg(q, 1)]) for q, s in zip(QUEUES, senders, strict=False)))
    for q in QUEUES[:12]:
        assert f"{q}-1" in await _stored_ids(control, q)
    async with asyncio.timeout(DEADLINE):
        await asyncio.gather(*(s.close() for s in senders))


async def test_frames_buffered_when_a_connection_closes_are_sent_before_it_closes(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    sender = await _open_all(pooled, QUEUES[:1])
    async with asyncio.timeout(DEADLINE):
        await sender[0].send([_msg(QUEUES[0], 0)])
        await sender[0].close()
    conn: Any = pooled.pool._slots[0]._conn
    sent: list[bytes] = []
    writer = conn._transport.writer
    write = writer.write

    def recorded(data: bytes) -> None:
        sent.append(bytes(data))
        write(data)

    writer.write = recorded
    async with asyncio.timeout(DEADLINE):
        await pooled.pool.close()
    # The CLOSE performative (descriptor 0x18) was written, not dropped with the buffer.
    assert any(b"\x00\x53\x18" in chunk for chunk in sent), sent
