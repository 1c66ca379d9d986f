"""Sending: store messages sent to a queue or topic, with Service Bus' checks.

Size limit, quota, sessions-required, duplicate detection, TTL capped by the entity default,
scheduled messages, pings (counted, stored nowhere) and topic fan-out.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sblocal import codec
from sblocal.entities import TIMESPAN_MAX
from sblocal.store.base import NamespaceBase
from sblocal.store.entity import Entity, SendTarget, Topic
from sblocal.store.messages import (
    PING_CONTENT_TYPE,
    BrokerError,
    MessageState,
    StoredMessage,
    duration_ms,
    now_ms,
)


@dataclass(slots=True)
class EnqueueResult:
    stored: int = 0
    duplicates: int = 0
    pings: int = 0
    sequence_numbers: list[int] = field(default_factory=list)
    touched: list[Entity] = field(default_factory=list)


def _ttl_cap(*defaults: dt.timedelta) -> int | None:
    cap = min(defaults)
    return None if cap >= TIMESPAN_MAX else duration_ms(cap)


class Sending(NamespaceBase):
    """The send side of a `Namespace`."""

    def check_sendable(self, target: SendTarget) -> None:
        status = target.props.status
        if status in ("Disabled", "SendDisabled"):
            raise BrokerError(
                "com.microsoft:entity-disabled",
                f"Messaging entity '{target.path}' is currently disabled.",
                403,
            )

    def enqueue(
        self,
        target: SendTarget,
        messages: list[codec.ParsedMessage],
        sizes: list[int],
        *,
        now: int | None = None,
        count_send: bool = True,
    ) -> EnqueueResult:
        """Store messages sent to a queue or topic (all or none); raises BrokerError."""
        now = now_ms() if now is None else now
        with self.lock:
            self.check_sendable(target)
            limit = target.message_size_limit
            quota = target.quota_bytes
            requires_session = isinstance(target, Entity) and target.props.requires_session
            subs = list(target.subscriptions.values()) if isinstance(target, Topic) else []
            if any(s.props.requires_session for s in subs):
                requires_session = True
            current = (
                target.size_bytes
                if isinstance(target, Entity)
                else max((s.size_bytes for s in subs), default=0)
            )
            for parsed, size in zip(messages, sizes, strict=True):
                if size > limit:
                    raise BrokerError(
                        "amqp:link:message-size-exceeded",
                        f"The received message (size {size} bytes) exceeds the limit "
                        f"({limit} bytes) currently allowed on the link.",
                        413,
                    )
                is_ping = codec.to_text(parsed.prop("content_type")) == PING_CONTENT_TYPE
                if requires_session and not is_ping and not parsed.prop("group_id"):
                    raise BrokerError(
                        "amqp:not-allowed",
                        "The SessionId was not set on a message, and it cannot be sent to the "
                        "entity. Entities that have session support enabled can only receive "
                        "messages that have the SessionId set to a valid value.",
                        400,
                    )
            if current + sum(sizes) > quota:
                raise BrokerError(
                    "amqp:resource-limit-exceeded",
                    f"The maximum entity size has been reached or exceeded for '{target.path}'. "
                    f"Size of entity in bytes:{current}, Max entity size in bytes:{quota}.",
                    403,
                )
            result = EnqueueResult()
            if count_send:
                self.counters.sends += 1
                target.sends += 1
            for parsed, size in zip(messages, sizes, strict=True):
                self._store_one(target, parsed, size, now, result)
            self._flush_persistence()
            return result

    def _is_duplicate(self, target: SendTarget, message_id: str | None, now: int) -> bool:
        window = target.dedup_window_ms
        if window is None or message_id is None:
            return False
        dedup = target.dedup
        while dedup:
            first_id, first_end = next(iter(dedup.items()))
            if first_end > now:
                break
            dedup.pop(first_id)
        if message_id in dedup:
            return True
        dedup[message_id] = now + window
        return False

    def _store_one(
        self,
        target: SendTarget,
        parsed: codec.ParsedMessage,
        size: int,
        now: int,
        result: EnqueueResult,
    ) -> None:
        content_type = codec.to_text(parsed.prop("content_type"))
        if content_type == PING_CONTENT_TYPE:
            # Pings are billed like messages but never delivered: count, store nothing.
            self.counters.pings += 1
            target.pings += 1
            target.last_ping_ms = now
            result.pings += 1
            return
        self.counters.messages_received += 1
        message_id = codec.to_text(parsed.prop("message_id"))
        if self._is_duplicate(target, message_id, now):
            self.counters.duplicates += 1
            result.duplicates += 1
            return
        annotations = {
            k: v for k, v in parsed.annotations.items() if k not in codec.BROKER_ANNOTATIONS
        }
        scheduled_raw = annotations.get(codec.SCHEDULED_ENQUEUE_TIME)
        scheduled_ms = _timestamp_ms(scheduled_raw)
        app_range = parsed.app_properties_range
        if app_range is None:
            insert_at = 0
            sections = codec.split_sections(parsed.tail) if parsed.tail else []
            if sections and sections[0][0] == codec.PROPERTIES:
                insert_at = sections[0][2]
            app_range = (insert_at, insert_at)
        seq = target.next_seq
        target.next_seq += 1
        if isinstance(target, Entity):
            targets = [target]
        else:
            targets = list(target.subscriptions.values())
        for entity in targets:
            defaults = [entity.props.default_message_time_to_live]
            if entity.topic is not None:
                defaults.append(entity.topic.props.default_message_time_to_live)
            cap = _ttl_cap(*defaults)
            ttl = parsed.ttl_ms
            if cap is not None:
                ttl = cap if ttl is None or ttl <= 0 else min(ttl, cap)
            elif ttl is not None and ttl <= 0:
                ttl = None
            msg = StoredMessage(
                seq=seq,
                durable=parsed.durable,
                priority=parsed.priority,
                ttl_ms=ttl,
                annotations=annotations,
                tail=parsed.tail,
                app_range=app_range,
                message_id=message_id,
                session_id=codec.to_text(parsed.prop("group_id")),
                content_type=content_type,
                enqueued_ms=now,
                size=size,
            )
            if scheduled_ms is not None and scheduled_ms > now:
                msg.state = MessageState.SCHEDULED
                msg.scheduled_ms = scheduled_ms
                self.counters.scheduled += 1
            self._set_expiry(msg)
            entity.add(msg)
            entity.updated_at = dt.datetime.now(dt.UTC)
            self._persist(entity, msg)
            if msg.state == MessageState.ACTIVE:
                result.touched.append(entity)
        result.stored += 1
        result.sequence_numbers.append(seq)

    @staticmethod
    def _set_expiry(msg: StoredMessage) -> None:
        start = msg.scheduled_ms if msg.scheduled_ms is not None else msg.enqueued_ms
        msg.expires_ms = None if msg.ttl_ms is None else start + msg.ttl_ms

    def schedule(
        self, target: SendTarget, messages: list[codec.ParsedMessage], sizes: list[int], at_ms: int
    ) -> list[int]:
        """The schedule-message operation: store with the given enqueue time; sequence numbers."""
        for parsed in messages:
            parsed.annotations[codec.SCHEDULED_ENQUEUE_TIME] = codec.ts(at_ms)
        result = self.enqueue(target, messages, sizes, count_send=False)
        return result.sequence_numbers

    def cancel_scheduled(self, target: SendTarget, seqs: list[int]) -> None:
        with self.lock:
            entities = (
                [target] if isinstance(target, Entity) else list(target.subscriptions.values())
            )
            for seq in seqs:
                for entity in entities:
                    msg = entity.messages.get(seq)
                    if msg is not None and msg.state == MessageState.SCHEDULED:
                        entity.remove(seq)
                        self._unpersist(entity, seq)
                        self.counters.cancelled += 1
            self._flush_persistence()


def _timestamp_ms(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return int(value.timestamp() * 1000)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
