"""Contract: many sender links on a few shared AMQP connections (gateway.servicebus.internals.pool).

The real SDK (its handlers given our pooled connection) against the local broker: several
handlers on one connection each put their token over the connection's one `$cbs` link pair
(gateway.servicebus.internals.shared_cbs) and each sees its own reply.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from azure.servicebus._pyamqp.constants import CbsState
from azure.servicebus.exceptions import ServiceBusAuthenticationError

from gateway.core.message import OutboundMessage
from gateway.errors import FailureKind, SendFailure
from gateway.servicebus.client import SdkNamespaceClient, SdkSender
from gateway.servicebus.internals.shared_cbs import SharedCbsAuthenticator
from sblocal import sas
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient
from tests.broker.conftest import pooled_client, running_queues
from tests.support.fakes import Restarts
from tests.support.waiting import eventually

QUEUES = [f"q{i}" for i in range(24)]


@pytest.fixture
async def broker() -> AsyncIterator[LocalBroker]:
    async with running_queues(QUEUES) as b:
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


async def test_each_connection_carries_one_cbs_link_pair_for_every_audience(
    pooled: SdkNamespaceClient, control: ControlClient, broker: LocalBroker
) -> None:
    """Every sender's put-token goes over its connection's one `$cbs` pair
    (gateway.servicebus.internals.shared_cbs): per connection, a session and two links for `$cbs`,
    then one session and one link per sender."""
    senders = await asyncio.gather(*(pooled.open_sender(q) for q in QUEUES))
    await asyncio.gather(*(s.send([_msg(i)]) for i, s in enumerate(senders)))
    await _census_is(
        control,
        connections=2,
        send_links=len(QUEUES),
        links=len(QUEUES) + 2 * 2,
        sessions=len(QUEUES) + 2,
    )
    assert broker.namespace("primary").counters.cbs_tokens == len(QUEUES)
    # Closing senders leaves the pair to the others.
    await asyncio.gather(*(s.close() for s in senders[:20]))
    await asyncio.gather(*(s.send([_msg(1)]) for s in senders[20:]))
    await _census_is(control, connections=2, send_links=4, links=4 + 2 * 2)
    again = await pooled.open_sender(QUEUES[0])
    await again.send([_msg(2)])
    assert await _stored(control) == len(QUEUES) + 4 + 1
    for s in (again, *senders[20:]):
        await s.close()


async def test_a_token_is_refreshed_over_the_shared_pair_before_it_expires(
    pooled: SdkNamespaceClient, broker: LocalBroker, control: ControlClient
) -> None:
    """The SDK's own refresh (`handle_token`: within the last 10% of the token's life) puts
    a new token for that audience over the connection's pair, and the send goes on."""
    senders = [await pooled.open_sender(q) for q in QUEUES[:2]]
    await asyncio.gather(*(s.send([_msg(1)]) for s in senders))
    counters = broker.namespace("primary").counters
    assert counters.cbs_tokens == 2
    auth: Any = senders[0]._sender._handler._cbs_authenticator
    assert isinstance(auth, SharedCbsAuthenticator)
    # As if the token had been put long ago: the next send's check finds it due.
    auth._expires_on = int(time.time()) + 5
    auth._refresh_window = 60
    await senders[0].send([_msg(2)])
    assert counters.cbs_tokens == 3
    assert auth._expires_on > int(time.time()) + 600  # the new token's
    await senders[1].send([_msg(3)])
    assert counters.cbs_tokens == 3 and await _stored(control) == 4
    for s in senders:
        await s.close()


def _forget_tokens(client: SdkNamespaceClient) -> None:
    """Forget the tokens put on the first connection: its next open puts one again."""
    shared = client.pool._slots[0]._cbs
    assert shared is not None
    shared.grants.clear()


def _client_covering_q0_only(broker: LocalBroker) -> SdkNamespaceClient:
    """A client on one pooled connection whose SAS token covers `q0` only, no retries."""
    from gateway.config import NamespaceSettings, Secret, TimeoutSettings

    key_name, key = broker._key("primary")
    host = f"localhost:{broker.amqp_port('primary')}"
    token = sas.sign(f"sb://{host}/q0", key_name, key, int(time.time()) + 3600)
    conn_str = f"Endpoint=sb://{host};SharedAccessSignature={token};UseDevelopmentEmulator=true;"
    ns = NamespaceSettings(name="primary", connection_string=Secret(conn_str))
    return SdkNamespaceClient(ns, TimeoutSettings(sdk_retry_total=0), connections=1)


async def test_a_refused_put_token_fails_only_that_open(broker: LocalBroker) -> None:
    """A token that does not cover one entity: its open fails as the SDK's own `$cbs` pair
    fails it (`ServiceBusAuthenticationError`), and the other entities on the same
    connection, and the pair, go on."""
    client = _client_covering_q0_only(broker)
    try:
        ok = await client.open_sender("q0")
        await ok.send([_msg(1)])
        with pytest.raises(SendFailure) as refused:
            await client.open_sender("q1")
        assert isinstance(refused.value.__cause__, ServiceBusAuthenticationError)
        assert refused.value.kind == FailureKind.UNAUTHORIZED
        await ok.send([_msg(3)])
        # A new put-token on the same pair is still answered (q0's token forgotten: it
        # would cover the new sender, `shared_cbs.Grant`).
        _forget_tokens(client)
        again = await client.open_sender("q0")
        await again.send([_msg(4)])
        counters = broker.namespace("primary").counters
        assert counters.cbs_rejected == 1 and counters.cbs_tokens == 2
        assert counters.messages_received == 3
        assert client.pool.open_connections() == 1
    finally:
        await client.close()


async def test_a_failed_pair_is_replaced_and_the_refresh_put_on_the_new_one(
    pooled: SdkNamespaceClient, broker: LocalBroker, control: ControlClient
) -> None:
    sender = await pooled.open_sender(QUEUES[0])
    await sender.send([_msg(1)])
    auth: Any = sender._sender._handler._cbs_authenticator
    old = auth._shared
    # As when the broker detaches `$cbs` (`ManagementLink` then reports an error).
    await old.link.close()
    old.state = CbsState.ERROR
    auth._expires_on = int(time.time()) + 5
    auth._refresh_window = 60
    await sender.send([_msg(2)])
    assert auth._shared is not old and auth._shared.usable
    assert broker.namespace("primary").counters.cbs_tokens == 2
    assert await _stored(control) == 2
    await _census_is(control, send_links=1, links=1 + 2)
    await sender.close()


async def test_the_reader_reads_frames_without_a_task_per_frame(
    pooled: SdkNamespaceClient, control: ControlClient
) -> None:
    """pyamqp bounds each frame read with `asyncio.wait_for`, which runs the read as a task of
    its own in Python 3.11: one more task (and loop turn) per frame read. The
    pool's reader bounds its reads without one."""
    sender = await pooled.open_sender(QUEUES[0])
    await sender.send([_msg(0)])  # the link's first credit and settlement are read
    loop = asyncio.get_running_loop()
    created: list[str] = []
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(getattr(coro, "__qualname__", repr(coro)))
        if default is not None:
            return default(loop, coro, **kwargs)  # type: ignore[call-arg]
        return asyncio.Task(coro, loop=loop, **kwargs)

    sends = 30
    loop.set_task_factory(counting)
    try:
        for i in range(sends):
            await sender.send([_msg(i)])
    finally:
        loop.set_task_factory(default)
    assert await _stored(control) == sends + 1
    assert len(created) <= sends // 10, created[:10]  # before: one per send
    await sender.close()


async def test_a_connection_carries_more_put_tokens_than_pyamqps_session_window(
    broker: LocalBroker, control: ControlClient
) -> None:
    """pyamqp counts a session's outgoing window down at every transfer and never back up,
    and encodes a window below -255 as an error. The connection's shared `$cbs` session sends
    one transfer (a put-token) per sender open: past ~257 of them, its next FLOW failed to
    encode, the connection's reader died, and every entity behind it timed out (E1's 10,000
    entities: a quarter of the answers 202, from entities failed over by the gateway itself)."""
    async with pooled_client(broker, connections=1) as pooled:
        for i in range(300):
            sender = await pooled.open_sender(QUEUES[i % len(QUEUES)])
            await sender.close()
            # Forgotten, so that every open puts one (a token on the connection would cover
            # the next sender to its entity, `shared_cbs.Grant`).
            _forget_tokens(pooled)
        sender = await pooled.open_sender(QUEUES[0])
        await sender.send([_msg(0)])
        assert pooled.pool._slots[0].reading, "the connection's reader still reads"
        assert await _stored(control) == 1
        await sender.close()


async def test_a_reader_that_raises_is_logged_counted_and_restarted(
    broker: LocalBroker, control: ControlClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame pyamqp fails to process (a bug, a frame nobody foresaw) with the connection
    up: the reader is logged, counted and started again, and the links keep sending."""
    from gateway.config import NamespaceSettings, Secret, TimeoutSettings

    restarts = Restarts()
    ns = NamespaceSettings(
        name="primary", connection_string=Secret(broker.connection_string("primary"))
    )
    pooled = SdkNamespaceClient(
        ns, TimeoutSettings(sdk_retry_total=1), connections=1, observer=restarts
    )
    try:
        sender = await pooled.open_sender(QUEUES[0])
        await sender.send([_msg(0)])
        slot = pooled.pool._slots[0]
        conn: Any = slot._conn
        process = conn._process_incoming_frame
        failed: list[bool] = []

        async def once_failing(channel: Any, frame: Any) -> Any:
            result = await process(channel, frame)
            if not failed:  # the frame is processed, then the bug
                failed.append(True)
                raise RuntimeError("a frame nobody foresaw")
            return result

        conn._process_incoming_frame = once_failing
        for i in range(1, 6):
            await sender.send([_msg(i)])
        await eventually(lambda: restarts.counts == {"amqp_reader": 1}, what="one restart counted")
        assert "a frame nobody foresaw" in caplog.text
        await sender.send([_msg(6)])
        assert slot.reading, "the connection has its reader again"
        assert await _stored(control) == 7
        await sender.close()
    finally:
        await pooled.close()


async def test_one_put_token_per_entity_per_connection(
    broker: LocalBroker, control: ControlClient
) -> None:
    """A token put for an entity authorizes every link to it on the connection
    (`shared_cbs.Grant`): a second sender to the same entity, opened while the first's
    put-token is in flight or after it was accepted, or after the first was closed, puts none
    of its own; another entity still puts its own. Each sender sends."""
    async with pooled_client(broker, connections=1) as pooled:
        counters = broker.namespace("primary").counters
        together = await asyncio.gather(*(pooled.open_sender(QUEUES[0]) for _ in range(3)))
        assert counters.cbs_tokens == 1
        later = await pooled.open_sender(QUEUES[0])
        await together[0].close()
        after_close = await pooled.open_sender(QUEUES[0])
        other = await pooled.open_sender(QUEUES[1])
        assert counters.cbs_tokens == 2
        senders = [*together[1:], later, after_close, other]
        await asyncio.gather(*(s.send([_msg(i)]) for i, s in enumerate(senders)))
        assert await _stored(control) == len(senders)
        for s in senders:
            await s.close()


async def test_a_second_sender_goes_where_its_entitys_token_is(broker: LocalBroker) -> None:
    """Of two connections, a sender to an entity whose token is on one binds there (while
    that one has at most one link more than the other), so its open puts no token."""
    async with pooled_client(broker, connections=2) as pooled:
        counters = broker.namespace("primary").counters
        first = await pooled.open_sender(QUEUES[0])
        second = await pooled.open_sender(QUEUES[0])
        assert counters.cbs_tokens == 1
        assert pooled.pool.open_connections() == 1
        third = await pooled.open_sender(QUEUES[0])  # two links more there: the other one
        assert counters.cbs_tokens == 2 and pooled.pool.open_connections() == 2
        for i, s in enumerate((first, second, third)):
            await s.send([_msg(i)])
            await s.close()


async def test_senders_waiting_for_a_refused_put_token_put_their_own(
    broker: LocalBroker,
) -> None:
    """Senders to an entity the key does not cover, opened together: each is refused by an
    answer of its own (`ServiceBusAuthenticationError`), none waits past it."""
    client = _client_covering_q0_only(broker)
    try:
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(client.open_sender("q1") for _ in range(3)), return_exceptions=True
            )
        refusals = [r for r in results if isinstance(r, SendFailure)]
        assert len(refusals) == 3, results
        assert all(isinstance(r.__cause__, ServiceBusAuthenticationError) for r in refusals)
        assert broker.namespace("primary").counters.cbs_rejected == 3
        ok = await client.open_sender("q0")
        await ok.send([_msg(1)])
        await ok.close()
    finally:
        await client.close()


async def test_the_pool_forgets_the_entities_of_senders_gone(broker: LocalBroker) -> None:
    """`Slot.bound` (which entity's sender is bound where) keeps no entry per entity ever
    sent to: senders bound and dropped, one per entity, leave a bounded number behind."""
    import gc

    async with pooled_client(broker, connections=1) as pooled:
        slot = pooled.pool._slots[0]
        for i in range(300):
            sender = pooled.sdk_client.get_queue_sender(f"gone{i}")
            bound = pooled.pool.bind(sender)
            pooled.pool.unbind(bound)
            del sender
            if i % 50 == 0:
                gc.collect()
        assert len(slot.bound) <= 64 + 50 + 1
