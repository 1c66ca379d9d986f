"""HTTP edge: routes, the JSON error middleware and the message handlers.

Nothing here knows the Service Bus SDK: handlers parse the REST format into
`OutboundMessage`s and hand them to `gateway.ingest`, the send request every edge shares
(the `Router` found in the app state, the limits, the outcome's record).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp.web_request import BaseRequest

from gateway.auth import Right
from gateway.config import EntityKind, LimitSettings
from gateway.core.entities import EntityRef
from gateway.core.message import OutboundMessage, random_id
from gateway.core.ports import Tracer
from gateway.core.router import Router
from gateway.errors import (
    GatewayError,
    InvalidEntityPath,
    PayloadTooLarge,
    RequestError,
    UnsupportedMediaType,
)
from gateway.ingest import EdgeState, Lifecycle, Outcome, ingest
from gateway.logs import AccessLog
from gateway.tracing import request_properties
from gateway.web import rest
from gateway.web.auth import AUTHORIZER, PRINCIPAL, authorize
from gateway.web.fastpath import Answer, message_route_handler

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


EDGE = web.AppKey("edge", EdgeState)
REQUEST_ID = web.RequestKey("request_id", str)
ROUTER = web.AppKey("router", Router)


def json_response(status: int, body: object, headers: dict[str, str] | None = None) -> web.Response:
    # Content-Type as a header rather than `content_type=`: aiohttp then skips its parsing.
    fields = {"Content-Type": "application/json"}
    if headers:
        fields.update(headers)
    return web.Response(status=status, body=orjson.dumps(body), headers=fields)


def error_response(err: GatewayError, request_id: str | None = None) -> web.Response:
    """The JSON answer to `err`, with its own headers (Retry-After, WWW-Authenticate)."""
    headers = err.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return json_response(err.status, err.body(), headers)


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is sane, else a new one; the same for the request."""
    try:
        return request[REQUEST_ID]
    except KeyError:  # only outside the edge's frame, which assigns it first
        return _assign_request_id(request)


def _assign_request_id(request: web.Request) -> str:
    rid = request[REQUEST_ID] = _request_id(request)
    return rid


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is sane, else a new one (not stored: the send
    route passes it on itself)."""
    rid = request.headers.get("X-Request-Id") or ""
    if not rid or len(rid) > 128 or not rid.isascii() or not rid.isprintable():
        rid = random_id()
    return rid


# Set on every handler `edge` wraps; `functools.update_wrapper` (aiohttp's middleware chain)
# copies it onto the partials around it, so `edge_middleware` can tell.
_EDGED = "sbgate_edged"


def edge(handler: Handler) -> Handler:
    """`handler` inside the edge's frame, the work every answer needs (register every route
    through it: tests/gateway/test_edge_frame.py checks that each route is):

    * refuses raw paths the router would normalise (percent-encoding, dot segments);
    * in open mode, refuses a request for a host it does not serve (`EdgeState.host_check`);
    * turns every error into JSON ``{"error", "message"}`` (never a stack trace);
    * gives every answer an ``X-Request-Id``;
    * while draining, closes the connection after the answer (``Connection: close``), so
      the client's next request goes to another replica instead of racing our close.

    A frame per route rather than an aiohttp middleware: an app with no middleware at all
    skips aiohttp's middleware chain (a cache lookup, a partial and a frame of its own that
    sets the current app, on every request). The frame is `_in_edge` called directly (a
    partial, no coroutine of its own); the message route's is `_send_request`, the frame and
    the route in one coroutine. Where aiohttp may answer without any route of ours (a 404
    or 405 of an app with no catch-all route: the syphon's, the probe port's),
    `edge_middleware` does the same."""
    if handler is post_messages:
        return _send_request
    framed = functools.partial(_in_edge, handler=handler)
    setattr(framed, _EDGED, True)  # a plain attribute (partials have a __dict__)
    framed.__name__ = getattr(handler, "__name__", "edged")  # type: ignore[attr-defined]
    framed.__doc__ = handler.__doc__
    framed.__wrapped__ = handler  # type: ignore[attr-defined]  # as functools.wraps sets it
    return framed


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`edge`'s frame for what no route of ours answers (aiohttp's own 404 and 405, in an app
    without a catch-all route); a route registered through `edge` passes straight through."""
    if getattr(handler, _EDGED, False):
        return await handler(request)
    return await _in_edge(request, handler=handler)


async def _in_edge(request: web.Request, *, handler: Handler) -> web.StreamResponse:
    request_id = _assign_request_id(request)
    state = request.app[EDGE]
    started = time.perf_counter()
    try:
        _raw_path_ok(request.raw_path)
        if state.host_check is not None:
            state.host_check(request)
        response = await handler(request)
    except (GatewayError, web.HTTPException) as err:
        response = _error_answer(err)
    return _framed(request, state, response, request_id, started, logged=False)


async def _send_request(request: web.Request) -> web.StreamResponse:
    """The message route in the edge's frame, in one coroutine: `_in_edge` with
    `post_messages` inlined (the route answered on every send; the others are rare). Every
    answer `_send` builds carries the request id already, and the send wrote its own access
    line: of `_framed`, only the drain's ``Connection: close`` is left for them."""
    request_id = _request_id(request)
    app = request.app
    state = app[EDGE]
    started = time.perf_counter()
    logged = False  # a send request writes its own access line (gateway.ingest)
    try:
        _raw_path_ok(request.raw_path)
        if state.host_check is not None:
            state.host_check(request)
        logged = True
        response = await _send(request, app, state, request_id)
    except (GatewayError, web.HTTPException) as err:
        return _framed(request, state, _error_answer(err), request_id, started, logged)
    if state.lifecycle.draining:
        response.force_close()  # aiohttp then writes "Connection: close"
    return response


def _error_answer(err: GatewayError | web.HTTPException) -> web.Response:
    """Every error as JSON ``{"error", "message"}``; an HTTPException below 400 (a redirect)
    is not an error and goes on up."""
    if isinstance(err, GatewayError):
        return error_response(err)
    if err.status < 400:
        raise err
    code = err.reason.lower().replace(" ", "_")
    return json_response(
        err.status,
        {"error": code, "message": err.reason},
        {k: v for k, v in err.headers.items() if k.lower() == "allow"},
    )


def _framed(
    request: web.Request,
    state: EdgeState,
    response: web.StreamResponse,
    request_id: str,
    started: float,
    logged: bool,
) -> web.StreamResponse:
    """The answer's part of the frame: its request id, the drain's ``Connection: close``, the
    access line of a request that is no send (`logged`: the send wrote its own)."""
    if not response.prepared:
        headers = response.headers
        if "X-Request-Id" not in headers:
            headers["X-Request-Id"] = request_id
        if state.lifecycle.draining:
            response.force_close()  # aiohttp then writes "Connection: close"
    if not logged:
        _log_other(state.access_log, request, response.status, request_id, started)
    return response


# Answered often and by machines (kubelet, Prometheus): no access line when they succeed.
_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def _log_other(
    access_log: AccessLog, request: web.Request, status: int, request_id: str, started: float
) -> None:
    """The access line of a request that is no send: admin requests (with the rule name of
    the key that made them), refusals at the edge (400, 401, 405, 421, ...), the OpenAPI
    document; not a probe's or a scrape's success. INFO; a client error at
    `AccessLog.client_errors`; a 5xx at WARNING."""
    if status < 400 and request.path in _QUIET_PATHS:
        return
    level = logging.INFO
    if status >= 500:
        level = logging.WARNING
    elif status >= 400:
        level = access_log.client_errors
    if not access_log.enabled(level):
        return
    fields: dict[str, object] = {
        "request_id": request_id,
        "method": request.method,
        "path": request.path[:200],
        "status": status,
        "latency_ms": round((time.perf_counter() - started) * 1000, 3),
    }
    principal = request.get(PRINCIPAL)
    if principal is not None:
        fields["key_name"] = principal.key_name
    access_log.write(
        level, f"request {request_id} {request.method} {fields['path']} -> {status}", fields
    )


def _raw_path_ok(raw_path: str) -> None:
    """Refuse percent-encoding and dot segments before the router normalises them away."""
    path = raw_path.partition("?")[0]
    if "%" not in path and "//" not in path and "/." not in path and path[:1] != ".":
        # The common case in four substring searches, each in C: none of the rules below
        # can be broken without one of them (a dot segment starts after a "/", or the path
        # itself). A regex of the same rules costs several times as much: it tries every
        # alternative at every position of the path (issue #38, P1 counted in instructions).
        return
    if "%" in path:
        raise InvalidEntityPath("percent-encoded characters are not allowed in the path")
    for seg in path.split("/"):
        if seg in {".", ".."}:
            raise InvalidEntityPath("'.' and '..' segments are not allowed in the path")
    if "//" in path:
        raise InvalidEntityPath("empty path segments are not allowed")


def _buffered_body(request: web.Request, limit: int) -> bytes | None:
    """The body when it came whole with its head (the common case for a message), taken as
    buffered, without `read()`'s copy into a bytearray and back (the handler is the body's
    only reader); None when it is still arriving. Refuses a Content-Length over `limit`."""
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(
            f"the request body is {length} bytes; the limit is {limit}", size=length, limit=limit
        )
    content = request.content
    if not content.is_eof():
        return None
    body = content.read_nowait()
    if len(body) > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes", limit=limit)
    return body


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body still arriving (after `_buffered_body` said None), within `limit`."""
    try:
        body: bytes | None = await request.read()
    except web.HTTPRequestEntityTooLarge:
        body = None
    if body is None or len(body) > limit:  # chunked: no Content-Length to check first
        # The reader stops at the limit, so the body's whole size is not known.
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes", limit=limit)
    return body


async def post_messages(request: web.Request) -> web.StreamResponse:
    """POST /queues/{name}/messages, /topics/{name}/messages, /{name}/messages: one send
    request (gateway.ingest), answered as JSON. Registered through `edge`, it is served by
    `_send_request` (the frame and this, in one coroutine)."""
    app = request.app
    return await _send(request, app, app[EDGE], request_id_of(request))


setattr(_send_request, _EDGED, True)
_send_request.__wrapped__ = post_messages  # type: ignore[attr-defined]


def _open(_path: str) -> None:
    """The rights check of an app without SAS rules (open mode): nobody to name."""
    return None


async def _send(
    request: web.Request, app: web.Application, state: EdgeState, request_id: str
) -> web.StreamResponse:
    match_info = request.match_info
    authorize_send: Callable[[str], str | None] = _open
    if app.get(AUTHORIZER) is not None:

        def authorize_send(path: str) -> str | None:
            principal = authorize(request, path, Right.SEND)
            return None if principal is None else principal.key_name

    # `ingest` calls it with the entity: `_read_messages` itself, no coroutine around it.
    read = functools.partial(_read_messages, request, state.limits, state.tracer)
    done = await ingest(
        state,
        app[ROUTER],
        Outcome(request_id),
        match_info["name"],
        _KINDS.get(match_info.get("kind")),
        authorize_send,
        read,
    )
    delivery, messages, entity_path = done.result, done.messages, done.entity
    if isinstance(delivery, GatewayError):
        return error_response(delivery, request_id)
    if delivery.route == "primary":
        return _accepted(delivery.status, messages, entity_path, request_id)
    body: dict[str, object] = {
        "messageIds": [m.message_id for m in messages],
        "entity": entity_path,
        "route": delivery.route,
    }
    backlog = delivery.route == "backlog"
    if backlog:
        body["backlog"] = delivery.destination
    return json_response(
        delivery.status,
        body,
        {"X-Request-Id": request_id, "X-Route": delivery.destination if backlog else "primary"},
    )


# The 2xx answer's fixed parts: the body is {"messageIds": [...], "entity": ..., "route":
# "primary"}, byte for byte what `orjson.dumps` gives for that dict (the ids and the entity
# serialised by orjson, so escaped alike); the content type is set as a header, as in
# `json_response`.
_ACCEPTED_IDS = b'{"messageIds":'
_ACCEPTED_ENTITY = b',"entity":'
_ACCEPTED_ROUTE = b',"route":"primary"}'


def _accepted(status: int, messages: list[OutboundMessage], entity: str, request_id: str) -> Answer:
    """The answer to a request sent to the primary: the common case, built from templates."""
    body = b"".join(
        (
            _ACCEPTED_IDS,
            orjson.dumps([m.message_id for m in messages]),
            _ACCEPTED_ENTITY,
            orjson.dumps(entity),
            _ACCEPTED_ROUTE,
        )
    )
    return Answer(
        status,
        body,
        (("Content-Type", "application/json"), ("X-Request-Id", request_id), _PRIMARY_ROUTE),
    )


_PRIMARY_ROUTE = ("X-Route", "primary")


_KINDS: dict[str | None, EntityKind] = {"queues": "queue", "topics": "topic"}


async def _read_messages(
    request: web.Request, limits: LimitSettings, tracer: Tracer, _entity: EntityRef | None = None
) -> list[OutboundMessage]:
    """The request's messages in the REST format (one, or a JSON batch), within the limits,
    carrying the request's trace context (gateway.tracing). `_entity` (what `ingest` reads
    them for) does not change how they are read."""
    headers = request.headers
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in {"", "identity"}:
        raise UnsupportedMediaType(
            "compressed bodies (Content-Encoding) are not supported; send it uncompressed"
        )
    body = _buffered_body(request, limits.max_body_bytes)
    if body is None:
        body = await _read_body(request, limits.max_body_bytes)
    content_type = headers.get("Content-Type")
    context = request_properties(headers, tracer)
    if (content_type or "").split(";")[0].strip().lower() == rest.BATCH_CONTENT_TYPE:
        messages = rest.parse_batch(
            body, headers.get("Idempotency-Key"), limits.max_batch_messages, context
        )
    else:
        messages = [
            rest.parse_single(
                body,
                content_type,
                rest.copied_headers(request.raw_headers),
                headers.get("BrokerProperties"),
                headers.get("Idempotency-Key"),
                context,
            )
        ]
    return messages  # sized by `ingest`


async def healthz(request: web.Request) -> web.StreamResponse:
    """Liveness: the process answers."""
    return json_response(200, {"status": "ok"})


async def readyz(request: web.Request) -> web.StreamResponse:
    """Readiness: started, clients connected, not draining."""
    reason = request.app[EDGE].lifecycle.not_ready_reason()
    if reason is None:
        return json_response(200, {"status": "ready"})
    return json_response(503, {"status": reason}, {"Retry-After": "1"})


def add_health_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", edge(healthz))
    app.router.add_get("/readyz", edge(readyz))


# Service Bus treats the `messages` segment case-insensitively (the legacy Node.js client
# sends `/Messages`); entity names are matched case-insensitively by the catalog.
_MESSAGES = "{messages:(?i:messages)}"
_HEAD = "{head:(?i:head)}"

# The Service Bus REST operations this gateway does not serve, by path shape and method.
_RECEIVE_OPERATIONS = {"POST": "peek-lock", "DELETE": "receive-and-delete"}
_LOCK_OPERATIONS = {"DELETE": "complete", "PUT": "unlock", "POST": "renew-lock"}
_ENTITY_OPERATIONS = {"GET": "get-entity", "HEAD": "get-entity", "PUT": "create-or-update-entity"}
_ENTITY_OPERATIONS["DELETE"] = "delete-entity"


async def not_ingestion(request: web.Request) -> web.StreamResponse:
    """405 for the Service Bus REST operations other than sending (receive, peek-lock, lock
    operations, entity management) and for any other method or path: this gateway only
    ingests. ``Allow`` lists the methods the gateway's own routes accept on this path (empty
    for a path it serves nothing on)."""
    segments = [s.lower() for s in request.path.strip("/").split("/")]
    method = request.method
    if len(segments) > 2 and segments[-2:] == ["messages", "head"]:
        operation = _RECEIVE_OPERATIONS.get(method, "unsupported")
    elif len(segments) > 3 and segments[-3] == "messages":
        operation = _LOCK_OPERATIONS.get(method, "unsupported")
    elif len(segments) > 1 and segments[-1] == "messages":
        operation = "unsupported"
    else:
        operation = _ENTITY_OPERATIONS.get(method, "unsupported")
    allow = await _allowed_methods(request)
    message = (
        "this gateway only ingests messages: send them with POST "
        "/{entity}/messages; receive, peek-lock, lock and management operations go to "
        "the Service Bus namespace itself"
    )
    if segments[0] in _OWN_PATHS:
        operation, message = "unsupported", _own_path_message(request.method, allow)
    return json_response(
        405,
        {"error": "method_not_allowed", "operation": operation, "message": message},
        {"Allow": allow},
    )


# The gateway's own paths (and `/`): a wrong method there is no Service Bus operation, and
# the answer must not read as if the gateway forwarded its admin API to the namespace.
_OWN_PATHS = frozenset({"", "admin", "healthz", "readyz", "metrics", "openapi.json"})


def _own_path_message(method: str, allow: str) -> str:
    where = f"only {allow} here" if allow else "no method here"
    return (
        f"{method} is not served on this path of the gateway ({where}); this gateway only "
        "ingests messages (POST /{entity}/messages) and serves its own admin API "
        "(GET /admin/entities, POST /admin/entities/{entity}/healthy or /failover); "
        "GET /openapi.json lists every route"
    )


async def _allowed_methods(request: web.Request) -> str:
    """The methods the app's other routes accept on this path, as an ``Allow`` value."""
    methods: set[str] = set()
    for resource in request.app.router.resources():
        if any(route.handler in (_REFUSE, _NOT_FOUND) for route in resource):
            continue
        _match, allowed = await resource.resolve(request)
        methods |= allowed
    return ", ".join(sorted(methods))


def request_handler(
    app: web.Application, general: Callable[[BaseRequest], Awaitable[web.StreamResponse]]
) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """The request handler to serve `app` with: aiohttp's (`general`), with the short cut to
    the message route in front where it is exact (`gateway.web.fastpath`)."""
    return message_route_handler(app, _send_request, general)


def add_routes(app: web.Application) -> None:
    """The message routes, then the 405 answers for the rest of the REST API (registered
    last: aiohttp tries resources in order)."""
    add_health_routes(app)
    message_route = edge(post_messages)
    app.router.add_post(f"/{{kind:queues|topics}}/{{name:.+}}/{_MESSAGES}", message_route)
    app.router.add_post(f"/{{name:.+}}/{_MESSAGES}", message_route)


async def not_found(request: web.Request) -> web.StreamResponse:
    """404 for a path no other route matches: one with a line feed in it (``.`` in the
    catch-all's pattern does not match one). aiohttp would answer it itself, outside any
    route's edge frame; this answers the same inside it (JSON, ``X-Request-Id``)."""
    raise web.HTTPNotFound()


_REFUSE = edge(not_ingestion)
_NOT_FOUND = edge(not_found)


def add_not_ingestion_routes(app: web.Application) -> None:
    """Call after every other route: catches every remaining method and path."""
    app.router.add_route("*", f"/{{name:.+}}/{_MESSAGES}/{_HEAD}", _REFUSE)
    app.router.add_route("*", f"/{{name:.+}}/{_MESSAGES}/{{id}}/{{lock}}", _REFUSE)
    app.router.add_route("*", "/{name:.*}", _REFUSE)
    app.router.add_route("*", r"/{name:[\s\S]*}", _NOT_FOUND)


__all__ = [
    "EDGE",
    "ROUTER",
    "EdgeState",
    "Lifecycle",
    "RequestError",
    "add_not_ingestion_routes",
    "add_routes",
    "edge",
    "edge_middleware",
]
