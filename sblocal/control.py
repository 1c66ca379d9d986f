"""The control API: plain HTTP + JSON, for tests and people (fault injection and inspection).

Every endpoint is documented in docs/sblocal.md. Handlers run on the asyncio loop; namespace
state is read under the namespace lock, and anything that touches proton objects (down, up,
drop-connections) is sent to the reactor thread through `AmqpServer.call`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import errno
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sblocal import codec
from sblocal.entities import (
    EntityExistsError,
    EntityNotFoundError,
    QueueProperties,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.faults import FaultSpecError
from sblocal.store import Entity, MessageState, StoredMessage, Topic

if TYPE_CHECKING:
    from sblocal.amqp import NamespaceRuntime
    from sblocal.server import LocalBroker

BROKER_KEY: web.AppKey[LocalBroker] = web.AppKey("broker")
_REACTOR_TIMEOUT = 10.0


def _runtime(request: web.Request) -> NamespaceRuntime:
    broker = request.app[BROKER_KEY]
    name = request.match_info["ns"]
    try:
        return broker.runtime(name)
    except KeyError:
        raise web.HTTPNotFound(
            text=f'{{"error": "no namespace {name!r}"}}', content_type="application/json"
        ) from None


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise _bad_request("the body is not JSON") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=_dumps({"error": message}), content_type="application/json")


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


_UP_ATTEMPTS = 60  # x 50 ms: up to 3 s for the old listener to close


async def _on_reactor(request: web.Request, fut: Any) -> Any:
    async with asyncio.timeout(_REACTOR_TIMEOUT):
        return await asyncio.wrap_future(fut)


# -- handlers ------------------------------------------------------------------------------


async def get_namespaces(request: web.Request) -> web.Response:
    return _json(request.app[BROKER_KEY].info)


async def add_fault(request: web.Request) -> web.Response:
    rt = _runtime(request)
    body = await _json_body(request)
    try:
        rule = rt.faults.add(body)
    except FaultSpecError as exc:
        raise _bad_request(str(exc)) from None
    return _json(rule.as_json(), status=201)


async def list_faults(request: web.Request) -> web.Response:
    return _json(_runtime(request).faults.list())


async def clear_faults(request: web.Request) -> web.Response:
    _runtime(request).faults.clear()
    return _json({"cleared": True})


async def delete_fault(request: web.Request) -> web.Response:
    rt = _runtime(request)
    try:
        rule_id = int(request.match_info["id"])
    except ValueError:
        raise _bad_request("fault ids are integers") from None
    if not rt.faults.remove(rule_id):
        raise web.HTTPNotFound(
            text=_dumps({"error": "no such fault"}), content_type="application/json"
        )
    return _json({"deleted": rule_id})


async def put_latency(request: web.Request) -> web.Response:
    rt = _runtime(request)
    body = await _json_body(request)
    values = {}
    for key in ("round_trip_ms", "store_ms"):
        value = body.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise _bad_request(f"{key} must be a non-negative number")
        values[key] = float(value)
    # Two float stores: the reactor reads them per send; no lock needed for a torn read of
    # independent test knobs.
    rt.latency.round_trip_ms = values["round_trip_ms"]
    rt.latency.store_ms = values["store_ms"]
    return _json(values)


async def get_latency(request: web.Request) -> web.Response:
    rt = _runtime(request)
    return _json({"round_trip_ms": rt.latency.round_trip_ms, "store_ms": rt.latency.store_ms})


async def drop_connections(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    rt = _runtime(request)
    dropped = await _on_reactor(request, broker.amqp.drop_connections(rt.name))
    return _json({"dropped": dropped})


async def get_connections(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    rt = _runtime(request)
    return _json(await _on_reactor(request, broker.amqp.census(rt.name)))


async def namespace_down(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    rt = _runtime(request)
    await _on_reactor(request, broker.amqp.down(rt.name))
    return _json({"namespace": rt.name, "up": False, "amqp_port": rt.port})


async def namespace_up(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    rt = _runtime(request)
    # proton closes the old listening socket on a later reactor turn, so an `up` right
    # after a `down` can find the port still bound: retry briefly, waiting here (not on the
    # reactor, which must stay free to finish that close).
    for attempt in range(_UP_ATTEMPTS):
        try:
            await _on_reactor(request, broker.amqp.up(rt.name))
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == _UP_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.05)
    return _json({"namespace": rt.name, "up": True, "amqp_port": rt.port})


async def list_entities(request: web.Request) -> web.Response:
    ns = _runtime(request).namespace
    out = []
    for entity in ns.all_entities():
        info = ns.describe(entity)
        out.append(info)
        if isinstance(entity, Entity) and entity.dlq is not None:
            out.append(ns.describe(entity.dlq))
    return _json(out)


def _find_entity(request: web.Request) -> Entity | Topic:
    ns = _runtime(request).namespace
    path = request.match_info["path"]
    entity = ns.entity(path)
    if entity is None:
        raise web.HTTPNotFound(
            text=_dumps({"error": f"no entity {path!r} in {ns.name}"}),
            content_type="application/json",
        )
    return entity


async def get_entity(request: web.Request) -> web.Response:
    ns = _runtime(request).namespace
    return _json(ns.describe(_find_entity(request)))


async def get_messages(request: web.Request) -> web.Response:
    ns = _runtime(request).namespace
    entity = _find_entity(request)
    if isinstance(entity, Topic):
        raise _bad_request("a topic stores no messages: peek one of its subscriptions")
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise _bad_request("limit must be an integer") from None
    msgs = ns.peek(entity, 0, limit)
    return _json([message_json(m) for m in msgs])


async def create_entity(request: web.Request) -> web.Response:
    ns = _runtime(request).namespace
    body = await _json_body(request)
    from sblocal.config import ConfigError, parse_properties

    path = body.get("path")
    kind = body.get("kind", "queue")
    raw_props = body.get("properties") or {}
    if not isinstance(path, str) or not path.strip("/"):
        raise _bad_request("path is required")
    if not isinstance(raw_props, dict):
        raise _bad_request("properties must be an object")
    try:
        if kind == "queue":
            ns.create_queue(path, parse_properties(QueueProperties, raw_props, path))
        elif kind == "topic":
            ns.create_topic(path, parse_properties(TopicProperties, raw_props, path))
        elif kind == "subscription":
            if "/subscriptions/" not in path.lower():
                raise _bad_request("a subscription path is <topic>/Subscriptions/<name>")
            idx = path.lower().rindex("/subscriptions/")
            topic, name = path[:idx], path[idx + len("/subscriptions/") :]
            ns.create_subscription(
                topic, name, parse_properties(SubscriptionProperties, raw_props, path)
            )
        else:
            raise _bad_request("kind must be queue, topic or subscription")
    except ConfigError as exc:
        raise _bad_request(str(exc)) from None
    except EntityExistsError:
        raise web.HTTPConflict(
            text=_dumps({"error": f"{path!r} exists"}), content_type="application/json"
        ) from None
    except EntityNotFoundError as exc:
        raise web.HTTPNotFound(
            text=_dumps({"error": f"no topic for {exc}"}), content_type="application/json"
        ) from None
    entity = ns.entity(path)
    assert entity is not None
    return _json(ns.describe(entity), status=201)


async def get_counters(request: web.Request) -> web.Response:
    ns = _runtime(request).namespace
    with ns.lock:
        return _json(ns.counters.snapshot())


async def reset_all(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    for name in broker.namespace_names:
        broker.reset_namespace(name)
    return _json({"reset": broker.namespace_names})


async def reset_namespace(request: web.Request) -> web.Response:
    broker = request.app[BROKER_KEY]
    rt = _runtime(request)
    broker.reset_namespace(rt.name)
    return _json({"reset": [rt.name]})


def create_control_app(broker: LocalBroker) -> web.Application:
    app = web.Application()
    app[BROKER_KEY] = broker
    r = app.router
    r.add_get("/namespaces", get_namespaces)
    r.add_post("/reset", reset_all)
    r.add_post("/namespaces/{ns}/reset", reset_namespace)
    r.add_post("/namespaces/{ns}/faults", add_fault)
    r.add_get("/namespaces/{ns}/faults", list_faults)
    r.add_delete("/namespaces/{ns}/faults", clear_faults)
    r.add_delete("/namespaces/{ns}/faults/{id}", delete_fault)
    r.add_put("/namespaces/{ns}/latency", put_latency)
    r.add_get("/namespaces/{ns}/latency", get_latency)
    r.add_post("/namespaces/{ns}/drop-connections", drop_connections)
    r.add_post("/namespaces/{ns}/down", namespace_down)
    r.add_post("/namespaces/{ns}/up", namespace_up)
    r.add_get("/namespaces/{ns}/counters", get_counters)
    r.add_get("/namespaces/{ns}/connections", get_connections)
    r.add_get("/namespaces/{ns}/entities", list_entities)
    r.add_post("/namespaces/{ns}/entities", create_entity)
    r.add_get("/namespaces/{ns}/entities/{path:.+}/messages", get_messages)
    r.add_get("/namespaces/{ns}/entities/{path:.+}", get_entity)
    return app


# -- message rendering -----------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """AMQP values as JSON (bytes become {"base64": ...}, uuids and symbols strings)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    elements = getattr(value, "elements", None)
    if elements is not None:
        return [jsonable(v) for v in elements]
    return str(value)


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat()


def message_json(msg: StoredMessage) -> dict[str, Any]:
    props = msg.properties()
    names = codec.PROPERTY_NAMES
    p = {names[i]: props[i] for i in range(min(len(props), len(names)))}
    body_parts: list[bytes] = []
    body_value: Any = None
    for code, start, end in codec.split_sections(msg.tail):
        if code == codec.DATA:
            body_parts.append(bytes(codec.section_body(msg.tail[start:end])))
        elif code in (codec.AMQP_VALUE, codec.AMQP_SEQUENCE):
            body_value = codec.section_body(msg.tail[start:end])
    if body_parts:
        body = b"".join(body_parts)
    elif isinstance(body_value, bytes):
        body = body_value
    elif isinstance(body_value, str):
        body = body_value.encode()
    else:
        body = b""
    try:
        text: str | None = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    app = msg.app_properties()
    return {
        "sequence_number": msg.seq,
        "state": MessageState(msg.state).name.lower(),
        "locked": msg.lock_token is not None,
        "locked_until": _iso(msg.locked_until_ms) if msg.lock_token is not None else None,
        "delivery_count": msg.delivery_count,
        "enqueued_time": _iso(msg.enqueued_ms),
        "scheduled_enqueue_time": _iso(msg.scheduled_ms),
        "expires_at": _iso(msg.expires_ms),
        "time_to_live_ms": msg.ttl_ms,
        "message_id": codec.to_text(p.get("message_id")),
        "correlation_id": codec.to_text(p.get("correlation_id")),
        "session_id": codec.to_text(p.get("group_id")),
        "reply_to_session_id": codec.to_text(p.get("reply_to_group_id")),
        "subject": codec.to_text(p.get("subject")),
        "reply_to": codec.to_text(p.get("reply_to")),
        "to": codec.to_text(p.get("to")),
        "content_type": codec.to_text(p.get("content_type")),
        "dead_letter_reason": codec.to_text(app.get("DeadLetterReason")),
        "dead_letter_error_description": codec.to_text(app.get("DeadLetterErrorDescription")),
        "application_properties": jsonable(app),
        "annotations": jsonable(msg.annotations),
        "body_base64": base64.b64encode(body).decode(),
        "body_text": text,
        "body_value": jsonable(body_value) if body_value is not None and not body_parts else None,
        "size": msg.size,
    }
