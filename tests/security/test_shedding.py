"""Shedding overload before any work (`gateway.web.overload`), over real sockets.

Every refusal here is `503` + `Retry-After` with the error code `overloaded`, sent before
the request's body is read or its token checked, and nothing reaches the broker. None of
these tests times anything: a request is held in progress by a body the client has not
finished, and a head is made to wait by a broker latency (both the client's or the fault's
behaviour), and every answer is awaited under a liveness deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import orjson
import pytest

from gateway.app import create_app, edge_runner
from gateway.config import load_settings
from gateway.web.listener import MAX_ACCEPT_QUEUE, ShedSite
from gateway.web.overload import Shedder, exempt
from gateway.web.runner import HardenedAppRunner
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory, broker_env
from tests.gateway.test_auth_http import ENV as AUTH_ENV
from tests.gateway.test_auth_http import token
from tests.support.waiting import eventually

from .test_slow_clients import open_raw, read_response, read_until_closed, request_head

pytestmark = pytest.mark.integration


def _overloaded(status: int, body: bytes) -> None:
    assert status == 503, body
    assert orjson.loads(body)["error"] == "overloaded"


async def _stored(control: ControlClient) -> int:
    return len(await control.messages("primary", "orders"))


def _shedder(client) -> Shedder:  # type: ignore[no-untyped-def]
    runner = client.server.runner
    assert isinstance(runner, HardenedAppRunner) and runner.shedder is not None
    return runner.shedder


async def _shed_total(client, reason: str) -> float:  # type: ignore[no-untyped-def]
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(f'sbgate_http_shed_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sbgate_http_shed_total series for {reason}")


async def test_a_connection_over_the_cap_is_answered_503_and_closed(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_CONNECTIONS": "2"})
    port = client.port
    held = [await open_raw(port) for _ in range(2)]
    reader, writer = await open_raw(port)
    writer.write(request_head() + b"x")
    reply = await read_until_closed(reader, within=10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply[:200]
    assert b"Retry-After: " in head and b"Connection: close" in head
    _overloaded(503, body)
    writer.close()
    # A freed slot is usable again: the refusal was the cap's, and the count follows closes.
    for _, w in held:
        w.close()
    shedder = _shedder(client)
    await eventually(lambda: shedder.connections == 0, what="closed connections uncounted")
    ok_reader, ok_writer = await open_raw(port)
    ok_writer.write(request_head() + b"x")
    status, _ = await read_response(ok_reader)
    assert status == 201
    ok_writer.close()
    assert await _stored(control) == 1


async def test_a_request_over_the_in_progress_cap_is_503_unread_and_unauthorized_checks_skipped(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({**AUTH_ENV, "SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"})
    port = client.port
    good = f"Authorization: {token('orders')}"
    # One request in progress: its handler waits for a body the client has not finished.
    slow_reader, slow_writer = await open_raw(port)
    slow_writer.write(request_head("/queues/orders/messages", good, length=10) + b"12345")
    await slow_writer.drain()
    shedder = _shedder(client)
    await eventually(lambda: shedder.in_progress == 1, what="the slow request in progress")
    # A second request: a body it never finishes and a token that is garbage. It is answered
    # at once, so its body was not awaited and its token not checked (that would be a 401).
    reader, writer = await open_raw(port)
    bad = "Authorization: SharedAccessSignature garbage"
    writer.write(request_head("/queues/orders/messages", bad, length=1000) + b"abc")
    status, body = await read_response(reader, within=10)
    _overloaded(status, body)
    assert await read_until_closed(reader, within=10) == b""  # the connection is closed
    assert await _shed_total(client, "in_progress") >= 1
    # The first request completes normally; then room is back.
    slow_writer.write(b"67890")
    status, _ = await read_response(slow_reader)
    assert status == 201
    resp = await client.post(
        "/queues/orders/messages", data=b"again", headers={"Authorization": token("orders")}
    )
    assert resp.status == 201
    assert await _stored(control) == 2
    slow_writer.close()
    writer.close()


async def test_a_head_that_waited_too_long_for_its_handler_is_503(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_HEAD_WAIT": "0.2", "SBGATE_SEND_TIMEOUT": "10"})
    await control.set_latency("primary", round_trip_ms=600)
    reader, writer = await open_raw(client.port)
    # Two pipelined requests: the second head is parsed with the first, and waits while the
    # first is sent (>= 600 ms of broker latency), longer than max_head_wait.
    writer.write(request_head() + b"1" + request_head() + b"2")
    first, _ = await read_response(reader, within=20)
    second, body = await read_response(reader, within=20)
    assert first == 201
    _overloaded(second, body)
    assert await _shed_total(client, "head_wait") == 1
    writer.close()
    assert [m["body_text"] for m in await control.messages("primary", "orders")] == ["1"]


async def test_without_caps_nothing_is_shed(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway(
        {
            "SBGATE_MAX_CONNECTIONS": "0",
            "SBGATE_MAX_REQUESTS_IN_PROGRESS": "0",
            "SBGATE_MAX_HEAD_WAIT": "0",
        }
    )
    answers = await asyncio.gather(
        *(client.post("/queues/orders/messages", data=b"m") for _ in range(20))
    )
    assert [a.status for a in answers] == [201] * 20
    for reason in ("connections", "in_progress", "head_wait"):
        assert await _shed_total(client, reason) == 0


@contextlib.asynccontextmanager
async def serving(broker: BrokerProcess, **env: str) -> AsyncIterator[tuple[ShedSite, Shedder]]:
    """The gateway served as `gateway serve` serves it (`ShedSite`), on a free port."""
    settings = load_settings(broker_env(broker, **env))
    runner = edge_runner(create_app(settings), settings)
    await runner.setup()
    try:
        site = ShedSite(runner, "127.0.0.1", 0)
        await site.start()
        assert runner.shedder is not None
        yield site, runner.shedder
    finally:
        await runner.cleanup()


async def served(port: int) -> None:
    reader, writer = await open_raw(port)
    writer.write(request_head() + b"x")
    status, _ = await read_response(reader)
    assert status == 201
    writer.close()


async def test_at_the_connection_cap_the_listener_pauses_and_connections_are_refused(
    broker: BrokerProcess, control: ControlClient
) -> None:
    """As `gateway serve` listens (`ShedSite`): at the cap, new connections are refused by
    the kernel (no answer to build, no work in the loop); under it again, served."""
    async with serving(broker, SBGATE_MAX_CONNECTIONS="20") as (site, shedder):
        held = [await open_raw(site.port) for _ in range(20)]
        await eventually(lambda: shedder.connections == 20, what="the connections counted")
        assert shedder.paused and not site.listening
        with pytest.raises(ConnectionRefusedError):
            await open_raw(site.port)
        assert shedder.connections == 20, "a refused connection is never accepted"
        # One closed: 19 is over 90% of the cap, still paused (no flapping at every close).
        held.pop()[1].close()
        await eventually(lambda: shedder.connections == 19, what="a close counted")
        assert shedder.paused
        with pytest.raises(ConnectionRefusedError):
            await open_raw(site.port)
        # Another: back under the mark, listening again, and served.
        held.pop()[1].close()
        await eventually(lambda: site.listening, what="listening again")
        await served(site.port)
        for _, w in held:
            w.close()
    assert await _stored(control) == 1


async def test_a_long_accept_queue_closes_the_listener_for_a_while(
    broker: BrokerProcess, control: ControlClient
) -> None:
    """Connections the kernel completed and the loop has not accepted (here: made while the
    test holds the loop) are a backlog no cap sees: over the bound at two looks, the
    listener closes (they are reset, new ones refused), then listens again."""
    waiting: list[socket.socket] = []
    async with serving(broker) as (site, _):
        # Synchronous connects: the kernel completes them, the loop cannot accept meanwhile.
        address = ("127.0.0.1", site.port)
        waiting = [socket.create_connection(address) for _ in range(MAX_ACCEPT_QUEUE + 1)]
        assert site.accept_queue() == MAX_ACCEPT_QUEUE + 1
        site._look()
        assert site.listening, "one look is not a backlog"
        site._look()
        assert not site.listening
        with pytest.raises(ConnectionRefusedError):
            await open_raw(site.port)
        await eventually(lambda: site.listening, what="listening again after the pause")
        assert site.pauses("accept_queue") == 1 and site.paused_seconds("accept_queue") > 0
        await served(site.port)
    for sock in waiting:
        sock.close()
    assert await _stored(control) == 1


async def test_a_long_accept_queue_while_requests_have_no_room_closes_the_listener_at_one_look(
    broker: BrokerProcess, control: ControlClient
) -> None:
    """The loop does not take the queue while the requests in progress have no room, so a
    queue over the bound then is not a burst being drained: its connections, whose requests
    are already sent, are reset at the first look instead of waiting for a second one."""
    waiting: list[socket.socket] = []
    async with serving(broker, SBGATE_MAX_REQUESTS_IN_PROGRESS="2") as (site, shedder):
        _, writer = await open_raw(site.port)
        writer.write(request_head(length=2) + b"x")  # in progress: its body never finishes
        await eventually(lambda: shedder.in_progress == 1, what="a request in progress")
        assert not shedder.has_room()
        address = ("127.0.0.1", site.port)
        waiting = [socket.create_connection(address) for _ in range(MAX_ACCEPT_QUEUE + 1)]
        assert site.accept_queue() == MAX_ACCEPT_QUEUE + 1
        site._look()
        assert not site.listening
        assert site.pauses("accept_queue") == 1
        writer.close()
        await eventually(lambda: site.listening, what="listening again after the pause")
        await served(site.port)
    for sock in waiting:
        sock.close()
    assert await _stored(control) == 1


async def test_a_long_accept_queue_that_is_draining_does_not_close_the_listener(
    broker: BrokerProcess, control: ControlClient
) -> None:
    """A burst of connects (a load generator opening its clients at once) is long at one
    look and shorter at the next, as the loop accepts it: not a backlog, the listener stays
    open (closing it would reset every connection still queued, for good)."""
    waiting: list[socket.socket] = []
    async with serving(broker) as (site, _):
        address = ("127.0.0.1", site.port)
        waiting = [socket.create_connection(address) for _ in range(MAX_ACCEPT_QUEUE + 1)]
        # The previous look saw a longer queue than this one: it is being drained.
        site._was_long = MAX_ACCEPT_QUEUE + 50
        site._look()
        assert site.listening
        assert site.pauses("accept_queue") == 0
        await served(site.port)
    for sock in waiting:
        sock.close()
    assert await _stored(control) == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("path", "is_exempt"),
    [
        ("/healthz", True),
        ("/readyz", True),
        ("/metrics", True),
        ("/admin/entities", True),
        ("/admin/entities/orders/healthy", True),
        ("/admin/entities/a/b/failover", True),
        ("/metrics/messages", False),  # the short route of an entity named `metrics`
        ("/healthz/messages", False),
        ("/admin/x/messages", False),
        ("/admin/entities/messages", False),
        ("/admin/entities/orders", False),
        ("/metricsx", False),
    ],
)
def test_exemptions_are_by_exact_route(path: str, is_exempt: bool) -> None:
    """Issue 33: the prefix `/metrics` exempted `POST /metrics/messages` from shedding."""
    assert exempt(path) is is_exempt


async def test_an_entity_named_like_an_exempt_route_is_shed_like_any_send(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway(
        {"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1", "SBGATE_ENTITIES": "queue:orders,queue:metrics"}
    )
    port = client.port
    slow_reader, slow_writer = await open_raw(port)
    slow_writer.write(request_head("/queues/orders/messages", length=10) + b"12345")
    await slow_writer.drain()
    shedder = _shedder(client)
    await eventually(lambda: shedder.in_progress == 1, what="the slow request in progress")
    for path in ("/metrics/messages", "/queues/metrics/messages"):
        reader, writer = await open_raw(port)
        writer.write(request_head(path, length=1) + b"x")
        status, body = await read_response(reader, within=10)
        _overloaded(status, body)
        writer.close()
    assert (await client.get("/metrics")).status == 200  # the scrape itself is exempt
    slow_writer.write(b"67890")
    status, _ = await read_response(slow_reader)
    assert status == 201
    slow_writer.close()
    assert await _stored(control) == 1
    assert (await control.counters("primary")).get("sends", 0) == 1  # nothing else went out


async def test_a_listener_that_cannot_listen_again_says_so_and_is_not_ready(
    broker: BrokerProcess, control: ControlClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 33: paused at the cap, then another process took the port: the reopen retried
    for ever without a word and readiness stayed green. Now it logs (rate-limited), the
    readiness check names it, and once the port is free it listens and is ready again."""
    async with serving(broker, SBGATE_MAX_CONNECTIONS="2") as (site, _):
        held = [await open_raw(site.port) for _ in range(2)]
        await eventually(lambda: not site.listening, what="paused at the cap")
        thief = socket.socket()
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", site.port))
        thief.listen()
        try:
            with caplog.at_level(logging.WARNING, logger="gateway.web.listener"):
                for _, w in held:
                    w.close()
                await eventually(lambda: site.not_listening_reason() is not None, what="noticed")
                assert "cannot listen on" in (site.not_listening_reason() or "")
                await eventually(
                    lambda: any("cannot listen again" in r.message for r in caplog.records),
                    what="logged",
                )
                logged = sum("cannot listen again" in r.message for r in caplog.records)
                assert logged == 1, "rate-limited: once, not at every retry"
        finally:
            thief.close()
        await eventually(lambda: site.listening, what="listening again")
        assert site.not_listening_reason() is None
        await served(site.port)
    assert await _stored(control) == 1
