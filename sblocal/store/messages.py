"""A stored message, its states, the broker's errors and the namespace's counters."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Any

from sblocal import codec

PING_CONTENT_TYPE = "application/vnd.ms-servicebus-ping"
DEAD_LETTER_REASON = "DeadLetterReason"
DEAD_LETTER_DESCRIPTION = "DeadLetterErrorDescription"


def now_ms() -> int:
    return int(time.time() * 1000)


def duration_ms(delta: dt.timedelta) -> int:
    return int(delta.total_seconds() * 1000)


class MessageState(IntEnum):
    """Values of the ``x-opt-message-state`` annotation."""

    ACTIVE = 0
    DEFERRED = 1
    SCHEDULED = 2


class BrokerError(Exception):
    """A Service Bus error to send back to the client as an AMQP error condition."""

    def __init__(self, condition: str, description: str, status: int = 400) -> None:
        super().__init__(description)
        self.condition = condition
        self.description = description
        self.status = status  # for $management replies


def lock_lost() -> BrokerError:
    return BrokerError(
        "com.microsoft:message-lock-lost",
        "The lock supplied is invalid. Either the lock expired, or the message has already "
        "been removed from the queue.",
        410,
    )


@dataclass(slots=True)
class StoredMessage:
    """One message in one entity (a topic's message is copied to each subscription)."""

    seq: int
    durable: bool
    priority: int | None
    ttl_ms: int | None  # effective TTL, capped by the entity default; None = never expires
    annotations: dict[Any, Any]  # the sender's message annotations, broker ones removed
    tail: bytes  # properties, application properties, body, footer: exactly as sent
    app_range: tuple[int, int]  # application-properties section in ``tail`` (empty: absent)
    message_id: str | None
    session_id: str | None
    content_type: str | None
    enqueued_ms: int
    scheduled_ms: int | None = None
    expires_ms: int | None = None
    delivery_count: int = 0
    state: MessageState = MessageState.ACTIVE
    lock_token: uuid.UUID | None = None
    locked_until_ms: int = 0
    size: int = 0

    def encode(self, *, with_lock: bool, with_state: bool = False) -> bytes:
        """The message as delivered: a fresh header and broker annotations, then the tail."""
        ann = dict(self.annotations)
        ann[codec.SEQUENCE_NUMBER] = self.seq
        ann[codec.ENQUEUED_TIME] = codec.ts(self.enqueued_ms)
        if with_lock and self.lock_token is not None:
            ann[codec.LOCKED_UNTIL] = codec.ts(self.locked_until_ms)
        if with_state and self.state != MessageState.ACTIVE:
            ann[codec.MESSAGE_STATE] = int(self.state)
        return (
            codec.encode_header(self.durable, self.priority, self.ttl_ms, self.delivery_count)
            + codec.encode_annotations(ann)
            + self.tail
        )

    def app_properties(self) -> dict[Any, Any]:
        start, end = self.app_range
        if start == end:
            return {}
        return dict(codec.section_body(self.tail[start:end]) or {})

    def with_app_properties(self, updates: dict[str, Any]) -> StoredMessage:
        props = self.app_properties()
        props.update(updates)
        start, end = self.app_range
        section = codec.encode_app_properties(props)
        tail = self.tail[:start] + section + self.tail[end:]
        return replace(self, tail=tail, app_range=(start, start + len(section)))

    def properties(self) -> list[Any]:
        """The decoded properties section (empty when absent)."""
        sections = codec.split_sections(self.tail)
        for code, start, end in sections:
            if code == codec.PROPERTIES:
                return list(codec.section_body(self.tail[start:end]) or [])
        return []

    def expired(self, now: int) -> bool:
        return self.expires_ms is not None and self.expires_ms <= now


@dataclass(slots=True)
class Counters:
    """Per-namespace activity counters (what tests assert on)."""

    connections: int = 0
    active_connections: int = 0
    cbs_tokens: int = 0
    cbs_rejected: int = 0
    sends: int = 0  # send operations (transfers on sender links, a batch counts once)
    messages_received: int = 0  # messages stored or dropped by the broker (pings excluded)
    pings: int = 0
    duplicates: int = 0
    rejected_sends: int = 0  # transfers rejected (validation or injected faults)
    receives: int = 0  # credit flows on receiver links (receive calls)
    deliveries: int = 0  # messages handed to receivers (links and receive-by-sequence)
    completes: int = 0
    abandons: int = 0
    defers: int = 0
    dead_letters: int = 0
    releases: int = 0
    lock_renewals: int = 0
    lock_expirations: int = 0
    expired: int = 0
    scheduled: int = 0
    cancelled: int = 0
    management_ops: int = 0
    faults_applied: int = 0

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
