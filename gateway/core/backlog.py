"""Backlog queues: their paths, and the message rewrite into them and back
(docs/design.md#message-rewrite).

The path rule is defined here once: `backlog_path` builds a backlog queue's path,
`is_backlog_path` recognises one, and `BACKLOG_SEGMENT` is what clients may never address
(`gateway.core.entities`). The audit pipeline, which imports nothing from the gateway, keeps
a copy of `BACKLOG_PATH_PATTERN` that a test holds equal to this one.

Messages for many entities share one backlog queue, so the properties that would act on the
backlog queue itself move into application properties, and the syphon moves them back:

============================  =====================================================
original                      in the backlog queue
============================  =====================================================
destination entity path       ``x-ms-path``
SessionId                     ``x-ms-sessionid``
TimeToLive                    ``x-ms-timetolive`` (milliseconds, AMQP long)
ScheduledEnqueueTimeUtc       ``x-ms-scheduledenqueuetimeutc`` (AMQP timestamp)
PartitionKey                  ``x-ms-partitionkey``
(acceptance time)             ``x-ms-acceptedtimeutc`` (AMQP timestamp): the syphon
                              sends on with the *remaining* TTL
(application property types)  ``x-ms-types``: JSON ``{"name": "uint", ...}`` for the
                              properties of an AMQP type the syphon's receive would
                              not give back (`Typed`: a uint, a timestamp, binary...);
                              only when there are some
(a fenced session's message)  ``x-ms-fencetoken``: what the session's fence counts
                              (docs/failover.md#sessions-keep-their-order)
============================  =====================================================

MessageId, CorrelationId, ContentType, Subject (Label), ReplyTo, ReplyToSessionId, To and
every application property are kept untouched. A message the AMQP edge passes through raw
(`OutboundMessage.encoded`: the client's own bytes, sent as they are to the primary) loses
those bytes in the rewrite and is encoded from its fields, which hold the same content
(tests/gateway/test_amqp_messages.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from gateway.core.message import (
    INTEGER_RANGES,
    TYPED_KINDS,
    AppValue,
    OutboundMessage,
    Typed,
    TypedKind,
    estimate_size,
)
from gateway.entitypath import BACKLOG_SEGMENT

PATH = "x-ms-path"
SESSION_ID = "x-ms-sessionid"
TIME_TO_LIVE = "x-ms-timetolive"
SCHEDULED = "x-ms-scheduledenqueuetimeutc"
PARTITION_KEY = "x-ms-partitionkey"
ACCEPTED = "x-ms-acceptedtimeutc"
TYPES = "x-ms-types"
FENCE_TOKEN = "x-ms-fencetoken"  # noqa: S105  # nosec B105  # a property name, not a secret
REWRITE_KEYS = (
    PATH,
    SESSION_ID,
    TIME_TO_LIVE,
    SCHEDULED,
    PARTITION_KEY,
    ACCEPTED,
    TYPES,
    FENCE_TOKEN,
)
_REWRITE_NAMES = frozenset(REWRITE_KEYS)
PING_CONTENT_TYPE = "application/vnd.ms-servicebus-ping"
# The lock duration backlog queues are created with: a message locked by a receiver that
# died mid-move is available again after this long.
BACKLOG_LOCK_DURATION = 60.0

# Backlog queues live at <primary-namespace>/x-servicebus-transfer/<index> in the secondary
# (`BACKLOG_SEGMENT`: the entity-path grammar refuses it to clients).
# A backlog queue's path, searched in a queue path without its sub-queue suffix (also the
# audit's default --backlog-pattern, applied by Spark).
BACKLOG_PATH_PATTERN: Final = rf"/{BACKLOG_SEGMENT}/\d+$"
_BACKLOG_PATH: Final = re.compile(BACKLOG_PATH_PATTERN, re.IGNORECASE)
_DEAD_LETTER_SUFFIX: Final = re.compile(r"/\$deadletterqueue$", re.IGNORECASE)
# What `restore` accepts back: Service Bus's own bounds (ids: 128 characters; TTL at most
# TimeSpan.MaxValue).
MAX_ID_LENGTH: Final = 128
MAX_TTL_MS: Final = 10675199 * 86400 * 1000


class RestoreError(ValueError):
    """A backlog message whose rewrite properties cannot be read back: a wrong type, a value
    out of range, or a contradiction. Nothing the gateway writes; anyone with Send on the
    secondary namespace can (docs/security.md#the-syphon-and-the-backlog-queues)."""


def backlog_path(primary_namespace: str, index: int) -> str:
    """``<primary-namespace>/x-servicebus-transfer/<index>``."""
    return f"{primary_namespace}/{BACKLOG_SEGMENT}/{index}"


def is_backlog_path(path: str) -> bool:
    """Is `path` a backlog queue, or a backlog queue's dead-letter queue? Case-insensitive,
    like Service Bus entity names."""
    return _BACKLOG_PATH.search(_DEAD_LETTER_SUFFIX.sub("", path)) is not None


def _seconds(value: object) -> float | None:
    """A timestamp property as unix seconds (AMQP timestamp, or ms as an integer)."""
    if isinstance(value, dt.datetime):
        return value.timestamp() if value.tzinfo else value.replace(tzinfo=dt.UTC).timestamp()
    if isinstance(value, int) and not isinstance(value, bool):
        return value / 1000
    return None


def session_ranking(entity_key: str, session_id: str, queues: Sequence[str]) -> list[str]:
    """`queues` in session (`entity_key`, `session_id`)'s order of preference: rendezvous
    hashing, so every replica ranks them alike and a queue leaving rotation moves only the
    sessions that preferred it. Not a security boundary (anyone may pick a SessionId)."""

    def score(queue: str) -> bytes:
        data = "\0".join((entity_key, session_id, queue)).encode("utf-8", "surrogatepass")
        return hashlib.blake2b(data, digest_size=8).digest()

    return sorted(queues, key=score, reverse=True)


def rewrite(
    m: OutboundMessage, entity_path: str, accepted_at: float, fence_token: str | None = None
) -> OutboundMessage:
    """`m` as it is stored in a backlog queue (see the module table). A property of `m`
    named like a rewrite key, in any letter case, is dropped: the edge refuses them, and what
    the syphon reads back must be the gateway's own."""
    props: dict[str, AppValue] = {
        k: v for k, v in m.application_properties.items() if k.lower() not in _REWRITE_NAMES
    }
    types = {k: v.kind for k, v in props.items() if isinstance(v, Typed)}
    if types:
        props[TYPES] = json.dumps(types, separators=(",", ":"), ensure_ascii=False)
    props[PATH] = entity_path
    props[ACCEPTED] = dt.datetime.fromtimestamp(accepted_at, dt.UTC)
    if m.session_id is not None:
        props[SESSION_ID] = m.session_id
    if m.time_to_live is not None:
        props[TIME_TO_LIVE] = int(m.time_to_live.total_seconds() * 1000)
    if m.scheduled_enqueue_time_utc is not None:
        props[SCHEDULED] = m.scheduled_enqueue_time_utc
    if m.partition_key is not None:
        props[PARTITION_KEY] = m.partition_key
    if fence_token is not None:
        props[FENCE_TOKEN] = fence_token
    return replace(
        m,
        session_id=None,
        time_to_live=None,
        scheduled_enqueue_time_utc=None,
        partition_key=None,
        application_properties=props,
        encoded=None,  # the fields changed: encoded again from them
    )


def accepted_at(m: OutboundMessage) -> float | None:
    """When the gateway accepted backlog message `m` (unix time), if it says."""
    return _seconds(m.application_properties.get(ACCEPTED))


# A fence token as `new_fence_token` makes one: the size of any, for `rewritten_size`.
_TOKEN_SHAPE: Final = "0" * 32


def new_fence_token() -> str:
    """A fresh fence token (random, 32 hex digits)."""
    return uuid.uuid4().hex


def rewritten_size(m: OutboundMessage, entity_path: str) -> int:
    """The size `m` will have in a backlog queue (the rewrite adds bytes; a session's
    message is counted with a fence token, whatever the policy)."""
    token = _TOKEN_SHAPE if m.session_id is not None else None
    return rewrite(m, entity_path, 0.0, token).size


@dataclass(frozen=True, slots=True)
class Restored:
    """A backlog message translated back: where it goes and how long it may still live."""

    entity_path: str
    message: OutboundMessage
    expired: bool  # its original TTL ran out while it waited in the backlog
    accepted_at: float | None = None  # unix time the gateway accepted it (answered 202)
    fence_token: str | None = None  # what its session's fence counts it by


def restore(m: OutboundMessage, now: float) -> Restored | None:
    """The original message from a backlog message, as it must go home at `now`.

    Service Bus counts a message's TTL from its enqueue time, and a scheduled message is
    enqueued at its schedule. So a message whose schedule is still to come goes home with
    its schedule and its *whole* TTL (it expires at schedule + TTL, as it would have); any
    other goes home unscheduled with the *remaining* TTL: from its acceptance, or from its
    schedule if that came later. `expired` when nothing is left. Returns None if `m`
    carries no ``x-ms-path`` (not a backlog message); raises `RestoreError` when a rewrite
    property is not what `rewrite` writes (type, range, SessionId vs PartitionKey). Whether
    the path names an entity this pair serves is the caller's check.
    """
    props = dict(m.application_properties)
    if PATH not in props:
        return None
    path = props.pop(PATH)
    if not isinstance(path, str) or not path:
        raise RestoreError(f"{PATH} must be an entity path")
    accepted = _timestamp(props, ACCEPTED)
    session_id = _identifier(props, SESSION_ID)
    ttl_ms = props.pop(TIME_TO_LIVE, None)
    scheduled_at = _timestamp(props, SCHEDULED)
    partition_key = _identifier(props, PARTITION_KEY)
    fence_token = _identifier(props, FENCE_TOKEN)
    _retype(props)
    for name, value in props.items():
        if not isinstance(value, _CARRIED):  # an untyped uuid, a list: not the gateway's
            raise RestoreError(f"property {name[:100]!r} has a type the gateway never writes")
    if session_id is not None and partition_key and partition_key != session_id:
        raise RestoreError(f"{PARTITION_KEY} must equal {SESSION_ID} when both are set")
    if ttl_ms is not None and (
        isinstance(ttl_ms, bool)
        or not isinstance(ttl_ms, int | float)
        or not (math.isfinite(ttl_ms) and 0 <= ttl_ms <= MAX_TTL_MS)
    ):
        raise RestoreError(f"{TIME_TO_LIVE} must be a number of milliseconds, 0 to {MAX_TTL_MS}")
    pending = scheduled_at is not None and scheduled_at > now
    ttl: dt.timedelta | None = None
    expired = False
    if ttl_ms is not None:
        if pending:
            ttl = dt.timedelta(milliseconds=ttl_ms)
        else:
            start = accepted if accepted is not None else now
            if scheduled_at is not None:
                start = max(start, scheduled_at)
            remaining = start + ttl_ms / 1000 - now
            expired = remaining <= 0
            ttl = dt.timedelta(seconds=min(max(remaining, 0.001), MAX_TTL_MS / 1000))
    original = replace(
        m,
        session_id=session_id,
        partition_key=partition_key,
        time_to_live=ttl,
        scheduled_enqueue_time_utc=(
            dt.datetime.fromtimestamp(scheduled_at, dt.UTC)
            if pending and scheduled_at is not None
            else None
        ),
        application_properties=props,
        encoded=None,  # encoded from the restored fields (never a backlog copy's bytes)
    )
    return Restored(
        entity_path=path,
        message=original,
        expired=expired,
        accepted_at=accepted,
        fence_token=fence_token,
    )


def _timestamp(props: dict[str, AppValue], key: str) -> float | None:
    """Pop timestamp property `key` as unix seconds (None: absent), within datetime's range."""
    value = props.pop(key, None)
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is None or not math.isfinite(seconds):
        raise RestoreError(f"{key} must be a timestamp")
    try:
        dt.datetime.fromtimestamp(seconds, dt.UTC)
    except (OverflowError, ValueError, OSError):
        raise RestoreError(f"{key} is out of range") from None
    return seconds


_CARRIED = (str, int, float, bytes, dt.datetime, Typed)  # bool is an int


def _retype(props: dict[str, AppValue]) -> None:
    """Give the properties ``x-ms-types`` names their AMQP types back (popping it): the
    syphon's receive hands them back as plain numbers, text or bytes."""
    raw = props.pop(TYPES, None)
    if raw is None:
        return
    try:
        types = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):  # anyone with Send on the secondary writes these
        types = None
    if not isinstance(types, dict):
        raise RestoreError(f"{TYPES} must be a JSON object of property names and types")
    for name, kind in types.items():
        if kind not in TYPED_KINDS or name not in props:
            raise RestoreError(
                f"{TYPES}: {name[:100]!r} is not a property, or {str(kind)[:50]!r} not a type"
            )
        props[name] = _typed(kind, props[name], name)


def _typed(kind: TypedKind, value: AppValue, name: str) -> Typed:
    if kind in INTEGER_RANGES:
        if isinstance(value, int) and not isinstance(value, bool):
            if value in INTEGER_RANGES[kind]:
                return Typed(kind, value)
    elif kind == "float":
        if isinstance(value, float):
            return Typed(kind, value)
    elif kind == "uuid":
        if isinstance(value, uuid.UUID):
            return Typed(kind, value)
    elif isinstance(value, str):  # binary, received as text when it was UTF-8
        return Typed(kind, value.encode("utf-8"))
    elif isinstance(value, bytes):
        return Typed(kind, value)
    raise RestoreError(f"{TYPES}: property {name[:100]!r} is not a {kind}")


def _identifier(props: dict[str, AppValue], key: str) -> str | None:
    """Pop id property `key` (None: absent): text of at most `MAX_ID_LENGTH` characters."""
    value = props.pop(key, None)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_LENGTH:
        raise RestoreError(f"{key} must be text of at most {MAX_ID_LENGTH} characters")
    return value


def ping_message(message_id: str) -> OutboundMessage:
    """A ping (docs/design.md#pings): empty body, ContentType ...-servicebus-ping, TTL 1 s."""
    return OutboundMessage(
        body=b"",
        message_id=message_id,
        content_type=PING_CONTENT_TYPE,
        time_to_live=dt.timedelta(seconds=1),
    )


__all__ = [
    "ACCEPTED",
    "BACKLOG_LOCK_DURATION",
    "BACKLOG_PATH_PATTERN",
    "BACKLOG_SEGMENT",
    "FENCE_TOKEN",
    "PATH",
    "PING_CONTENT_TYPE",
    "REWRITE_KEYS",
    "RestoreError",
    "Restored",
    "accepted_at",
    "backlog_path",
    "estimate_size",
    "is_backlog_path",
    "new_fence_token",
    "ping_message",
    "restore",
    "rewrite",
    "rewritten_size",
    "session_ranking",
]
