"""What a kept-alive connection holds between requests (`gateway.web.protocol`'s loop).

aiohttp's request loop keeps the last request's objects (message, payload, request,
response) in its locals until the next request arrives: thousands of idle keep-alive
connections then hold tens of thousands of objects that the cycle collector promotes and
walks (docs/performance-results.md). The gateway's loop drops them before it idles; these
tests hold it to that with the collector off, so only reference counts free anything.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
from aiohttp import web

from gateway.config import load_settings
from gateway.web.runner import HardenedAppRunner
from gateway.web.shedding import ShedRequestHandler
from tests.support.waiting import eventually

from .test_slow_clients import open_raw, read_response, request_head

pytestmark = pytest.mark.integration


@pytest.fixture
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def test_an_idle_kept_alive_connection_holds_nothing_of_its_last_request(
    collector_off: None,
) -> None:
    requests: list[weakref.ref[web.BaseRequest]] = []
    responses: list[weakref.ref[web.StreamResponse]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        requests.append(weakref.ref(request))
        response = web.json_response({"n": len(requests)}, status=201)
        responses.append(weakref.ref(response))
        return response

    app = web.Application()
    app.router.add_post("/queues/{name}/messages", handler)
    runner = HardenedAppRunner(app, settings=load_settings({}), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        reader, writer = await open_raw(port)
        try:
            writer.write(request_head() + b"1")
            assert (await read_response(reader))[0] == 201
            # The connection stays open and idle: its request and response are freed anyway.
            await eventually(
                lambda: requests[0]() is None and responses[0]() is None,
                within=5,
                what="the idle connection's last request and response freed",
            )
            writer.write(request_head() + b"2")  # and the connection still serves
            assert (await read_response(reader))[0] == 201
            await eventually(lambda: requests[1]() is None, within=5, what="the second freed")
        finally:
            writer.close()
    finally:
        await runner.cleanup()


async def test_a_connection_closed_before_its_request_loop_began_closes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shutdown closes every connection (aiohttp's ``pre_shutdown``): an idle one by
    cancelling the wait for its next request. On Python 3.11 a connection's request loop
    starts a turn after ``connection_made``; one accepted as the listener closed was closed
    before its loop began, so there was no wait to cancel: the loop then waited for a
    request the closed connection ignores, and shutdown waited ``shutdown_timeout`` (10 s
    at SIGTERM, 10 runs in 75) for it. The loop must see the close and end."""
    connection_made = ShedRequestHandler.connection_made

    def closed_at_once(self: ShedRequestHandler, transport: asyncio.BaseTransport) -> None:
        connection_made(self, transport)
        self.close()  # as pre_shutdown does, before the loop's first turn

    monkeypatch.setattr(ShedRequestHandler, "connection_made", closed_at_once)
    runner = HardenedAppRunner(web.Application(), settings=load_settings({}), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        reader, writer = await open_raw(runner.addresses[0][1])
        try:
            async with asyncio.timeout(10):  # liveness: the keep-alive timeout is longer
                assert await reader.read() == b""  # closed by the server, nothing answered
        finally:
            writer.close()
    finally:
        await runner.cleanup()
