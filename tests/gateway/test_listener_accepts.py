"""Both edges' listeners take connections as fast as they come (`gateway.accepting`), on
uvloop as `gateway serve` runs: the HTTP listen port's site (`ShedSite`) and the AMQP
listeners (`AmqpServer`).

libuv, under uvloop, accepts one connection a turn of the event loop: a loop serving
~1,000 connections turned every few milliseconds and accepted a few hundred connections a
second, so the kernel's accept queue grew while the loop served, and its rule closed the
listener, resetting every queued connection. The listeners take the queue themselves, up
to `ACCEPT_BATCH` each time a listening socket is readable. Counted here in turns of the
loop, not in time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.accepting import Acceptor
from gateway.amqp.server import AmqpServer
from gateway.config import load_settings
from gateway.lifetimes import CANCEL_GRACE
from gateway.web.listener import ShedSite
from sblocal.certs import client_ssl_context, ensure_dev_cert
from tests.support.processes import free_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

CONNECTS = 100


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _turns_until(count: int, port: int, accepted: Callable[[], int]) -> int:
    """Turns of the loop until `count` connections, made while the loop was held (blocking
    connects: the kernel completes them, the loop accepts none meanwhile), were accepted."""
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        turns = 0
        async with asyncio.timeout(60):  # liveness only
            while accepted() < count:
                await asyncio.sleep(0)  # one turn of the loop
                turns += 1
        return turns
    finally:
        for client in clients:
            client.close()


async def _turns_to_accept(count: int) -> tuple[int, int]:
    """Turns of the loop until `count` connections, made while the loop was held, were
    accepted (each seen by the app's server): (turns, accepted)."""
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = ShedSite(runner, "127.0.0.1", 0)
        await site.start()
        server = runner.server
        assert server is not None
        turns = await _turns_until(count, site.port, lambda: len(server.connections))
        return turns, len(server.connections)
    finally:
        await runner.cleanup()


async def _amqp_turns_to_accept(count: int) -> tuple[int, int]:
    settings = load_settings({"SBGATE_AMQP_PLAIN_PORT": str(free_port())})
    server = AmqpServer(settings, None, None)  # type: ignore[arg-type]  # no message is sent
    await server.start()
    try:
        turns = await _turns_until(count, server.ports["plain"], lambda: server.connections)
        return turns, server.connections
    finally:
        await server.close()


EDGES: dict[str, Callable[[int], Awaitable[tuple[int, int]]]] = {
    "http": _turns_to_accept,
    "amqp": _amqp_turns_to_accept,
}


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_a_burst_of_connects_is_accepted_in_a_few_turns_of_the_loop(edge: str) -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        turns, accepted = runner.run(EDGES[edge](CONNECTS))
    assert accepted == CONNECTS
    # One a turn would take CONNECTS turns; taken from the queue, a handful.
    assert turns <= CONNECTS // 10, f"{turns} turns to accept {CONNECTS} connections"


@pytest.mark.parametrize("edge", sorted(EDGES))
async def test_a_burst_is_accepted_on_the_default_loop_too(edge: str) -> None:
    turns, accepted = await EDGES[edge](CONNECTS)
    assert accepted == CONNECTS and turns <= CONNECTS // 10


async def _tls_among_failed_handshakes(cert: Path, key: Path, failing: int) -> tuple[int, bool]:
    """`failing` connects that send no TLS (plain bytes, then nothing) queued while the loop
    was held, then one TLS client: (the AMQP connections open once it is served, whether
    every failing one was closed by the server)."""
    settings = load_settings(
        {
            "SBGATE_AMQP_PORT": str(free_port()),
            "SBGATE_AMQP_TLS_CERT_FILE": str(cert),
            "SBGATE_AMQP_TLS_KEY_FILE": str(key),
        }
    )
    server = AmqpServer(settings, None, None)  # type: ignore[arg-type]  # no message is sent
    await server.start()
    port = server.ports["tls"]
    bad = [socket.create_connection(("127.0.0.1", port)) for _ in range(failing)]
    try:
        for sock in bad:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(30):  # liveness only
            _reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ssl_context(cert), server_hostname="localhost"
            )
            try:
                await eventually(lambda: server.connections >= 1, within=30)
                served = server.connections
            finally:
                writer.close()
            closed = 0
            for sock in bad:  # each is answered with a TLS alert at most, then closed
                sock.setblocking(False)
                while True:
                    try:
                        if not await asyncio.get_running_loop().sock_recv(sock, 4096):
                            break
                    except ConnectionResetError:
                        break
                closed += 1
        return served, closed == failing
    finally:
        for sock in bad:
            sock.close()
        await server.close()


def test_failed_tls_handshakes_are_dropped_quietly_and_a_tls_client_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Connections taken a batch at a time go through the same TLS handshake as the loop's
    own (`connect_accepted_socket`): one that fails is closed and logged at DEBUG only (a
    port scanner must not fill the log), and the listener goes on serving."""
    uvloop = pytest.importorskip("uvloop")
    cert, key = ensure_dev_cert(tmp_path)
    with caplog.at_level(logging.DEBUG), asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        served, all_closed = r.run(_tls_among_failed_handshakes(cert, key, failing=20))
    assert served == 1 and all_closed
    # The batch accept met them (the loop's own takes one a turn): its DEBUG lines say so.
    assert any(rec.name == "gateway.accepting" for rec in caplog.records)
    loud = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert not loud, [rec.getMessage() for rec in loud]


async def _handshakes_taken(cert: Path, key: Path, cap: int, connects: int) -> int:
    """The most TLS handshakes the batch accept held at once while `connects` clients that
    never send a byte waited in the queue, against an AMQP connection cap of `cap`."""
    settings = load_settings(
        {
            "SBGATE_AMQP_PORT": str(free_port()),
            "SBGATE_AMQP_TLS_CERT_FILE": str(cert),
            "SBGATE_AMQP_TLS_KEY_FILE": str(key),
            "SBGATE_AMQP_MAX_CONNECTIONS": str(cap),
        }
    )
    server = AmqpServer(settings, None, None)  # type: ignore[arg-type]  # no message is sent
    await server.start()
    silent = [socket.create_connection(("127.0.0.1", server.ports["tls"])) for _ in range(connects)]
    try:
        most = 0
        for _ in range(50):  # turns of the loop: the batch accept meets the queue in the first
            await asyncio.sleep(0)
            most = max(most, server._acceptor.pending)
        return most
    finally:
        for sock in silent:
            sock.close()
        await server.close()


def test_the_batch_accept_holds_no_more_handshakes_than_the_connection_cap(
    tmp_path: Path,
) -> None:
    """Clients that connect and never finish a TLS handshake are taken a batch at a time
    only up to the connection cap (those in their handshake counted): a flood of them does
    not make the edge hold handshakes without bound (the loop's own accept, one a turn, goes
    on beside it, as before)."""
    uvloop = pytest.importorskip("uvloop")
    cert, key = ensure_dev_cert(tmp_path)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        most = runner.run(_handshakes_taken(cert, key, cap=10, connects=60))
    assert 1 <= most <= 10, most


class _Told(asyncio.Protocol):
    """A connection's protocol that stops `acceptor` from its own `connection_made`: the
    acceptor's hand-over task is then about to resume, its connect already done."""

    def __init__(self, acceptor: Acceptor) -> None:
        self._acceptor = acceptor
        self.stopping: asyncio.Task[None] | None = None
        self.transport: Any = None  # uvloop's transports are no `asyncio.Transport`
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.stopping = asyncio.get_running_loop().create_task(self._acceptor.stop(CANCEL_GRACE))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True


async def _answer_after_stop() -> bytes | str:
    """Stop an `Acceptor` as it hands a connection over; then answer on that connection:
    what its client reads (or how the answer failed)."""
    listening = socket.create_server(("127.0.0.1", 0))
    listening.setblocking(False)
    acceptor = Acceptor("test listener")
    told = _Told(acceptor)
    acceptor.watch([listening], lambda: told)
    try:
        async with asyncio.timeout(10):  # liveness only
            reader, writer = await asyncio.open_connection(*listening.getsockname()[:2])
            try:
                await eventually(lambda: told.stopping is not None and told.stopping.done())
                assert told.transport is not None and not told.lost
                try:
                    told.transport.write(b"answer")
                except RuntimeError as exc:  # uvloop: the handle was closed under the protocol
                    return repr(exc)
                return await reader.readexactly(6)
            finally:
                writer.close()
    finally:
        await acceptor.stop(CANCEL_GRACE)
        listening.close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_stopping_the_accepts_never_closes_a_connection_already_handed_over(loop: str) -> None:
    """A connection whose protocol heard `connection_made` belongs to the server from then
    on: stopping the batch accept (at shutdown) must not cancel its hand-over. uvloop's
    `connect_accepted_socket`, cancelled after the protocol heard `connection_made`, closes
    the socket under it without calling `connection_lost`: a request read meanwhile was
    handled, stored, and its answer could not be written (seen at SIGTERM under load: a
    message stored and its client told the server disconnected)."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(_answer_after_stop()) == b"answer"
