"""Admission at the request head (`gateway.web.shedding`), over real sockets.

A request that arrives at the in-progress limit on an idle connection, its body already in,
is answered with pre-encoded `503 overloaded` bytes before aiohttp builds a request for it,
and the connection stays open; everything else keeps its answer. A request is held in
progress by a body its client has not finished (the client's behaviour, not a timer); every
answer is awaited under a liveness deadline and nothing is timed.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.web.overload import Shedder
from gateway.web.runner import HardenedAppRunner
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.support.http import read_answer
from tests.support.waiting import eventually

from .test_slow_clients import open_raw, read_response, read_until_closed, request_head

pytestmark = pytest.mark.integration


def _shedder(client) -> Shedder:  # type: ignore[no-untyped-def]
    runner = client.server.runner
    assert isinstance(runner, HardenedAppRunner) and runner.shedder is not None
    return runner.shedder


async def _head_and_body(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response's head and body, read by its Content-Length (so nothing is left over:
    a partial or doubled write would show as a wrong length or stray bytes after it)."""
    async with asyncio.timeout(10):
        return await read_answer(reader)


async def _stored(control: ControlClient) -> list[str]:
    return [m["body_text"] for m in await control.messages("primary", "orders")]


async def _hold_one_in_progress(port: int, shedder: Shedder):  # type: ignore[no-untyped-def]
    """A request in progress until its client sends the rest of its body."""
    reader, writer = await open_raw(port)
    writer.write(request_head(length=4) + b"he")
    await writer.drain()
    await eventually(lambda: shedder.in_progress == 1, what="the slow request in progress")
    return reader, writer


async def _release(slow, shedder: Shedder) -> None:  # type: ignore[no-untyped-def]
    """The held request's client sends the rest of its body: it is answered 201."""
    slow_reader, slow_writer = slow
    slow_writer.write(b"ld")
    assert (await read_response(slow_reader, within=10))[0] == 201
    await eventually(lambda: shedder.in_progress == 0, what="the slow request done")


async def test_at_the_limit_a_complete_request_gets_503_json_and_its_connection_stays_open(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"})
    shedder = _shedder(client)
    slow_reader, slow_writer = await _hold_one_in_progress(client.port, shedder)
    reader, writer = await open_raw(client.port)
    writer.write(request_head(length=7) + b"refused")
    head, body = await _head_and_body(reader)
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), head
    assert b"\r\nRetry-After: " in head and b"\r\nX-Request-Id: " in head
    assert b"Connection: close" not in head
    assert b"Content-Type: application/json" in head
    assert orjson.loads(body)["error"] == "overloaded"
    assert shedder.in_progress == 1  # the refused request was never counted
    # The slow request is unaffected; once it is answered, the same kept-alive connection
    # that was refused is served.
    await _release((slow_reader, slow_writer), shedder)
    writer.write(request_head(length=5) + b"again")
    status, _ = await read_response(reader, within=10)
    assert status == 201
    assert sorted(await _stored(control)) == ["again", "held"]
    for w in (writer, slow_writer):
        w.close()


async def test_a_refused_request_that_asks_to_close_gets_its_503_and_the_close(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"})
    shedder = _shedder(client)
    slow_reader, slow_writer = await _hold_one_in_progress(client.port, shedder)
    reader, writer = await open_raw(client.port)
    writer.write(request_head("/queues/orders/messages", "Connection: close", length=1) + b"x")
    reply = await read_until_closed(reader, within=10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Connection: close" in head, reply[:300]
    assert orjson.loads(body)["error"] == "overloaded"
    slow_writer.write(b"ld")
    assert (await read_response(slow_reader, within=10))[0] == 201
    assert await _stored(control) == ["held"]
    for w in (writer, slow_writer):
        w.close()


async def test_pipelined_requests_under_the_limit_are_answered_in_order_and_uncounted_after(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "8"})
    shedder = _shedder(client)
    reader, writer = await open_raw(client.port)
    writer.write(b"".join(request_head(length=1) + str(i).encode() for i in range(3)))
    for _ in range(3):
        assert (await read_response(reader, within=10))[0] == 201
    assert sorted(await _stored(control)) == ["0", "1", "2"]
    await eventually(lambda: shedder.in_progress == 0, what="every request uncounted")
    writer.close()


async def test_requests_counted_at_their_head_are_uncounted_when_the_client_leaves(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "8"})
    shedder = _shedder(client)
    await control.set_latency("primary", round_trip_ms=300)
    _reader, writer = await open_raw(client.port)
    # Three pipelined requests: the first is being sent while the other two wait, counted.
    writer.write(b"".join(request_head(length=1) + str(i).encode() for i in range(3)))
    await writer.drain()
    await eventually(lambda: shedder.in_progress == 3, what="three requests counted")
    writer.close()
    await eventually(lambda: shedder.in_progress == 0, what="the counts released")
    # The process admits again at its full limit.
    await control.set_latency("primary", round_trip_ms=0)
    resp = await client.post("/queues/orders/messages", data=b"after")
    assert resp.status == 201
    assert "after" in await _stored(control)


async def test_pipelined_and_chunked_requests_at_the_limit_each_get_a_whole_503_in_order(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    # Neither is refused unparsed (two requests in one read; a chunked body): the parser
    # frames them, and each is answered in turn on the connection, which stays usable.
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"})
    shedder = _shedder(client)
    slow_reader, slow_writer = await _hold_one_in_progress(client.port, shedder)
    reader, writer = await open_raw(client.port)
    chunked = (
        b"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    writer.write(request_head(length=1) + b"a" + request_head(length=1) + b"b" + chunked)
    for _ in range(3):
        head, body = await _head_and_body(reader)
        assert head.startswith(b"HTTP/1.1 503 "), head
        assert orjson.loads(body)["error"] == "overloaded"
    await _release((slow_reader, slow_writer), shedder)
    writer.write(chunked)
    assert (await read_response(reader, within=10))[0] == 201
    assert sorted(await _stored(control)) == ["abc", "held"]
    for w in (writer, slow_writer):
        w.close()


async def test_a_request_refused_unparsed_leaves_the_connection_at_a_request_boundary(
    hardened_gateway: GatewayFactory, control: ControlClient
) -> None:
    # Refused at the limit many times over on one connection (each a whole request in one
    # read: refused before any parsing), then served on the same connection.
    client = await hardened_gateway({"SBGATE_MAX_REQUESTS_IN_PROGRESS": "1"})
    shedder = _shedder(client)
    slow_reader, slow_writer = await _hold_one_in_progress(client.port, shedder)
    reader, writer = await open_raw(client.port)
    body = b'{"n": "\r\n\r\nPOST / HTTP/1.1\r\n\r\n"}'  # a head inside the body: still body
    for _ in range(20):
        writer.write(request_head(length=len(body)) + body)
        head, answer = await _head_and_body(reader)
        assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: " in head, head
        assert orjson.loads(answer)["error"] == "overloaded"
    assert shedder.in_progress == 1
    await _release((slow_reader, slow_writer), shedder)
    writer.write(request_head(length=len(body)) + body)
    assert (await read_response(reader, within=10))[0] == 201
    assert sorted(await _stored(control)) == sorted([body.decode(), "held"])
    for w in (writer, slow_writer):
        w.close()
