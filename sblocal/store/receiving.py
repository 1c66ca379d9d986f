"""Receiving: peek-lock and receive-and-delete, settlement, locks, dead-lettering, expiry.

Peek-lock with the entity's lock duration; abandon counts a delivery and MaxDeliveryCount
moves a message to the dead-letter queue; deferral; TTL never expires a locked message.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import replace
from typing import Any

from sblocal.store.base import NamespaceBase
from sblocal.store.entity import Entity
from sblocal.store.messages import (
    DEAD_LETTER_DESCRIPTION,
    DEAD_LETTER_REASON,
    BrokerError,
    MessageState,
    StoredMessage,
    lock_lost,
    now_ms,
)


class Receiving(NamespaceBase):
    """The receive side of a `Namespace`."""

    def check_receivable(self, entity: Entity) -> None:
        owner = entity.parent or entity
        if owner.props.status in ("Disabled", "ReceiveDisabled"):
            raise BrokerError(
                "com.microsoft:entity-disabled",
                f"Messaging entity '{owner.path}' is currently disabled.",
                403,
            )

    def take(
        self,
        entity: Entity,
        *,
        lock: bool,
        now: int | None = None,
        session: str | None = None,
        owner: uuid.UUID | None = None,
    ) -> StoredMessage | None:
        """Next message for a receiver: locked (peek-lock) or removed (receive-and-delete).

        A session receiver names its `session` and the `owner` id it accepted it with: it
        gets that session's next message only while it holds the session lock, and the
        message lock lasts as long as the session lock (a renewal extends both)."""
        now = now_ms() if now is None else now
        with self.lock:
            until: int | None = None
            if session is not None:
                held = entity.session_holder(session, now)
                if held is None or held.owner != owner:
                    return None
                until = held.locked_until_ms
            while True:
                msg = entity.pop_ready(session)
                if msg is None:
                    return None
                if msg.expired(now):
                    self._expire(entity, msg, now)
                    continue
                self.counters.deliveries += 1
                entity.accessed_at = dt.datetime.now(dt.UTC)
                if lock:
                    entity.lock(msg, now, until=until)
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

    def peek(
        self, entity: Entity, from_seq: int, count: int, session: str | None = None
    ) -> list[StoredMessage]:
        """Messages from `from_seq` on, in every state (of one session when named)."""
        with self.lock:
            seqs = sorted(
                s
                for s, m in entity.messages.items()
                if s >= from_seq and (session is None or m.session_id == session)
            )
            return [entity.messages[s] for s in seqs[: max(count, 0)]]

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
