"""The listen port's site takes connections as fast as they come (`ShedSite`), on uvloop as
`gateway serve` runs.

libuv, under uvloop, accepts one connection a turn of the event loop: a loop serving
~1,000 connections turned every few milliseconds and accepted a few hundred connections a
second, so the kernel's accept queue grew while the loop served, and its rule closed the
listener, resetting every queued connection. The site takes the queue itself, up to
`ACCEPT_BATCH` each time the listening socket is readable. Counted here in turns of the
loop, not in time.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from gateway.web.listener import ShedSite

pytestmark = pytest.mark.integration

CONNECTS = 100


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _turns_to_accept(count: int) -> tuple[int, int]:
    """Turns of the loop until `count` connections, made while the loop was held, were
    accepted (each seen by the app's server): (turns, accepted)."""
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    clients: list[socket.socket] = []
    try:
        site = ShedSite(runner, "127.0.0.1", 0)
        await site.start()
        server = runner.server
        assert server is not None
        # Blocking connects: the kernel completes them, the loop accepts none meanwhile.
        clients = [socket.create_connection(("127.0.0.1", site.port)) for _ in range(count)]
        turns = 0
        async with asyncio.timeout(60):  # liveness only
            while len(server.connections) < count:
                await asyncio.sleep(0)  # one turn of the loop
                turns += 1
        return turns, len(server.connections)
    finally:
        for client in clients:
            client.close()
        await runner.cleanup()


def test_a_burst_of_connects_is_accepted_in_a_few_turns_of_the_loop() -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        turns, accepted = runner.run(_turns_to_accept(CONNECTS))
    assert accepted == CONNECTS
    # One a turn would take CONNECTS turns; taken from the queue, a handful.
    assert turns <= CONNECTS // 10, f"{turns} turns to accept {CONNECTS} connections"


async def test_a_burst_is_accepted_on_the_default_loop_too() -> None:
    turns, accepted = await _turns_to_accept(CONNECTS)
    assert accepted == CONNECTS and turns <= CONNECTS // 10
