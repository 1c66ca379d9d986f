"""Slow, greedy and malformed clients over real sockets (127.0.0.1): `gateway.web.protocol`.

The pauses between a slow client's bytes are that client's behaviour, not waits for a
condition: every condition is awaited (EOF on the socket, a response) under a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest

from tests.conftest import GatewayFactory

SLOW_CONNECTIONS = 240
HEAD_TIMEOUT = 2.0


async def open_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_until_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes the connection (fails after `within` s)."""
    data = b""
    async with asyncio.timeout(within):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk


async def read_response(reader: asyncio.StreamReader, within: float = 5.0) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, body)."""
    async with asyncio.timeout(within):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(line.split(":", 1)[1])
            for line in lines
            if line.lower().startswith("content-length:")
        )
        body = await reader.readexactly(length)
    return status, body


def request_head(path: str = "/queues/orders/messages", *extra: str, length: int = 1) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def slowloris(port: int) -> float:
    """Open a connection, trickle header lines forever; return how long until it was closed."""
    # Timed from before the connect: the server's deadline starts when it accepts, which
    # may be long before this task resumes on a busy loop, never before it starts.
    opened = time.monotonic()
    reader, writer = await open_raw(port)
    closed = asyncio.create_task(read_until_closed(reader, within=HEAD_TIMEOUT + 10))
    try:
        writer.write(b"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        i = 0
        while not closed.done():
            writer.write(f"X-Slow-{i}: {'a' * 8}\r\n".encode())
            i += 1
            try:
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait({closed}, timeout=0.25)  # a header line every 250 ms
        reply = await closed
        assert reply == b"", reply[:200]  # closed without an answer
        return time.monotonic() - opened
    finally:
        closed.cancel()
        writer.close()


async def test_slowloris_connections_are_closed_while_normal_traffic_flows(
    hardened_gateway: GatewayFactory, control
):
    gw = await hardened_gateway(
        {"SBGATE_HEADER_TIMEOUT": str(HEAD_TIMEOUT), "SBGATE_KEEPALIVE_TIMEOUT": "30"}
    )
    port = gw.server.port
    assert port is not None
    # Open the slow connections in waves (the listen backlog is 128), then send normal
    # requests while every one of them is trickling.
    slow: list[asyncio.Task[float]] = []
    for _ in range(SLOW_CONNECTIONS // 40):
        slow.extend(asyncio.create_task(slowloris(port)) for _ in range(40))
        await asyncio.sleep(0)
    started = time.monotonic()

    async def normal(i: int) -> int:
        resp = await gw.post(
            "/queues/orders/messages",
            data=f"m{i}".encode(),
            headers={"BrokerProperties": orjson.dumps({"MessageId": f"n-{i}"}).decode()},
        )
        return resp.status

    statuses: list[int] = []
    # Normal traffic for as long as the slow connections are held (they last HEAD_TIMEOUT).
    while time.monotonic() - started < HEAD_TIMEOUT:
        statuses.extend(await asyncio.gather(*(normal(len(statuses) + j) for j in range(10))))
    lifetimes = await asyncio.gather(*slow)

    assert len(statuses) >= 50 and set(statuses) == {201}, statuses
    assert (await control.entity("primary", "orders"))["active"] == len(statuses)
    # Every slow connection was closed (read_until_closed gives up after HEAD_TIMEOUT + 10 s,
    # which is the hang guard), and not before the head deadline.
    assert min(lifetimes) >= HEAD_TIMEOUT - 0.2, min(lifetimes)
    # And the gateway still serves new connections normally.
    assert (await gw.get("/healthz")).status == 200


async def test_a_silent_connection_is_closed_by_the_head_deadline(hardened_gateway):
    gw = await hardened_gateway({"SBGATE_HEADER_TIMEOUT": "0.5", "SBGATE_KEEPALIVE_TIMEOUT": "30"})
    t0 = time.monotonic()  # before the connect: the deadline starts when the server accepts
    reader, writer = await open_raw(gw.server.port)
    assert await read_until_closed(reader, within=5) == b""
    assert time.monotonic() - t0 >= 0.4  # closed by the deadline, not before it
    writer.close()


async def test_a_keepalive_connection_may_idle_longer_than_the_head_deadline(
    hardened_gateway, control
):
    """The head deadline counts from the next request's first byte, not from the last response."""
    gw = await hardened_gateway({"SBGATE_HEADER_TIMEOUT": "0.3", "SBGATE_KEEPALIVE_TIMEOUT": "5"})
    reader, writer = await open_raw(gw.server.port)
    try:
        writer.write(request_head() + b"1")
        assert (await read_response(reader))[0] == 201
        await asyncio.sleep(0.8)  # the client idles (keep-alive), longer than the head deadline
        writer.write(request_head() + b"2")
        assert (await read_response(reader))[0] == 201
    finally:
        writer.close()
    assert (await control.entity("primary", "orders"))["active"] == 2


async def test_an_idle_keepalive_connection_is_closed(hardened_gateway):
    gw = await hardened_gateway({"SBGATE_KEEPALIVE_TIMEOUT": "0.5"})
    reader, writer = await open_raw(gw.server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    assert await read_until_closed(reader, within=5) == b""
    writer.close()


async def test_a_trickled_body_is_answered_408_and_nothing_is_sent(hardened_gateway, control):
    gw = await hardened_gateway({"SBGATE_BODY_TIMEOUT": "0.5"})
    reader, writer = await open_raw(gw.server.port)
    t0 = time.monotonic()
    writer.write(request_head(length=1000) + b"only part of it")
    status, body = await read_response(reader)
    assert status == 408 and time.monotonic() - t0 >= 0.4
    assert orjson.loads(body)["error"] == "request_timeout"
    assert await read_until_closed(reader, within=5) == b""  # and the connection is closed
    writer.close()
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_a_body_ignored_by_the_handler_is_not_waited_for(hardened_gateway, control):
    """A 401 answers at once; the unread, never-finished body then ends the connection."""
    gw = await hardened_gateway(
        {
            "SBGATE_BODY_TIMEOUT": "0.5",
            "SBGATE_AUTH_RULES": orjson.dumps(
                {
                    "rules": [
                        {
                            "name": "r",
                            "primary_key": "c2VuZGVyLWtleS1mb3ItdGVzdHMtb25seS0wMDAwMDAwMDA=",
                            "rights": ["Send"],
                            "entities": ["*"],
                        }
                    ]
                }
            ).decode(),
        }
    )
    reader, writer = await open_raw(gw.server.port)
    writer.write(request_head(length=1000) + b"part")
    assert (await read_response(reader))[0] == 401
    assert await read_until_closed(reader, within=15) == b""
    writer.close()


async def test_a_slow_but_steady_body_within_the_deadline_is_accepted(hardened_gateway, control):
    gw = await hardened_gateway({"SBGATE_BODY_TIMEOUT": "3"})
    reader, writer = await open_raw(gw.server.port)
    try:
        writer.write(request_head(length=30))
        for _ in range(3):
            writer.write(b"x" * 10)
            await writer.drain()
            await asyncio.sleep(0.2)  # the client sends its body in slow pieces
        assert (await read_response(reader))[0] == 201
    finally:
        writer.close()
    assert (await control.entity("primary", "orders"))["active"] == 1


async def test_too_many_headers_are_431(hardened_gateway, control):
    gw = await hardened_gateway({"SBGATE_MAX_HEADERS": "20"})
    reader, writer = await open_raw(gw.server.port)
    extra = [f"X-H{i}: v" for i in range(25)]
    writer.write(request_head("/queues/orders/messages", *extra) + b"x")
    status, body = await read_response(reader)
    assert status == 431
    assert orjson.loads(body)["error"] == "request_header_fields_too_large"
    writer.close()
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_headers_larger_than_the_limit_together_are_431(hardened_gateway, control):
    """Each field is under the per-field limit; together they are over max_header_bytes."""
    gw = await hardened_gateway({"SBGATE_MAX_HEADER_BYTES": "16384"})
    reader, writer = await open_raw(gw.server.port)
    writer.write(request_head()[:-2])  # the head is not finished
    try:
        for i in range(8):
            writer.write(f"X-Big-{i}: {'b' * 5000}\r\n".encode())
            await writer.drain()
    except ConnectionError:
        pass  # the server has already answered and closed
    reply = await read_until_closed(reader, within=5)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    assert b"request_header_fields_too_large" in reply
    writer.close()
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_one_header_over_the_limit_is_431(hardened_gateway, control):
    gw = await hardened_gateway({"SBGATE_MAX_HEADER_BYTES": "16384"})
    reader, writer = await open_raw(gw.server.port)
    writer.write(request_head("/queues/orders/messages", f"X-Big: {'b' * 20000}") + b"x")
    status, body = await read_response(reader)
    assert status == 431
    assert b"bbbb" not in body  # the value is never echoed
    writer.close()
    assert (await control.counters("primary")).get("sends", 0) == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"GXT\x00 / HTTP/1.1\r\n\r\n",
        b"POST /orders/messages HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /orders/messages HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
        b"POST /orders/messages HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    ],
)
async def test_unparseable_requests_get_a_json_400_and_no_error_log(
    hardened_gateway, control, caplog, raw
):
    gw = await hardened_gateway()
    reader, writer = await open_raw(gw.server.port)
    with caplog.at_level(logging.WARNING):
        writer.write(raw)
        status, body = await read_response(reader)
        writer.close()
    assert status == 400
    assert orjson.loads(body)["error"] == "bad_request"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_pipelined_chunked_and_expect_continue_requests_still_work(hardened_gateway, control):
    """The protocol's bookkeeping (heads, bodies) follows every way a body can arrive."""
    gw = await hardened_gateway({"SBGATE_HEADER_TIMEOUT": "1", "SBGATE_BODY_TIMEOUT": "1"})
    reader, writer = await open_raw(gw.server.port)
    try:
        # Two requests in one write, the second one's body split across writes.
        writer.write(request_head() + b"1" + request_head(length=3) + b"2")
        writer.write(b"34")
        assert (await read_response(reader))[0] == 201
        assert (await read_response(reader))[0] == 201
        # A chunked body.
        writer.write(
            b"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
        )
        await writer.drain()
        writer.write(b"0\r\n\r\n")
        assert (await read_response(reader))[0] == 201
        # Expect: 100-continue: the body follows the interim answer.
        writer.write(request_head("/queues/orders/messages", "Expect: 100-continue", length=5))
        async with asyncio.timeout(5):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100"), interim
        writer.write(b"hello")
        assert (await read_response(reader))[0] == 201
    finally:
        writer.close()
    assert (await control.entity("primary", "orders"))["active"] == 4
