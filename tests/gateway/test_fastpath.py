"""The message route's short cuts (`gateway.web.fastpath`): taken where they are exact, and
giving the same answers as aiohttp's router and response machinery, byte for byte but for
the Date. The reference is the same gateway with a pass-through middleware and an
``on_response_prepare`` signal that does nothing, which leave both short cuts out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.web.fastpath import message_route_handler
from gateway.web.handlers import _send_request
from tests.conftest import GatewayFactory
from tests.gateway.test_app import Journal, build
from tests.support.http import read_answer


async def _general(request: Any) -> web.StreamResponse:
    return web.Response()


@pytest.mark.unit
def test_the_serving_app_takes_the_short_cut_and_an_app_with_middleware_does_not():
    app = build({}, Journal())
    assert message_route_handler(app, _send_request, _general) is not _general

    @web.middleware
    async def through(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        return await handler(request)

    with_middleware = build({}, Journal())
    with_middleware.middlewares.append(through)
    assert message_route_handler(with_middleware, _send_request, _general) is _general


@pytest.mark.unit
def test_no_short_cut_when_another_resource_would_be_tried_first_at_the_root():
    app = web.Application()
    app.router.add_post("/{anything:.+}", _general)  # tried before the message routes
    app.router.add_post("/{kind:queues|topics}/{name:.+}/{messages:(?i:messages)}", _send_request)
    app.router.add_post("/{name:.+}/{messages:(?i:messages)}", _send_request)
    assert message_route_handler(app, _send_request, _general) is _general


@web.middleware
async def _through(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    return await handler(request)


async def _prepared(request: web.Request, response: web.StreamResponse) -> None:
    return None


def _general_path(app: web.Application) -> None:
    """No short cut: a middleware (aiohttp's handler for every request) and a response
    signal (aiohttp's preparation for every answer), neither of which changes anything."""
    app.middlewares.append(_through)
    app.on_response_prepare.append(_prepared)


_BODY = b'{"n": 1}'
_PROPS = '{"MessageId": "m-1"}'


def _request(method: str, target: str, extra: str = "", version: str = "1.1") -> bytes:
    host = "" if extra.startswith("Host:") else "Host: 127.0.0.1\r\n"
    return (
        f"{method} {target} HTTP/{version}\r\n{host}X-Request-Id: rid-1\r\n"
        f"Content-Type: application/json\r\nBrokerProperties: {_PROPS}\r\n{extra}"
        f"Content-Length: {len(_BODY)}\r\n\r\n"
    ).encode() + _BODY


# Paths the short cut takes and paths it leaves to the router, each answered by both.
_CASES = [
    ("POST", "/queues/orders/messages", ""),
    ("POST", "/orders/messages", ""),
    ("POST", "/topics/orders/messages", ""),
    ("POST", "/queues/orders/Messages", ""),
    ("POST", "/Queues/orders/messages", ""),
    ("POST", "/queues/orders/messages?api-version=2021-05&timeout=60", ""),
    ("POST", "/queues/orders/messages", "Connection: close\r\n"),
    ("POST", "/queues/nothere/messages", ""),
    ("POST", "/queues/messages", ""),
    ("POST", "/queues/./messages", ""),
    ("POST", "/queues/../messages", ""),
    ("POST", "/queues/or%64ers/messages", ""),
    ("POST", "/admin/messages", ""),
    ("POST", "/healthz/messages", ""),
    ("POST", "/metrics/messages", ""),
    ("POST", "/queues/orders/messages/head", ""),
    ("GET", "/queues/orders/messages", ""),
    ("PUT", "/orders/messages", ""),
    ("POST", "/queues/orders/messages", "Host: evil.example\r\n"),
]


async def _answer(port: int, raw: bytes) -> bytes:
    """The whole answer to `raw` on a new connection (the connection is closed after it:
    HTTP/1.0 and ``Connection: close`` answers close it; otherwise we read one answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(15):
            head, body = await read_answer(reader)
    finally:
        writer.close()
    return head + body


def _without_date(answer: bytes) -> bytes:
    return b"\r\n".join(
        line for line in answer.split(b"\r\n") if not line.lower().startswith(b"date:")
    )


@pytest.mark.integration
async def test_every_answer_is_the_same_with_and_without_the_short_cut(gateway: GatewayFactory):
    short = await gateway()
    general = await gateway(prepare=_general_path)
    for client, taken in ((short, True), (general, False)):
        assert client.server.runner is not None and client.server.runner.server is not None
        handler = client.server.runner.server.request_handler
        assert ("message_route_handler" in handler.__qualname__) is taken
    cases = [(m, t, x, "1.1") for m, t, x in _CASES] + [
        ("POST", "/queues/orders/messages", "", "1.0")
    ]
    for method, target, extra, version in cases:
        raw = _request(method, target, extra, version)
        got = _without_date(await _answer(short.server.port, raw))
        want = _without_date(await _answer(general.server.port, raw))
        assert got == want, (method, target, extra, version)
    # The short cut's answer is the whole 201, as the router's was.
    raw = _request("POST", "/queues/orders/messages")
    head, _, body = (await _answer(short.server.port, raw)).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 Created\r\n")
    assert orjson.loads(body) == {"messageIds": ["m-1"], "entity": "orders", "route": "primary"}


@pytest.mark.integration
async def test_expect_100_continue_is_still_answered_by_aiohttp(gateway: GatewayFactory):
    gw = await gateway()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    try:
        head = _request("POST", "/queues/orders/messages", "Expect: 100-continue\r\n")
        head = head[: -len(_BODY)]
        writer.write(head)
        async with asyncio.timeout(15):
            interim = await reader.readuntil(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            writer.write(_BODY)
            final = await reader.readuntil(b"\r\n\r\n")
        assert final.startswith(b"HTTP/1.1 201 ")
    finally:
        writer.close()
