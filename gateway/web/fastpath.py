"""The send request's short cuts through aiohttp's general machinery (issue #38, P1).

Two, each taken only where it gives exactly what the general path gives:

* `message_route_handler`: the main app's request handler. A ``POST`` to
  ``/queues/{name}/messages``, ``/topics/{name}/messages`` or ``/{name}/messages`` (a name of
  one plain segment, no query oddities, no ``Expect``) goes straight to the message route:
  one precompiled match instead of aiohttp's router walk (`UrlDispatcher.resolve`, a
  coroutine per candidate resource) and `Application._handle`. The request gets the same
  match info (`UrlMappingMatchInfo` of the same route, with the same values, the app added
  and frozen), so whoever reads ``request.match_info`` or ``request.app`` sees no
  difference. Everything else goes to aiohttp's handler as before (404 and 405 answers,
  ``Expect: 100-continue``, percent-encoded or dot-segment paths, the other routes). It is
  installed only when the router would choose the same route for every path it takes: the
  app has no middleware (tracing on adds one), only plain and dynamic resources, the message
  routes before any other resource indexed at ``/``, and a path whose first segment
  another resource is indexed under (``/admin``, ``/healthz``, ...) is left to the router.
* `Answer`: a `web.Response` with a bytes body that, when nothing asks for aiohttp's general
  preparation (HTTP/1.1, no cookies, no compression, no ``on_response_prepare`` signal),
  writes its head and body in one go: the same header fields aiohttp adds (Content-Length,
  Date, Server, ``Connection: close`` when the connection is not kept alive), serialised by
  aiohttp's writer, without the chain of coroutines `StreamResponse.prepare` and
  `Response.write_eof` run per answer.

**aiohttp's private names used here** (guarded by tests/security/test_aiohttp_privates.py):
`BaseRequest`'s ``_match_info`` (set as `Application._handle` sets it; its ``_apps`` read
as `Request._prepare_hook` reads them) and ``_payload_writer``; `StreamResponse`'s
``_keep_alive``, ``_body``, ``_status``, ``_reason``, ``_req``, ``_payload_writer``,
``_eof_sent``, ``_body_length``, ``_cookies``, ``_compression``, ``_must_be_empty_body``,
and `Response`'s ``_zlib_executor_size`` and ``_zlib_executor``, as its ``__init__``,
``prepare``, ``_start``, ``_prepare_headers``, ``_write_headers`` and ``write_eof`` use
them.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import hdrs, web, web_response
from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import MAX_SYNC_CHUNK_SIZE
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_writer import HttpVersion11
from aiohttp.web_request import BaseRequest
from aiohttp.web_urldispatcher import DynamicResource, PlainResource, UrlMappingMatchInfo
from multidict import CIMultiDict

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The message routes' paths with a name of one segment: what aiohttp's patterns
# (``/{kind:queues|topics}/{name:.+}/{messages:(?i:messages)}`` and
# ``/{name:.+}/{messages:(?i:messages)}``) match on such a path, group for group. A name of
# unreserved characters only (no "%": the router would decode it; not "." or "..": it would
# remove the segment), an optional query.
_MESSAGE_PATH = re.compile(
    r"/(?:(queues|topics)/)?(?!\.\.?/)([\w.\-~]+)/((?i:messages))(?:\?[^#]*)?", re.ASCII
)


def _index_key(resource: web.AbstractResource) -> str:
    """The key aiohttp's router indexes `resource` under (`UrlDispatcher.index_resource`)."""
    key = resource.canonical
    if "{" in key:
        key = key.partition("{")[0].rpartition("/")[0]
    return key.rstrip("/") or "/"


def message_route_handler(
    app: web.Application,
    handler: Handler,
    general: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """`general` (aiohttp's request handler for `app`) with the short cut to the message
    route `handler` in front; `general` itself where the short cut would not be exact."""
    kind_route = name_route = None
    reserved: set[str] = set()
    for resource in app.router.resources():
        if not isinstance(resource, PlainResource | DynamicResource):
            return general  # a static or sub-app resource: the router's own rules
        routes = [r for r in resource if r.handler is handler and r.method == hdrs.METH_POST]
        key = _index_key(resource)
        if routes and "{kind" in resource.canonical and kind_route is None:
            kind_route = routes[0]
        elif routes and kind_route is not None and name_route is None:
            name_route = routes[0]
        elif key != "/":
            reserved.add(key.strip("/").split("/", 1)[0])
        elif name_route is None:
            return general  # tried before the message routes at "/"
    if app.middlewares or kind_route is None or name_route is None:
        return general
    frozen_reserved = frozenset(reserved)

    def handle(request: BaseRequest) -> Awaitable[web.StreamResponse]:
        # The route's coroutine itself, for aiohttp's `_handle_request` to await: no frame of
        # its own around it, which every suspension and resumption would pass through.
        if request.method == hdrs.METH_POST:
            match = _MESSAGE_PATH.fullmatch(request.raw_path)
            if match is not None and not request.headers.get(hdrs.EXPECT):
                kind, name, messages = match.groups()
                if (kind or name) not in frozen_reserved:
                    if kind is None:
                        info = UrlMappingMatchInfo({"name": name, "messages": messages}, name_route)
                    else:
                        info = UrlMappingMatchInfo(
                            {"kind": kind, "name": name, "messages": messages}, kind_route
                        )
                    info.add_app(app)
                    info.freeze()
                    request._match_info = info  # type: ignore[attr-defined]
                    return handler(request)  # type: ignore[arg-type]
        return general(request)

    return handle


class Answer(web.Response):
    """`web.Response` with a bytes body, written in one go where aiohttp's general
    preparation would add nothing (see the module docstring)."""

    def __init__(self, status: int, body: bytes, headers: Iterable[tuple[str, str]]) -> None:
        # What `web.Response.__init__` leaves for a bytes body and a Content-Type header,
        # without its checks of the other arguments.
        web.StreamResponse.__init__(self, status=status, _real_headers=CIMultiDict(headers))
        self._body = body
        self._zlib_executor_size = MAX_SYNC_CHUNK_SIZE
        self._zlib_executor = None

    async def prepare(self, request: BaseRequest) -> AbstractStreamWriter | None:
        if (
            self._payload_writer is not None
            or self._eof_sent
            or self._cookies
            or self._compression
            or request.version != HttpVersion11
            or request.method == hdrs.METH_HEAD
            or self._status < 200
            or self._status in (204, 304)
            or _prepare_signals(request)
        ):
            return await super().prepare(request)
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = self._keep_alive = request.keep_alive
        body = self._body
        assert isinstance(body, bytes)
        headers = self._headers
        headers[hdrs.CONTENT_LENGTH] = str(len(body))
        if hdrs.DATE not in headers:
            headers[hdrs.DATE] = rfc822_formatted_time()
        if hdrs.SERVER not in headers:
            headers[hdrs.SERVER] = web_response.SERVER_SOFTWARE  # type: ignore[attr-defined]
        if not keep_alive and hdrs.CONNECTION not in headers:
            headers[hdrs.CONNECTION] = "close"
        writer = request._payload_writer  # type: ignore[attr-defined]
        self._req = request
        self._payload_writer = writer
        self._must_be_empty_body = False
        writer.length = len(body)
        await writer.write_headers(f"HTTP/1.1 {self._status} {self._reason}", headers)
        await writer.write_eof(body)
        self._eof_sent = True
        self._req = None
        self._body_length = writer.output_size
        self._payload_writer = None
        return writer


def _prepare_signals(request: BaseRequest) -> bool:
    """Some app of the request has an ``on_response_prepare`` signal to send (as
    `Request._prepare_hook` reads them)."""
    match_info = getattr(request, "_match_info", None)
    if match_info is not None:
        for app in match_info._apps:
            if app.on_response_prepare:
                return True
    return False
