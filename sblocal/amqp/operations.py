"""`<entity>/$management`: the request/response operations the SDK sends to an entity.

Requests carry a reply-to; replies carry `statusCode` / `statusDescription` (camel case,
unlike `$cbs`) and, on failure, the error condition. Supported: renew-lock, peek-message,
schedule-message, cancel-scheduled-message, update-disposition, receive-by-sequence-number,
and for sessions renew-session-lock, get-session-state, set-session-state and
get-message-sessions (a session receiver's peek names its session and sees only that
session's messages).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from proton import Message, symbol, timestamp

from sblocal import codec
from sblocal.store import BrokerError, Entity, Namespace

_OP_PREFIX = "com.microsoft:"


def reply(ns: Namespace, request: Message, path: str, pump: Callable[[Entity], None]) -> Message:
    """The reply to one management request on entity `path`. `pump` hands messages that
    became deliverable (update-disposition) to the entity's receivers."""
    props: dict[Any, Any] = request.properties or {}
    operation = str(props.get("operation") or "")
    status, description, body, condition = 200, "OK", None, None
    with ns.lock:
        ns.counters.management_ops += 1
    try:
        body, status = _operation(ns, operation, path, request.body or {}, pump)
    except BrokerError as err:
        status, description, condition = err.status, err.description, err.condition
    except (KeyError, TypeError, ValueError) as exc:
        status, description = 400, f"Malformed {operation} request: {exc!r}"
        condition = "com.microsoft:argument-error"
    app: dict[str, Any] = {"statusCode": status, "statusDescription": description}
    if condition is not None:
        app["errorCondition"] = symbol(condition)
    return Message(correlation_id=request.id, properties=app, body=body)


def _operation(
    ns: Namespace, operation: str, path: str, body: Any, pump: Callable[[Entity], None]
) -> tuple[Any, int]:
    op = operation[len(_OP_PREFIX) :] if operation.startswith(_OP_PREFIX) else operation
    if op in ("schedule-message", "cancel-scheduled-message"):
        target = ns.send_target(path)
        if target is None:
            raise BrokerError("amqp:not-found", f"The entity '{path}' could not be found.", 404)
        if op == "cancel-scheduled-message":
            ns.cancel_scheduled(target, [int(s) for s in _elements(body["sequence-numbers"])])
            return {}, 200
        raw = [bytes(m["message"]) for m in _elements(body["messages"])]
        parsed = [codec.parse_message(m) for m in raw]
        at = [codec.SCHEDULED_ENQUEUE_TIME in p.annotations for p in parsed]
        if not all(at):
            raise BrokerError(
                "com.microsoft:argument-error", "ScheduledEnqueueTimeUtc is missing.", 400
            )
        stored = ns.enqueue(target, parsed, [len(m) for m in raw], count_send=False)
        return {"sequence-numbers": codec.long_array(stored.sequence_numbers)}, 200
    entity = ns.receive_source(path)
    if entity is None:
        raise BrokerError("amqp:not-found", f"The entity '{path}' could not be found.", 404)
    if op in _SESSION_OPERATIONS:
        return _session_operation(ns, op, entity, body)
    if op == "renew-lock":
        tokens = [_uuid(t) for t in _elements(body["lock-tokens"])]
        expirations = ns.renew(entity, tokens)
        return {"expirations": codec.timestamp_array(expirations)}, 200
    if op == "peek-message":
        return _peek(ns, entity, body)
    if op == "update-disposition":
        status = str(body["disposition-status"])
        tokens = [_uuid(t) for t in _elements(body["lock-tokens"])]
        ready = ns.settle_by_token(
            entity,
            status,
            tokens,
            _text(body.get("deadletter-reason")),
            _text(body.get("deadletter-description")),
        )
        if ready:
            pump(entity)
        return {}, 200
    if op == "receive-by-sequence-number":
        seqs = [int(s) for s in _elements(body["sequence-numbers"])]
        lock = int(body.get("receiver-settle-mode", 1)) == 1
        msgs = ns.receive_deferred(entity, seqs, lock=lock)
        out = []
        for m in msgs:
            item: dict[str, Any] = {"message": m.encode(with_lock=lock, with_state=True)}
            if lock and m.lock_token is not None:
                item["lock-token"] = m.lock_token
            out.append(item)
        return {"messages": out}, 200
    raise BrokerError(
        "amqp:not-implemented", f"The operation '{operation}' is not supported by sblocal.", 501
    )


def _peek(ns: Namespace, entity: Entity, body: Any) -> tuple[Any, int]:
    from_seq = int(body.get("from-sequence-number", 1))
    count = int(body.get("message-count", 1))
    msgs = ns.peek(entity, from_seq, count, _text(body.get("session-id")))
    if not msgs:
        return None, 204
    return {
        "messages": [{"message": m.encode(with_lock=False, with_state=True)} for m in msgs]
    }, 200


_SESSION_OPERATIONS = (
    "renew-session-lock",
    "get-session-state",
    "set-session-state",
    "get-message-sessions",
)
# `last-updated-time` of get-message-sessions meaning "no filter": .NET's DateTime.MaxValue
# as the SDKs send it (10000-01-01T00:00:00Z in ms).
_NO_UPDATE_FILTER_MS = 253_402_300_800_000


def _list_sessions(ns: Namespace, entity: Entity, body: Any) -> tuple[Any, int]:
    after = int(body.get("last-updated-time", _NO_UPDATE_FILTER_MS))
    skip = int(body.get("skip", 0))
    ids = ns.list_sessions(
        entity, None if after >= _NO_UPDATE_FILTER_MS else after, skip, int(body.get("top", 100))
    )
    if not ids:
        return None, 204
    return {"skip": skip + len(ids), "sessions-ids": ids}, 200


def _session_operation(ns: Namespace, op: str, entity: Entity, body: Any) -> tuple[Any, int]:
    """The list of sessions, and the operations on one session, named by `session-id`;
    each of those needs the session to be locked (by a receiver), as on Service Bus."""
    if op == "get-message-sessions":
        return _list_sessions(ns, entity, body)
    session = _text(body["session-id"])
    if session is None:
        raise BrokerError("com.microsoft:argument-error", "The session-id is missing.", 400)
    if op == "renew-session-lock":
        return {"expiration": timestamp(ns.renew_session(entity, session))}, 200
    if op == "get-session-state":
        return {"session-state": ns.session_state(entity, session)}, 200
    value = body.get("session-state")
    ns.set_session_state(entity, session, bytes(value) if value is not None else None)
    return {}, 200


def _elements(value: Any) -> list[Any]:
    """proton decodes AMQP arrays as `Array`; lists stay lists."""
    if value is None:
        return []
    elements = getattr(value, "elements", None)
    if elements is not None:
        return list(elements)
    return list(value)


def _uuid(value: Any) -> uuid.UUID:
    result = codec.as_uuid(value)
    if result is None:
        raise BrokerError("com.microsoft:argument-error", f"Invalid lock token {value!r}.", 400)
    return result


def _text(value: Any) -> str | None:
    return codec.to_text(value)
