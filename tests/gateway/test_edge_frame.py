"""Every route is registered inside the edge's frame (`handlers.edge`: request id, path
guard, Host check, errors as JSON, drain), so that the serving app needs no aiohttp
middleware; the apps where aiohttp may answer by itself (the syphon's, the probe port's)
keep the edge middleware for that. A route added without `edge` fails here."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from gateway.web.handlers import edge, edge_middleware
from gateway.web.probes import probe_app
from tests.conftest import GatewayFactory
from tests.gateway.test_app import Journal, build
from tests.support.http import exchange


def _unframed(app: web.Application) -> list[str]:
    return [
        f"{route.method} {route.resource.canonical if route.resource else '?'}"
        for route in app.router.routes()
        if not getattr(route.handler, "sbgate_edged", False)
    ]


@pytest.mark.unit
def test_every_route_of_the_serving_app_is_in_the_edge_frame_and_there_is_no_middleware():
    app = build({}, Journal())
    assert len(list(app.router.routes())) > 8
    assert _unframed(app) == []
    assert list(app.middlewares) == []  # tracing off: aiohttp skips its middleware chain


@pytest.mark.unit
def test_the_syphons_app_and_the_probe_port_keep_the_middleware_for_aiohttps_own_answers():
    syphon = build({}, Journal(), mode="syphon")
    assert _unframed(syphon) == []
    assert list(syphon.middlewares) == [edge_middleware]
    probes = probe_app(build({}, Journal()))
    assert _unframed(probes) == []
    assert list(probes.middlewares) == [edge_middleware]


@pytest.mark.unit
def test_the_frame_keeps_the_handlers_name_and_the_handler_itself():
    async def list_things(request: web.Request) -> web.StreamResponse:
        """Doc."""
        return web.Response()

    framed = edge(list_things)
    assert framed.__name__ == "list_things" and framed.__doc__ == "Doc."
    assert framed.__wrapped__ is list_things  # type: ignore[attr-defined]


def _refusal(raw_path: str) -> str | None:
    """What the path guard says of `raw_path`, as its rules read one by one."""
    path = raw_path.split("?", 1)[0]
    if "%" in path:
        return "percent-encoded characters are not allowed in the path"
    if any(seg in {".", ".."} for seg in path.split("/")):
        return "'.' and '..' segments are not allowed in the path"
    if "//" in path:
        return "empty path segments are not allowed"
    return None


@pytest.mark.unit
def test_the_path_guards_screen_lets_through_exactly_what_its_rules_do():
    """`_raw_path_ok` screens a path with four substring searches and reads the rules only
    for a suspect one: every path of up to six pieces gets the same answer as the rules
    alone."""
    from itertools import product

    from gateway.errors import InvalidEntityPath
    from gateway.web.handlers import _raw_path_ok

    for n in range(1, 7):
        for pieces in product(["/", ".", "..", "%", "a", "?"], repeat=n):
            path = "".join(pieces)
            try:
                _raw_path_ok(path)
                said = None
            except InvalidEntityPath as err:
                said = err.message
            assert said == _refusal(path), path


@pytest.mark.integration
@pytest.mark.parametrize(
    ("method", "target"),
    [("POST", "/queues/a%0Ab/messages"), ("GET", "/x%0A"), ("DELETE", "/%0A/%0A")],
)
async def test_a_path_no_route_matches_is_still_answered_inside_the_edge_frame(
    gateway: GatewayFactory, method: str, target: str
):
    """A line feed in the decoded path matches none of the catch-all's ``.``s: aiohttp would
    answer 404 in plain text, outside every route. The path guard refuses it first, as JSON
    with a request id, as it did when the frame was a middleware."""
    gw = await gateway()
    raw = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    status, headers, body = await exchange(gw.server.port, raw.encode())
    assert status == 400, body
    assert headers["content-type"] == "application/json" and headers["x-request-id"]
    answer = orjson.loads(body)
    assert answer["error"] == "invalid_entity_path" and "percent-encoded" in answer["message"]
