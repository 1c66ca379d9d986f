"""What messages live in: a queue, subscription or dead-letter queue (`Entity`), a topic.

Plain bookkeeping (heaps of ready, scheduled, locked and expiring messages) with no lock of
its own: the owning `Namespace` holds its lock around every call.

A session-enabled queue or subscription keeps one ready heap per session instead of one for
the entity, so that a session receiver pops its own session's next message in sequence
order without scanning the others; its session locks and session states live here too.
"""

from __future__ import annotations

import datetime as dt
import heapq
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from sblocal.entities import (
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.store.messages import MessageState, StoredMessage, duration_ms

EntityKind = Literal["queue", "topic", "subscription", "dlq"]


@dataclass(slots=True)
class SessionLock:
    """Who holds a session (an id the receiver link keeps) and until when."""

    owner: uuid.UUID
    locked_until_ms: int


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
        # requires_session cannot change once an entity exists; its dead-letter queue is
        # read by plain receivers, as on Service Bus.
        self.sessionful = kind != "dlq" and props.requires_session
        self._ready: list[int] = []  # heap of sequence numbers that may be deliverable
        # sessionful entities: session id -> heap of its sequence numbers that may be ready
        self._session_ready: dict[str, list[int]] = {}
        self.session_locks: dict[str, SessionLock] = {}
        self.session_states: dict[str, bytes] = {}
        self.session_state_updated: dict[str, int] = {}  # session id -> last set (ms)
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
            self._push_ready(msg)
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
        self._push_ready(msg)
        if msg.expires_ms is not None:
            heapq.heappush(self._expiry_heap, (msg.expires_ms, msg.seq))

    def _push_ready(self, msg: StoredMessage) -> None:
        if self.sessionful and msg.session_id is not None:
            heapq.heappush(self._session_ready.setdefault(msg.session_id, []), msg.seq)
        else:
            heapq.heappush(self._ready, msg.seq)

    def lock(self, msg: StoredMessage, now: int, *, until: int | None = None) -> uuid.UUID:
        token = uuid.uuid4()
        msg.lock_token = token
        msg.locked_until_ms = now + self.lock_duration_ms if until is None else until
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

    def _heap(self, session: str | None) -> list[int] | None:
        return self._ready if session is None else self._session_ready.get(session)

    def _deliverable(self, seq: int) -> StoredMessage | None:
        msg = self.messages.get(seq)
        if msg is not None and msg.state == MessageState.ACTIVE and msg.lock_token is None:
            return msg
        return None

    def pop_ready(self, session: str | None = None) -> StoredMessage | None:
        """The next deliverable message (lowest sequence number), not yet locked: of the
        entity, or of one session of a sessionful entity."""
        heap = self._heap(session)
        msg = None
        while heap and msg is None:
            msg = self._deliverable(heapq.heappop(heap))
        if session is not None and heap is not None and not heap:
            del self._session_ready[session]  # a finished session costs nothing
        return msg

    def has_ready(self, session: str | None = None) -> bool:
        heap = self._heap(session)
        while heap:
            if self._deliverable(heap[0]) is not None:
                return True
            heapq.heappop(heap)
        if session is not None and heap is not None:
            del self._session_ready[session]
        return False

    # -- sessions ----------------------------------------------------------------------

    def session_holder(self, session: str, now: int) -> SessionLock | None:
        """The live lock on `session`, if any (an expired one counts as none)."""
        held = self.session_locks.get(session)
        if held is None or held.locked_until_ms <= now:
            return None
        return held

    def available_session(self, now: int) -> str | None:
        """The unlocked session with a deliverable message, oldest first message first."""
        best: tuple[int, str] | None = None
        for session in list(self._session_ready):
            if self.session_holder(session, now) is not None or not self.has_ready(session):
                continue
            first = self._session_ready[session][0]
            if best is None or first < best[0]:
                best = (first, session)
        return None if best is None else best[1]

    def session_messages_locked(self, session: str) -> list[StoredMessage]:
        """The messages of `session` that are locked now (delivered, not yet settled)."""
        out = []
        for seq in list(self.locks.values()):
            msg = self.messages.get(seq)
            if msg is not None and msg.session_id == session and msg.lock_token is not None:
                out.append(msg)
        return out

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
        self._session_ready.clear()
        self.session_locks.clear()
        self.session_states.clear()
        self.session_state_updated.clear()
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
