"""Entities and messages of one namespace, with Service Bus semantics.

`Namespace` is the single owner of a namespace's state. Every public method takes the
namespace lock, so the AMQP reactor thread, the control API and the management API (asyncio
thread) can all call it. Methods never block on I/O except the optional SQLite write-through
of durable mode, which happens under the lock so that what a sender saw settled is on disk.

Semantics follow Service Bus: peek-lock with per-entity lock duration, delivery count and
MaxDeliveryCount → dead-letter queue, deferral, scheduled messages, TTL capped by the entity
default (never expiring a locked message), duplicate detection, sessions-required, maximum
message size, pings (stored nowhere, counted) and topic fan-out.
"""

from __future__ import annotations

import datetime as dt
import heapq
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sblocal import codec
from sblocal.config import NamespaceConfig
from sblocal.entities import (
    TIMESPAN_MAX,
    EntityExistsError,
    EntityNotFoundError,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)

if TYPE_CHECKING:
    from sblocal.persistence import Persistence

_log = logging.getLogger(__name__)
_P = TypeVar("_P", QueueProperties, TopicProperties)

PING_CONTENT_TYPE = "application/vnd.ms-servicebus-ping"
DLQ_SUFFIX = "/$deadletterqueue"
SUBSCRIPTIONS_SEGMENT = "/subscriptions/"
DEAD_LETTER_REASON = "DeadLetterReason"
DEAD_LETTER_DESCRIPTION = "DeadLetterErrorDescription"
_TIMESPAN_MAX_MS = int(TIMESPAN_MAX.total_seconds() * 1000)

EntityKind = Literal["queue", "topic", "subscription", "dlq"]


def now_ms() -> int:
    return int(time.time() * 1000)


def _ms(delta: dt.timedelta) -> int:
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


def not_found(what: str) -> BrokerError:
    return BrokerError("amqp:not-found", f"The messaging entity '{what}' could not be found.", 404)


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


class Entity:
    """A queue, a subscription or a dead-letter queue: something messages are received from."""

    def __init__(
        self,
        path: str,
        kind: EntityKind,
        props: QueueProperties | SubscriptionProperties,
        *,
        parent: Entity | None = None,
        topic: Topic | None = None,
    ) -> None:
        self.path = path
        self.kind: EntityKind = kind
        self.props = props
        self.parent = parent
        self.topic = topic
        self.dlq: Entity | None = (
            None if kind == "dlq" else Entity(path + "/$DeadLetterQueue", "dlq", props, parent=self)
        )
        self.messages: dict[int, StoredMessage] = {}
        self._ready: list[int] = []  # heap of sequence numbers that may be deliverable
        self._scheduled: list[tuple[int, int]] = []  # heap of (enqueue time, seq)
        self._lock_heap: list[tuple[int, uuid.UUID]] = []  # heap of (locked until, token)
        self._expiry_heap: list[tuple[int, int]] = []  # heap of (expires, seq)
        self.locks: dict[uuid.UUID, int] = {}
        self.next_seq = 1
        self.dedup: OrderedDict[str, int] = OrderedDict()  # message id -> window end (ms)
        self.size_bytes = 0
        self.sends = 0
        self.pings = 0
        self.last_ping_ms: int | None = None
        now = dt.datetime.now(dt.UTC)
        self.created_at = now
        self.updated_at = now
        self.accessed_at = now

    # -- bookkeeping -------------------------------------------------------------------

    @property
    def message_size_limit(self) -> int:
        props = self.props if isinstance(self.props, QueueProperties) else QueueProperties()
        return props.max_message_size_in_kilobytes * 1024

    @property
    def quota_bytes(self) -> int:
        props = self.props if isinstance(self.props, QueueProperties) else QueueProperties()
        return props.max_size_in_megabytes * 1024 * 1024

    @property
    def dedup_window_ms(self) -> int | None:
        """The duplicate detection window; None when detection is off."""
        props = self.props
        if not isinstance(props, QueueProperties) or not props.requires_duplicate_detection:
            return None
        return _ms(props.duplicate_detection_history_time_window)

    @property
    def lock_duration_ms(self) -> int:
        return _ms(self.props.lock_duration)

    @property
    def max_delivery_count(self) -> int:
        return self.props.max_delivery_count

    def add(self, msg: StoredMessage) -> None:
        self.messages[msg.seq] = msg
        self.size_bytes += msg.size
        if msg.state == MessageState.SCHEDULED and msg.scheduled_ms is not None:
            heapq.heappush(self._scheduled, (msg.scheduled_ms, msg.seq))
        elif msg.state == MessageState.ACTIVE:
            heapq.heappush(self._ready, msg.seq)
            if msg.expires_ms is not None:
                heapq.heappush(self._expiry_heap, (msg.expires_ms, msg.seq))

    def remove(self, seq: int) -> StoredMessage | None:
        msg = self.messages.pop(seq, None)
        if msg is not None:
            self.size_bytes -= msg.size
            if msg.lock_token is not None:
                self.locks.pop(msg.lock_token, None)
                msg.lock_token = None
        return msg

    def make_ready(self, msg: StoredMessage) -> None:
        msg.lock_token = None
        msg.state = MessageState.ACTIVE
        heapq.heappush(self._ready, msg.seq)
        if msg.expires_ms is not None:
            heapq.heappush(self._expiry_heap, (msg.expires_ms, msg.seq))

    def lock(self, msg: StoredMessage, now: int) -> uuid.UUID:
        token = uuid.uuid4()
        msg.lock_token = token
        msg.locked_until_ms = now + self.lock_duration_ms
        self.locks[token] = msg.seq
        heapq.heappush(self._lock_heap, (msg.locked_until_ms, token))
        return token

    def locked(self, token: uuid.UUID) -> StoredMessage | None:
        seq = self.locks.get(token)
        if seq is None:
            return None
        msg = self.messages.get(seq)
        if msg is None or msg.lock_token != token:
            self.locks.pop(token, None)
            return None
        return msg

    def unlock(self, msg: StoredMessage) -> None:
        if msg.lock_token is not None:
            self.locks.pop(msg.lock_token, None)
            msg.lock_token = None

    def pop_ready(self) -> StoredMessage | None:
        """The next deliverable message (lowest sequence number), not yet locked."""
        while self._ready:
            seq = heapq.heappop(self._ready)
            msg = self.messages.get(seq)
            if msg is not None and msg.state == MessageState.ACTIVE and msg.lock_token is None:
                return msg
        return None

    def push_back(self, msg: StoredMessage) -> None:
        heapq.heappush(self._ready, msg.seq)

    def has_ready(self) -> bool:
        while self._ready:
            msg = self.messages.get(self._ready[0])
            if msg is not None and msg.state == MessageState.ACTIVE and msg.lock_token is None:
                return True
            heapq.heappop(self._ready)
        return False

    def due_scheduled(self, now: int) -> list[StoredMessage]:
        out = []
        while self._scheduled and self._scheduled[0][0] <= now:
            _, seq = heapq.heappop(self._scheduled)
            msg = self.messages.get(seq)
            if msg is not None and msg.state == MessageState.SCHEDULED:
                out.append(msg)
        return out

    def expired_locks(self, now: int) -> list[StoredMessage]:
        out = []
        while self._lock_heap and self._lock_heap[0][0] <= now:
            _, token = heapq.heappop(self._lock_heap)
            msg = self.locked(token)
            if msg is None:
                continue
            if msg.locked_until_ms > now:  # renewed: track the new deadline
                heapq.heappush(self._lock_heap, (msg.locked_until_ms, token))
                continue
            out.append(msg)
        return out

    def expired_messages(self, now: int) -> list[StoredMessage]:
        out = []
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            _, seq = heapq.heappop(self._expiry_heap)
            msg = self.messages.get(seq)
            # Never expire a locked message: it is checked again when the lock goes.
            if msg is not None and msg.lock_token is None and msg.expired(now):
                out.append(msg)
        return out

    def clear(self) -> None:
        self.messages.clear()
        self._ready.clear()
        self._scheduled.clear()
        self._lock_heap.clear()
        self._expiry_heap.clear()
        self.locks.clear()
        self.dedup.clear()
        self.size_bytes = 0
        self.sends = 0
        self.pings = 0
        self.last_ping_ms = None

    def counts(self) -> dict[str, int]:
        active = deferred = scheduled = locked = 0
        for m in self.messages.values():
            if m.state == MessageState.SCHEDULED:
                scheduled += 1
            elif m.state == MessageState.DEFERRED:
                deferred += 1
            else:
                active += 1
                if m.lock_token is not None:
                    locked += 1
        return {
            "active": active,
            "locked": locked,
            "deferred": deferred,
            "scheduled": scheduled,
            "dead_letter": len(self.dlq.messages) if self.dlq is not None else 0,
            "size_in_bytes": self.size_bytes,
        }

    def runtime(self) -> RuntimeCounts:
        c = self.counts()
        return RuntimeCounts(
            # Service Bus counts deferred messages as active.
            active_message_count=c["active"] + c["deferred"],
            dead_letter_message_count=c["dead_letter"],
            scheduled_message_count=c["scheduled"],
            size_in_bytes=c["size_in_bytes"],
            created_at=self.created_at,
            updated_at=self.updated_at,
            accessed_at=self.accessed_at,
        )


class Topic:
    """A topic: stores nothing itself, copies each message to every subscription."""

    def __init__(self, path: str, props: TopicProperties) -> None:
        self.path = path
        self.props = props
        self.subscriptions: dict[str, Entity] = {}  # lower-case name -> subscription
        self.next_seq = 1
        self.dedup: OrderedDict[str, int] = OrderedDict()
        self.sends = 0
        self.pings = 0
        self.last_ping_ms: int | None = None
        now = dt.datetime.now(dt.UTC)
        self.created_at = now
        self.updated_at = now

    @property
    def message_size_limit(self) -> int:
        return self.props.max_message_size_in_kilobytes * 1024

    @property
    def quota_bytes(self) -> int:
        return self.props.max_size_in_megabytes * 1024 * 1024

    @property
    def dedup_window_ms(self) -> int | None:
        if not self.props.requires_duplicate_detection:
            return None
        return _ms(self.props.duplicate_detection_history_time_window)


SendTarget = Entity | Topic


@dataclass(slots=True)
class EnqueueResult:
    stored: int = 0
    duplicates: int = 0
    pings: int = 0
    sequence_numbers: list[int] = field(default_factory=list)
    touched: list[Entity] = field(default_factory=list)


def _ttl_cap(*defaults: dt.timedelta) -> int | None:
    cap = min(defaults)
    return None if cap >= TIMESPAN_MAX else _ms(cap)


class Namespace:
    """All entities of one namespace. Implements `sblocal.entities.EntityRegistry`."""

    def __init__(
        self,
        config: NamespaceConfig,
        *,
        persistence: Persistence | None = None,
    ) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.counters = Counters()
        self._queues: dict[str, Entity] = {}
        self._topics: dict[str, Topic] = {}
        self._persistence = persistence
        # Called (from whatever thread changed the state) when messages may have become
        # deliverable; the AMQP layer hooks this to wake its reactor.
        self.on_change: Callable[[], None] | None = None
        for q in config.queues:
            self._add_queue(q.path, q.properties)
        for t in config.topics:
            topic = self._add_topic(t.path, t.properties)
            for s in t.subscriptions:
                self._add_subscription(topic, s.name, s.properties)
        if persistence is not None:
            persistence.load(self)

    @property
    def name(self) -> str:
        return self.config.name

    # -- lookup ------------------------------------------------------------------------

    @staticmethod
    def normalize(address: str) -> str:
        """Entity path from a link address (``amqps://host:port/path`` or ``path``)."""
        if "://" in address:
            address = address.split("://", 1)[1]
            address = address.split("/", 1)[1] if "/" in address else ""
        return address.strip("/")

    def send_target(self, address: str) -> SendTarget | None:
        key = self.normalize(address).lower()
        with self.lock:
            return self._queues.get(key) or self._topics.get(key)

    def receive_source(self, address: str) -> Entity | None:
        key = self.normalize(address).lower()
        with self.lock:
            dlq = key.endswith(DLQ_SUFFIX)
            if dlq:
                key = key[: -len(DLQ_SUFFIX)]
            entity = self._queues.get(key)
            if entity is None and SUBSCRIPTIONS_SEGMENT in key:
                topic_key, sub = key.rsplit(SUBSCRIPTIONS_SEGMENT, 1)
                topic = self._topics.get(topic_key)
                entity = topic.subscriptions.get(sub) if topic else None
            if entity is None:
                return None
            return entity.dlq if dlq else entity

    def entity(self, path: str) -> Entity | Topic | None:
        """Any entity: queue, topic, ``<topic>/Subscriptions/<name>``, ``.../$DeadLetterQueue``."""
        with self.lock:
            return self.send_target(path) or self.receive_source(path)

    def all_entities(self) -> list[Entity | Topic]:
        with self.lock:
            out: list[Entity | Topic] = list(self._queues.values())
            for t in self._topics.values():
                out.append(t)
                out.extend(t.subscriptions.values())
            return out

    def _receivables(self) -> Iterable[Entity]:
        for q in self._queues.values():
            yield q
            if q.dlq is not None:
                yield q.dlq
        for t in self._topics.values():
            for s in t.subscriptions.values():
                yield s
                if s.dlq is not None:
                    yield s.dlq

    # -- sending -----------------------------------------------------------------------

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

    # -- receiving ---------------------------------------------------------------------

    def check_receivable(self, entity: Entity) -> None:
        owner = entity.parent or entity
        if owner.props.status in ("Disabled", "ReceiveDisabled"):
            raise BrokerError(
                "com.microsoft:entity-disabled",
                f"Messaging entity '{owner.path}' is currently disabled.",
                403,
            )

    def take(self, entity: Entity, *, lock: bool, now: int | None = None) -> StoredMessage | None:
        """Next message for a receiver: locked (peek-lock) or removed (receive-and-delete)."""
        now = now_ms() if now is None else now
        with self.lock:
            while True:
                msg = entity.pop_ready()
                if msg is None:
                    return None
                if msg.expired(now):
                    self._expire(entity, msg, now)
                    continue
                self.counters.deliveries += 1
                entity.accessed_at = dt.datetime.now(dt.UTC)
                if lock:
                    entity.lock(msg, now)
                else:
                    entity.remove(msg.seq)
                    self._unpersist(entity, msg.seq)
                    self._flush_persistence()
                return msg

    def has_ready(self, entity: Entity) -> bool:
        with self.lock:
            return entity.has_ready()

    def complete(self, entity: Entity, token: uuid.UUID) -> None:
        with self.lock:
            msg = entity.locked(token)
            if msg is None:
                raise lock_lost()
            entity.remove(msg.seq)
            self._unpersist(entity, msg.seq)
            self.counters.completes += 1
            self._flush_persistence()

    def abandon(
        self, entity: Entity, token: uuid.UUID, *, count: bool = True, now: int | None = None
    ) -> bool:
        """Unlock (abandon: delivery count + 1; release: ``count=False``). True if requeued."""
        now = now_ms() if now is None else now
        with self.lock:
            msg = entity.locked(token)
            if msg is None:
                raise lock_lost()
            if count:
                self.counters.abandons += 1
            else:
                self.counters.releases += 1
            requeued = self._unlock_and_requeue(entity, msg, now, count=count)
            self._flush_persistence()
            return requeued

    def _unlock_and_requeue(
        self, entity: Entity, msg: StoredMessage, now: int, *, count: bool
    ) -> bool:
        entity.unlock(msg)
        if count:
            msg.delivery_count += 1
            if entity.kind != "dlq" and msg.delivery_count >= entity.max_delivery_count:
                self._dead_letter(
                    entity,
                    msg,
                    "MaxDeliveryCountExceeded",
                    f"Message could not be consumed after {entity.max_delivery_count} "
                    "delivery attempts.",
                )
                return False
        if msg.state == MessageState.DEFERRED:
            self._persist(entity, msg)
            return False
        if msg.expired(now):
            self._expire(entity, msg, now)
            return False
        entity.make_ready(msg)
        self._persist(entity, msg)
        return True

    def defer(self, entity: Entity, token: uuid.UUID) -> None:
        with self.lock:
            msg = entity.locked(token)
            if msg is None:
                raise lock_lost()
            entity.unlock(msg)
            msg.state = MessageState.DEFERRED
            self.counters.defers += 1
            self._persist(entity, msg)
            self._flush_persistence()

    def dead_letter(
        self, entity: Entity, token: uuid.UUID, reason: str | None, description: str | None
    ) -> None:
        with self.lock:
            msg = entity.locked(token)
            if msg is None:
                raise lock_lost()
            entity.unlock(msg)
            self._dead_letter(entity, msg, reason, description)
            self._flush_persistence()

    def _dead_letter(
        self, entity: Entity, msg: StoredMessage, reason: str | None, description: str | None
    ) -> None:
        entity.remove(msg.seq)
        self._unpersist(entity, msg.seq)
        self.counters.dead_letters += 1
        if entity.dlq is None:  # dead-lettering from a DLQ: Service Bus keeps it there
            msg.state = MessageState.ACTIVE
            entity.add(msg)
            self._persist(entity, msg)
            return
        updates: dict[str, Any] = {}
        if reason is not None:
            updates[DEAD_LETTER_REASON] = reason
        if description is not None:
            updates[DEAD_LETTER_DESCRIPTION] = description
        moved = msg.with_app_properties(updates) if updates else replace(msg)
        moved.state = MessageState.ACTIVE
        moved.lock_token = None
        moved.expires_ms = None  # TTL is not enforced in the dead-letter queue
        moved.scheduled_ms = None
        entity.dlq.add(moved)
        self._persist(entity.dlq, moved)

    def _expire(self, entity: Entity, msg: StoredMessage, now: int) -> None:
        self.counters.expired += 1
        if entity.kind != "dlq" and entity.props.dead_lettering_on_message_expiration:
            self._dead_letter(
                entity,
                msg,
                "TTLExpiredException",
                "The message expired and was dead lettered.",
            )
        else:
            entity.remove(msg.seq)
            self._unpersist(entity, msg.seq)

    def renew(self, entity: Entity, tokens: list[uuid.UUID], now: int | None = None) -> list[int]:
        now = now_ms() if now is None else now
        with self.lock:
            out = []
            for token in tokens:
                msg = entity.locked(token)
                if msg is None or msg.locked_until_ms <= now:
                    raise lock_lost()
                msg.locked_until_ms = now + entity.lock_duration_ms
                out.append(msg.locked_until_ms)
                self.counters.lock_renewals += 1
            return out

    def settle_by_token(
        self,
        entity: Entity,
        status: str,
        tokens: list[uuid.UUID],
        reason: str | None = None,
        description: str | None = None,
    ) -> bool:
        """The update-disposition operation. True if some message became deliverable."""
        ready = False
        for token in tokens:
            if status == "completed":
                self.complete(entity, token)
            elif status == "abandoned":
                ready = self.abandon(entity, token) or ready
            elif status == "defered":
                self.defer(entity, token)
            elif status == "suspended":
                self.dead_letter(entity, token, reason, description)
            else:
                raise BrokerError(
                    "com.microsoft:argument-error", f"Unknown disposition status {status!r}."
                )
        return ready

    def peek(self, entity: Entity, from_seq: int, count: int) -> list[StoredMessage]:
        with self.lock:
            seqs = sorted(s for s in entity.messages if s >= from_seq)[: max(count, 0)]
            return [entity.messages[s] for s in seqs]

    def receive_deferred(
        self, entity: Entity, seqs: list[int], *, lock: bool, now: int | None = None
    ) -> list[StoredMessage]:
        now = now_ms() if now is None else now
        with self.lock:
            out = []
            for seq in seqs:
                msg = entity.messages.get(seq)
                if msg is None or msg.state != MessageState.DEFERRED:
                    raise BrokerError(
                        "com.microsoft:message-not-found",
                        f"Failed to retrieve the deferred message with sequence number {seq}.",
                        404,
                    )
                if msg.lock_token is not None and msg.locked_until_ms > now:
                    raise BrokerError(
                        "com.microsoft:message-lock-lost",
                        f"The deferred message {seq} is locked by another receiver.",
                        410,
                    )
                self.counters.deliveries += 1
                if lock:
                    entity.lock(msg, now)
                else:
                    entity.remove(seq)
                    self._unpersist(entity, seq)
                out.append(msg)
            self._flush_persistence()
            return out

    # -- time --------------------------------------------------------------------------

    def housekeeping(self, now: int | None = None) -> list[Entity]:
        """Expire locks and TTLs, activate scheduled messages; returns entities with news."""
        now = now_ms() if now is None else now
        touched: list[Entity] = []
        with self.lock:
            for entity in list(self._receivables()):
                changed = False
                for msg in entity.expired_locks(now):
                    self.counters.lock_expirations += 1
                    changed = self._unlock_and_requeue(entity, msg, now, count=True) or changed
                for msg in entity.due_scheduled(now):
                    msg.state = MessageState.ACTIVE
                    msg.enqueued_ms = max(now, msg.scheduled_ms or now)
                    entity.make_ready(msg)
                    self._persist(entity, msg)
                    changed = True
                for msg in entity.expired_messages(now):
                    self._expire(entity, msg, now)
                if changed:
                    touched.append(entity)
            self._flush_persistence()
        return touched

    # -- inspection and test support ---------------------------------------------------

    def reset(self) -> None:
        """Drop every message and counter; keep the entities."""
        with self.lock:
            for entity in self._receivables():
                entity.clear()
            for topic in self._topics.values():
                topic.dedup.clear()
                topic.sends = topic.pings = 0
                topic.last_ping_ms = None
            active = self.counters.active_connections
            self.counters = Counters(active_connections=active)
            if self._persistence is not None:
                self._persistence.clear_messages()

    def describe(self, entity: Entity | Topic) -> dict[str, Any]:
        with self.lock:
            if isinstance(entity, Topic):
                return {
                    "path": entity.path,
                    "kind": "topic",
                    "sends": entity.sends,
                    "pings": entity.pings,
                    "last_ping_ms": entity.last_ping_ms,
                    "subscriptions": sorted(s.path for s in entity.subscriptions.values()),
                    "properties": _props_json(entity.props),
                }
            info: dict[str, Any] = {"path": entity.path, "kind": entity.kind}
            info.update(entity.counts())
            if entity.kind != "subscription":
                info["sends"] = entity.sends
                info["pings"] = entity.pings
                info["last_ping_ms"] = entity.last_ping_ms
            info["properties"] = _props_json(entity.props)
            return info

    def notify(self) -> None:
        callback = self.on_change
        if callback is not None:
            callback()

    # -- EntityRegistry ----------------------------------------------------------------

    def list_queues(self) -> list[tuple[str, QueueProperties]]:
        with self.lock:
            return [
                (q.path, q.props)
                for q in self._queues.values()
                if isinstance(q.props, QueueProperties)
            ]

    def get_queue(self, path: str) -> QueueProperties | None:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            return q.props if q is not None and isinstance(q.props, QueueProperties) else None

    def create_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        self._create("queue", path, props, self._add_queue)
        return props

    def update_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            if q is None:
                raise EntityNotFoundError(path)
            q.props = props
            if q.dlq is not None:
                q.dlq.props = props
            if self._persistence is not None:
                self._persistence.save_entity("queue", q.path, props)
            return props

    def delete_queue(self, path: str) -> None:
        with self.lock:
            q = self._queues.pop(path.strip("/").lower(), None)
            if q is None:
                raise EntityNotFoundError(path)
            if self._persistence is not None:
                self._persistence.delete_entity("queue", q.path)

    def queue_runtime(self, path: str) -> RuntimeCounts:
        with self.lock:
            q = self._queues.get(path.strip("/").lower())
            if q is None:
                raise EntityNotFoundError(path)
            return q.runtime()

    def list_topics(self) -> list[tuple[str, TopicProperties]]:
        with self.lock:
            return [(t.path, t.props) for t in self._topics.values()]

    def get_topic(self, path: str) -> TopicProperties | None:
        with self.lock:
            t = self._topics.get(path.strip("/").lower())
            return t.props if t is not None else None

    def create_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        self._create("topic", path, props, self._add_topic)
        return props

    def _create(self, kind: str, path: str, props: _P, add: Callable[[str, _P], object]) -> None:
        """Queues and topics share one namespace of names (case-insensitive)."""
        name = path.strip("/")
        with self.lock:
            if name.lower() in self._queues or name.lower() in self._topics:
                raise EntityExistsError(path)
            add(name, props)
            if self._persistence is not None:
                self._persistence.save_entity(kind, name, props)

    def update_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        with self.lock:
            t = self._topics.get(path.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(path)
            t.props = props
            if self._persistence is not None:
                self._persistence.save_entity("topic", t.path, props)
            return props

    def update_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            if t is None or s is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            s.props = props
            if s.dlq is not None:
                s.dlq.props = props
            if self._persistence is not None:
                self._persistence.save_entity("subscription", s.path, props)
            return props

    def delete_topic(self, path: str) -> None:
        with self.lock:
            t = self._topics.pop(path.strip("/").lower(), None)
            if t is None:
                raise EntityNotFoundError(path)
            if self._persistence is not None:
                self._persistence.delete_entity("topic", t.path)

    def list_subscriptions(self, topic: str) -> list[tuple[str, SubscriptionProperties]]:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(topic)
            return [
                (s.path.rsplit("/", 1)[1], s.props)
                for s in t.subscriptions.values()
                if isinstance(s.props, SubscriptionProperties)
            ]

    def get_subscription(self, topic: str, name: str) -> SubscriptionProperties | None:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            return (
                s.props if s is not None and isinstance(s.props, SubscriptionProperties) else None
            )

    def create_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None:
                raise EntityNotFoundError(topic)
            if name.lower() in t.subscriptions:
                raise EntityExistsError(f"{topic}/Subscriptions/{name}")
            self._add_subscription(t, name, props)
            if self._persistence is not None:
                self._persistence.save_entity(
                    "subscription", f"{t.path}/Subscriptions/{name}", props
                )
            return props

    def delete_subscription(self, topic: str, name: str) -> None:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            if t is None or t.subscriptions.pop(name.lower(), None) is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            if self._persistence is not None:
                self._persistence.delete_entity("subscription", f"{t.path}/Subscriptions/{name}")

    def subscription_runtime(self, topic: str, name: str) -> RuntimeCounts:
        with self.lock:
            t = self._topics.get(topic.strip("/").lower())
            s = t.subscriptions.get(name.lower()) if t is not None else None
            if s is None:
                raise EntityNotFoundError(f"{topic}/Subscriptions/{name}")
            return s.runtime()

    # -- internals ---------------------------------------------------------------------

    def _add_queue(self, path: str, props: QueueProperties) -> Entity:
        q = Entity(path, "queue", props)
        self._queues[path.lower()] = q
        return q

    def _add_topic(self, path: str, props: TopicProperties) -> Topic:
        t = Topic(path, props)
        self._topics[path.lower()] = t
        return t

    def _add_subscription(self, topic: Topic, name: str, props: SubscriptionProperties) -> Entity:
        s = Entity(f"{topic.path}/Subscriptions/{name}", "subscription", props, topic=topic)
        topic.subscriptions[name.lower()] = s
        return s

    def _persist(self, entity: Entity, msg: StoredMessage) -> None:
        if self._persistence is not None:
            self._persistence.upsert(entity.path, msg)

    def _unpersist(self, entity: Entity, seq: int) -> None:
        if self._persistence is not None:
            self._persistence.delete(entity.path, seq)

    def _flush_persistence(self) -> None:
        if self._persistence is not None:
            self._persistence.commit(self)

    def restore_message(self, path: str, msg: StoredMessage) -> None:
        """Durable mode: put a message loaded from disk back (before the broker serves)."""
        entity = self.receive_source(path)
        if entity is None:
            _log.warning("dropping stored message %s of unknown entity %s", msg.seq, path)
            return
        msg.lock_token = None
        entity.add(msg)
        owner: Entity | Topic = entity.parent or entity
        if isinstance(owner, Entity) and owner.topic is not None:
            owner = owner.topic
        owner.next_seq = max(owner.next_seq, msg.seq + 1)

    def sequence_state(self) -> dict[str, int]:
        with self.lock:
            out = {q.path: q.next_seq for q in self._queues.values()}
            out.update({t.path: t.next_seq for t in self._topics.values()})
            return out

    def restore_sequence(self, path: str, next_seq: int) -> None:
        target = self.send_target(path)
        if target is not None:
            target.next_seq = max(target.next_seq, next_seq)

    def close(self) -> None:
        if self._persistence is not None:
            self._persistence.close()


def _timestamp_ms(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return int(value.timestamp() * 1000)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _props_json(props: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(props):
        value = getattr(props, f.name)
        if isinstance(value, dt.timedelta):
            value = None if value >= TIMESPAN_MAX else value.total_seconds()
        out[f.name] = value
    return out
