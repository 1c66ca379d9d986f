"""HTTP edge: routes, the JSON error middleware and the message handlers.

Nothing here knows the Service Bus SDK: handlers parse the REST format into
`OutboundMessage`s and hand them to the `Router` found in the app state.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.auth import AuthError, Right
from gateway.config import EntityKind, LimitSettings
from gateway.core.entities import EntityCatalog, EntityRef, validate_entity_path
from gateway.core.message import OutboundMessage, batch_size
from gateway.core.ports import Tracer
from gateway.core.router import Delivery, Router
from gateway.errors import (
    GatewayError,
    InvalidEntityPath,
    PayloadTooLarge,
    RequestError,
    Saturated,
    SendFailure,
    UnsupportedMediaType,
)
from gateway.ledger import EventLedger, NullLedger
from gateway.logs import AccessLog
from gateway.tracing import log_ids, request_properties
from gateway.web import rest
from gateway.web.auth import authorize
from gateway.web.observer import EdgeObserver

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Lifecycle:
    """Readiness as `/readyz` reports it. `checks` return a reason when not ready."""

    started: bool = False
    draining: bool = False
    checks: list[Callable[[], str | None]] = field(default_factory=list)

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.started:
            return "starting"
        for check in self.checks:
            reason = check()
            if reason:
                return reason
        return None

    @property
    def ready(self) -> bool:
        return self.not_ready_reason() is None


@dataclass(frozen=True, slots=True)
class EdgeState:
    """What the handlers need, stored once in the app."""

    catalog: EntityCatalog
    limits: LimitSettings
    observer: EdgeObserver  # the metrics, in the app (gateway.metrics implements it)
    lifecycle: Lifecycle
    ledger: EventLedger = field(default_factory=NullLedger)
    access_log: AccessLog = field(default_factory=AccessLog)
    tracer: Tracer = field(default_factory=Tracer)  # off: the no-op one
    # Open mode's Host check (gateway.web.hosts.host_check), run by `edge_middleware`.
    host_check: Callable[[web.Request], None] | None = None


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
    except KeyError:  # only without the edge middleware, which assigns it first
        return _assign_request_id(request)


def _assign_request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-Id") or ""
    if not rid or len(rid) > 128 or not rid.isascii() or not rid.isprintable():
        rid = os.urandom(16).hex()  # as uuid4().hex, at a quarter of the cost
    request[REQUEST_ID] = rid
    return rid


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one middleware every answer passes through (one, because each costs per request):

    * refuses raw paths the router would normalise (percent-encoding, dot segments);
    * in open mode, refuses a request for a host it does not serve (`EdgeState.host_check`);
    * turns every error into JSON ``{"error", "message"}`` (never a stack trace);
    * gives every answer an ``X-Request-Id``;
    * while draining, closes the connection after the answer (``Connection: close``), so
      the client's next request goes to another replica instead of racing our close.
    """
    request_id = _assign_request_id(request)
    edge = request.app[EDGE]
    try:
        _raw_path_ok(request.raw_path)
        if edge.host_check is not None:
            edge.host_check(request)
        response = await handler(request)
    except GatewayError as err:
        response = error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        response = json_response(
            exc.status,
            {"error": code, "message": exc.reason},
            {k: v for k, v in exc.headers.items() if k.lower() == "allow"},
        )
    if not response.prepared:
        headers = response.headers
        if "X-Request-Id" not in headers:
            headers["X-Request-Id"] = request_id
        if edge.lifecycle.draining:
            response.force_close()  # aiohttp then writes "Connection: close"
    return response


def _raw_path_ok(raw_path: str) -> None:
    """Refuse percent-encoding and dot segments before the router normalises them away."""
    path = raw_path.split("?", 1)[0]
    if "%" in path:
        raise InvalidEntityPath("percent-encoded characters are not allowed in the path")
    for seg in path.split("/"):
        if seg in {".", ".."}:
            raise InvalidEntityPath("'.' and '..' segments are not allowed in the path")
    if "//" in path:
        raise InvalidEntityPath("empty path segments are not allowed")


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit}")
    content = request.content
    try:
        # A body that came whole with its head (the common case for a message) is taken as
        # buffered, without `read()`'s copy into a bytearray and back; the handler is the
        # body's only reader.
        body: bytes | None = content.read_nowait() if content.is_eof() else await request.read()
    except web.HTTPRequestEntityTooLarge:
        body = None
    if body is None or len(body) > limit:  # chunked: no Content-Length to check first
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    return body


def _check_sizes(messages: list[OutboundMessage], limits: LimitSettings) -> None:
    """Each message, and the request as one broker send, within the limits. `size` and
    `batch_size` are upper bounds of the encoding (gateway/core/message.py), so what passes
    here fits the link as far as the settings match the entity's real limit."""
    for m in messages:
        size = m.size
        if size > limits.max_message_bytes:
            raise PayloadTooLarge(
                f"message {m.message_id!r} is {size} bytes with its properties; "
                f"the limit is {limits.max_message_bytes}",
                messageId=m.message_id,
                size=size,
                limit=limits.max_message_bytes,
            )
    total = batch_size(messages)
    if total > limits.max_batch_bytes:
        raise PayloadTooLarge(
            f"the batch is {total} bytes with its properties; "
            f"the limit is {limits.max_batch_bytes}",
            size=total,
            limit=limits.max_batch_bytes,
        )


async def post_messages(request: web.Request) -> web.StreamResponse:
    """POST /queues/{name}/messages, /topics/{name}/messages, /{name}/messages.

    Every refusal is a `GatewayError` raised before anything is sent (bad path, auth, unknown
    entity, bad body, limits) or by the router (saturated, send failed); the outcome, either
    way, is recorded once (`_record_outcome`)."""
    app = request.app
    state = app[EDGE]
    started = time.perf_counter()
    request_id = request_id_of(request)
    entity_path = "_unknown"
    messages: list[OutboundMessage] = []
    outcome = _Outcome(request_id)
    try:
        entity = _addressed_entity(request, state.catalog, outcome)
        entity_path = entity.path
        messages = await _read_messages(request, state.limits, state.tracer)
        delivery = await app[ROUTER].submit(entity, messages)
    except GatewayError as err:
        _record_outcome(outcome, state, started, entity_path, messages, err)
        return error_response(err, request_id)
    _record_outcome(outcome, state, started, entity_path, messages, delivery)
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


@dataclass(slots=True)
class _Outcome:
    """What a send request's access line names besides its result."""

    request_id: str
    key_name: str | None = None  # the SAS rule that authorized it


# The 2xx answer's fixed parts: the body is {"messageIds": [...], "entity": ..., "route":
# "primary"}, byte for byte what `orjson.dumps` gives for that dict (the ids and the entity
# serialised by orjson, so escaped alike); the content type is set as a header, as in
# `json_response`.
_ACCEPTED_IDS = b'{"messageIds":'
_ACCEPTED_ENTITY = b',"entity":'
_ACCEPTED_ROUTE = b',"route":"primary"}'


def _accepted(
    status: int, messages: list[OutboundMessage], entity: str, request_id: str
) -> web.Response:
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
    headers = CIMultiDict(
        (("Content-Type", "application/json"), ("X-Request-Id", request_id), _PRIMARY_ROUTE)
    )
    return web.Response(status=status, body=body, headers=headers)


_PRIMARY_ROUTE = ("X-Route", "primary")


_KINDS: dict[str | None, EntityKind] = {"queues": "queue", "topics": "topic"}


def _addressed_entity(request: web.Request, catalog: EntityCatalog, outcome: _Outcome) -> EntityRef:
    """The declared entity the request sends to, once the caller may send to it."""
    match_info = request.match_info
    name = match_info["name"]
    kind = _KINDS.get(match_info.get("kind"))
    found = catalog.find(name, kind)
    if found is None:
        validate_entity_path(name)  # 400 before 401: a bad path names no resource
    principal = authorize(request, name, Right.SEND)  # 401/403 before 404: don't reveal
    if principal is not None:
        outcome.key_name = principal.key_name
    if found is None:
        raise catalog.unknown(name, kind)
    return found


async def _read_messages(
    request: web.Request, limits: LimitSettings, tracer: Tracer
) -> list[OutboundMessage]:
    """The request's messages in the REST format (one, or a JSON batch), within the limits,
    carrying the request's trace context (gateway.tracing)."""
    headers = request.headers
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in {"", "identity"}:
        raise UnsupportedMediaType(
            "compressed bodies (Content-Encoding) are not supported; send it uncompressed"
        )
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
    _check_sizes(messages, limits)
    return messages


def _record_outcome(
    outcome: _Outcome,
    state: EdgeState,
    started: float,
    entity: str,
    messages: list[OutboundMessage],
    result: Delivery | GatewayError,
) -> None:
    """Metrics, ledger events and the one log line of a send request, whatever its outcome.

    `entity` is ``_unknown`` until the path named a declared entity; `messages` is empty
    until the body parsed within the limits (nothing to put in the ledger before that)."""
    elapsed = time.perf_counter() - started
    observer = state.observer
    if isinstance(result, GatewayError):
        status, route, error = result.status, "none", result
        if isinstance(result, Saturated):
            observer.admission_refused()
    else:
        status, route, error = result.status, result.route, None
        observer.messages_accepted(entity, route, len(messages))
    if messages and state.ledger.enabled:
        _emit_ledger(state.ledger, entity, messages, result, elapsed)
    observer.request_answered(entity, status, route, elapsed)
    _log_outcome(state.access_log, outcome, entity, status, route, messages, elapsed, error)


def _emit_ledger(
    ledger: EventLedger,
    entity: str,
    messages: list[OutboundMessage],
    result: Delivery | GatewayError,
    elapsed: float,
) -> None:
    """One ``accepted`` or ``rejected`` event per message (read by the audit pipeline)."""
    latency_ms = elapsed * 1000
    if isinstance(result, GatewayError):
        for m in messages:
            ledger.emit(
                "rejected",
                message_id=m.message_id,
                entity=entity,
                latency_ms=latency_ms,
                status=result.status,
                error=result.code,
            )
        return
    backlog = result.destination if result.route == "backlog" else None
    for m in messages:
        ledger.emit(
            "accepted",
            message_id=m.message_id,
            entity=entity,
            route=result.route,
            backlog=backlog,
            size=m.size,
            latency_ms=latency_ms,
            session_id=m.session_id,  # the audit checks per-session order (docs/pipeline.md)
        )


def _log_outcome(
    access_log: AccessLog,
    outcome: _Outcome,
    entity: str,
    status: int,
    route: str,
    messages: list[OutboundMessage],
    elapsed: float,
    error: GatewayError | None,
) -> None:
    """The request's access line: INFO, or WARNING when the broker failed or the gateway was
    saturated (`SBGATE_LOG_LEVEL=WARNING` keeps only those)."""
    level = logging.INFO
    if error is not None and isinstance(error, SendFailure | Saturated):
        level = logging.WARNING
    if not access_log.enabled(level):
        return
    request_id = outcome.request_id
    extra: dict[str, object] = {
        "request_id": request_id,
        "entity": entity,
        "status": status,
        "route": route,
        "message_ids": [m.message_id for m in messages[:20]],
        "messages": len(messages),
        "latency_ms": round(elapsed * 1000, 3),
    }
    if outcome.key_name is not None:
        extra["key_name"] = outcome.key_name
    elif isinstance(error, AuthError) and error.key_name is not None:
        extra["key_name"] = error.key_name  # the log may say which rule; the answer never does
    if error is not None:
        extra["error"] = error.code
        extra["error_message"] = error.message
    access_log.write(level, f"request {request_id} -> {status}", extra, log_ids())  # + trace ids


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
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


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
    return json_response(
        405,
        {
            "error": "method_not_allowed",
            "operation": operation,
            "message": "this gateway only ingests messages: send them with POST "
            "/{entity}/messages; receive, peek-lock, lock and management operations go to "
            "the Service Bus namespace itself",
        },
        {"Allow": allow},
    )


async def _allowed_methods(request: web.Request) -> str:
    """The methods the app's other routes accept on this path, as an ``Allow`` value."""
    methods: set[str] = set()
    for resource in request.app.router.resources():
        if any(route.handler is not_ingestion for route in resource):
            continue
        _match, allowed = await resource.resolve(request)
        methods |= allowed
    return ", ".join(sorted(methods))


def add_routes(app: web.Application) -> None:
    """The message routes, then the 405 answers for the rest of the REST API (registered
    last: aiohttp tries resources in order)."""
    add_health_routes(app)
    app.router.add_post(f"/{{kind:queues|topics}}/{{name:.+}}/{_MESSAGES}", post_messages)
    app.router.add_post(f"/{{name:.+}}/{_MESSAGES}", post_messages)


def add_not_ingestion_routes(app: web.Application) -> None:
    """Call after every other route: catches every remaining method and path."""
    app.router.add_route("*", f"/{{name:.+}}/{_MESSAGES}/{_HEAD}", not_ingestion)
    app.router.add_route("*", f"/{{name:.+}}/{_MESSAGES}/{{id}}/{{lock}}", not_ingestion)
    app.router.add_route("*", "/{name:.*}", not_ingestion)


__all__ = [
    "EDGE",
    "ROUTER",
    "EdgeState",
    "Lifecycle",
    "RequestError",
    "add_not_ingestion_routes",
    "add_routes",
    "edge_middleware",
]
