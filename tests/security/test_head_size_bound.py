"""The request head's size cap (`limits.max_header_bytes`) whatever way the bytes arrive.

`HardenedRequestHandler.data_received` measures a complete head only when the bytes fed since
the read that completed the last head exceed the cap (a bound of every head completed since).
These feed a connection's bytes to the protocol in every kind of split — a head begun in the
read that ends the last body, a head spread over many reads, several requests in one read —
and hold the answer to what the head's real size says: 431 over the cap, the handler's 201
otherwise. In process, on a fake transport: the chunks are exactly those chosen.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.harness import MemoryTransport
from gateway.web.protocol import Deadlines, HardenedServer

LIMIT = 2048


class _Transport(MemoryTransport):
    """What the protocol writes, and an event each time it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.wrote = asyncio.Event()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.out += data
        self.wrote.set()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True
        self.wrote.set()


def _request(extra: int, body: bytes) -> bytes:
    """A request whose head carries `extra` header fields of 300 bytes each."""
    lines = [
        "POST /queues/orders/messages HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Length: {len(body)}",
        *(f"X-Pad-{i}: {'p' * 290}" for i in range(extra)),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _head_size(request: bytes) -> int:
    return request.index(b"\r\n\r\n") + 4


async def _statuses(chunks: list[bytes], answers: int) -> list[int]:
    """The statuses the protocol answers after being fed `chunks`, once it has answered
    `answers` requests or closed the connection (the transport's close: `closed`)."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(status=201, body=b"ok")

    base = web.Server(handler)
    server = HardenedServer(base, Deadlines(30.0, 30.0, LIMIT), None)
    protocol = server()
    transport = _Transport()
    protocol.connection_made(transport)
    loop = asyncio.get_running_loop()
    try:
        for chunk in chunks:  # each read in a turn of its own, as from a socket
            loop.call_soon(protocol.data_received, chunk)
        async with asyncio.timeout(10):
            while True:
                statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", transport.out)]
                if len(statuses) >= answers or transport.closed:
                    return statuses
                transport.wrote.clear()
                await transport.wrote.wait()
    finally:
        protocol.connection_lost(None)
        await base.shutdown(1)


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    bounds = [0, *points, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@pytest.mark.unit
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first_body=st.integers(min_value=0, max_value=3000),
    second_extra=st.integers(min_value=0, max_value=12),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
async def test_a_head_is_refused_exactly_when_it_is_over_the_cap_however_it_arrives(
    first_body: int, second_extra: int, cuts: list[int]
):
    first = _request(0, b"a" * first_body)
    second = _request(second_extra, b"b")
    statuses = await _statuses(_split(first + second, cuts), answers=2)
    if _head_size(second) <= LIMIT:
        assert statuses == [201, 201], (statuses, _head_size(second))
    else:
        # Refused: answered 431 once its head is complete, or, while it is still arriving
        # with the first request in progress, the connection closed (nothing to answer yet).
        assert statuses in ([201, 431], [201], []), (statuses, _head_size(second))


_FIRST = _request(0, b"a" * 100)
_SECOND = _request(10, b"b")  # ~3 KiB of head: over the cap
_HEAD1 = _head_size(_FIRST)


@pytest.mark.unit
@pytest.mark.parametrize(
    "cuts",
    [
        # Most of the second head arrives with the end of the first body: while a body is
        # open, its read's bytes are not counted as head bytes.
        [_HEAD1 + 50, len(_FIRST) + _head_size(_SECOND) - 10],
        # The first request whole and most of the second head in one read: the read that
        # completes a head may begin the next one.
        [len(_FIRST) + _head_size(_SECOND) - 10],
    ],
    ids=["begun-with-a-body's-end", "begun-in-the-read-that-completed-a-head"],
)
async def test_a_head_over_the_cap_is_refused_whatever_read_it_began_in(cuts: list[int]):
    assert _head_size(_SECOND) > LIMIT
    assert await _statuses(_split(_FIRST + _SECOND, cuts), answers=2) == [201, 431]
