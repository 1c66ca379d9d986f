"""Contract: many sender links on a few shared AMQP connections (gateway.servicebus.pool).

The real SDK (its handlers given our pooled connection) against the local broker, which must
keep each handler's `$cbs` exchange on its own session: several handlers on one connection
each put their token and wait for their own reply.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest

from gateway.core.message import OutboundMessage
from gateway.servicebus.client import SdkNamespaceClient, SdkSender
from sblocal.config import NamespaceConfig, QueueConfig
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.broker.conftest import fast_config, pooled_client, running
from tests.support.waiting import eventually

QUEUES = [f"q{i}" for i in range(24)]


@pytest.fixture
async def broker() -> AsyncIterator[LocalBroker]:
    primary = NamespaceConfig(
        name="primary", management_port=None, queues=tuple(QueueConfig(q) for q in QUEUES)
    )
    async with running(fast_config(namespaces=(primary,))) as b:
        yield b


@pytest.fixture
async def pooled(broker: LocalBroker) -> AsyncIterator[SdkNamespaceClient]:
    async with pooled_client(broker, connections=2) as client:
        yield client


def _msg(i: int) -> OutboundMessage:
    return OutboundMessage(body=b"x" * 100, message_id=str(i))


async def _stored(control: ControlClient) -> int:
    return (await control.counters("primary"))["messages_received"]


async def _census_is(control: ControlClient, **expected: int) -> None:
    """The broker's census reaches `expected` (it sees closes a moment after the client)."""

    async def met() -> bool:
        census = await control.connections("primary")
        return all(census[k] == v for k, v in expected.items())

    await eventually(met, what=f"census {expected}")


async def test_many_sender_links_share_the_pools_connections(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    senders = await asyncio.gather(*(pooled.open_sender(q) for q in QUEUES))
    census = await control.connections("primary")
    assert census["connections"] == 2 and census["send_links"] == len(QUEUES)
    assert pooled.pool.open_connections() == 2 and pooled.pool.links() == len(QUEUES)
    # Concurrent sends on every link: each sees its own disposition whichever handler read it.
    for _ in range(3):
        await asyncio.gather(*(s.send([_msg(i)]) for i, s in enumerate(senders)))
        await asyncio.gather(*(s.send([_msg(i), _msg(i + 1)]) for i, s in enumerate(senders)))
    assert await _stored(control) == 3 * 3 * len(QUEUES)
    assert (await control.connections("primary"))["connections"] == 2
    await asyncio.gather(*(s.close() for s in senders))


async def test_connections_share_one_tls_context_instead_of_loading_the_cas_each(
    pooled: SdkNamespaceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK, given no `ssl_context`, builds one per connection attempt and loads the whole
    # CA bundle into it (millions of small C allocations): during an outage, reconnects in
    # flight at once held ~50 MiB of OpenSSL memory and fragmented the heap.
    loads: list[object] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args)
        load(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    senders = await asyncio.gather(*(pooled.open_sender(q) for q in QUEUES[:4]))
    assert pooled.pool.open_connections() == 2
    assert loads == []
    await asyncio.gather(*(s.close() for s in senders))


async def test_closing_a_link_leaves_the_connection_to_the_others(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    senders: list[SdkSender] = [await pooled.open_sender(q) for q in QUEUES[:4]]
    await senders[0].close()
    await senders[1].close()
    assert pooled.pool.links() == 2
    await asyncio.gather(*(s.send([_msg(1)]) for s in senders[2:]))
    assert await _stored(control) == 2
    assert pooled.pool.open_connections() == 2
    await _census_is(control, connections=2, send_links=2)
    # A new link goes to the slot with the fewest links, on its open connection.
    again = await pooled.open_sender(QUEUES[0])
    await again.send([_msg(2)])
    assert (await control.connections("primary"))["connections"] == 2
    for s in (again, *senders[2:]):
        await s.close()


async def test_a_dropped_connection_is_replaced_and_the_send_retried_on_the_new_one(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    senders = [await pooled.open_sender(q) for q in QUEUES[:4]]
    await asyncio.gather(*(s.send([_msg(1)]) for s in senders))
    assert await control.drop_connections("primary") == 2
    # The SDK's own retry reopens each link; its slot hands it a new connection.
    for s in senders:
        await s.send([_msg(2)])
    assert await _stored(control) == 8
    await _census_is(control, connections=2, send_links=4)
    for s in senders:
        await s.close()
