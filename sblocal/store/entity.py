"""What messages live in: a queue, subscription or dead-letter queue (`Entity`), a topic.

Plain bookkeeping (heaps of ready, scheduled, locked and expiring messages) with no lock of
its own: the owning `Namespace` holds its lock around every call.
"""

from __future__ import annotations

import datetime as dt
import heapq
import uuid
from collections import OrderedDict
from typing import Literal

from sblocal.entities import (
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.store.messages import MessageState, StoredMessage, duration_ms

EntityKind = Literal["queue", "topic", "subscription", "dlq"]


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
        return duration_ms(props.duplicate_detection_history_time_window)

    @property
    def lock_duration_ms(self) -> int:
        return duration_ms(self.props.lock_duration)

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
        return duration_ms(self.props.duplicate_detection_history_time_window)


SendTarget = Entity | Topic
