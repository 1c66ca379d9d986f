"""Message sessions: accepting a session (by id or the next available one), the session
lock (one holder, renewable, released on close, expiring after the lock duration), the
session state, and the list of an entity's sessions.

A session receiver is identified by an `owner` id its link keeps. While it holds the lock
it is the only receiver of the session's messages, and the messages it was given stay
locked as long as the session lock does. When the lock goes — released by the receiver or
expired — the session's unsettled messages become deliverable again, to whoever accepts the
session next: released without a delivery count, expired with one (like a lapsed message
lock). Session locks and states are not written to disk in durable mode.
"""

from __future__ import annotations

import uuid

from sblocal.store.entity import Entity, SessionLock
from sblocal.store.messages import BrokerError, MessageState, now_ms
from sblocal.store.receiving import Receiving


def session_cannot_be_locked(session: str) -> BrokerError:
    return BrokerError(
        "com.microsoft:session-cannot-be-locked",
        f"The requested session '{session}' cannot be accepted. It may be locked by another "
        "receiver.",
        410,
    )


def session_lock_lost(session: str) -> BrokerError:
    return BrokerError(
        "com.microsoft:session-lock-lost",
        f"The session lock has expired on the session '{session}'. Accept a new session.",
        410,
    )


def not_sessionful(entity: Entity) -> BrokerError:
    return BrokerError(
        "amqp:not-allowed",
        f"It is not possible for an entity that does not require sessions ('{entity.path}') "
        "to create a session receiver or run a session operation.",
        400,
    )


class Sessions(Receiving):
    """The session side of a `Namespace`."""

    def accept_session(
        self, entity: Entity, session: str | None, owner: uuid.UUID, now: int | None = None
    ) -> tuple[str, int] | None:
        """Lock `session` (or, when None, the next available one) for `owner`.

        Returns the session id and its locked-until time (ms), or None when no session is
        available. Raises `BrokerError` when the named session is held by another receiver
        or the entity has no sessions."""
        now = now_ms() if now is None else now
        with self.lock:
            if not entity.sessionful:
                raise not_sessionful(entity)
            if session is None:
                session = entity.available_session(now)
                if session is None:
                    return None
            elif entity.session_holder(session, now) is not None:
                raise session_cannot_be_locked(session)
            lapsed = entity.session_locks.get(session)
            if lapsed is not None:  # lapsed, not yet swept by housekeeping: sweep it now
                self._lapse(entity, session, lapsed, now)
                self._lost_session_owners.append(lapsed.owner)
            held = SessionLock(owner, now + entity.lock_duration_ms)
            entity.session_locks[session] = held
            return session, held.locked_until_ms

    def release_session(
        self, entity: Entity, session: str, owner: uuid.UUID, now: int | None = None
    ) -> bool:
        """`owner` lets `session` go (its link closed); its unsettled messages are put back
        without a delivery count. True if the session has deliverable messages."""
        now = now_ms() if now is None else now
        with self.lock:
            held = entity.session_locks.get(session)
            if held is None or held.owner != owner:
                return False
            del entity.session_locks[session]
            for msg in entity.session_messages_locked(session):
                self._unlock_and_requeue(entity, msg, now, count=False)
            self._flush_persistence()
            return entity.has_ready(session)

    def renew_session(self, entity: Entity, session: str, now: int | None = None) -> int:
        """Extend the lock on `session` (and on the messages it holds) by the lock duration;
        returns the new locked-until time (ms). Raises session-lock-lost when not held."""
        now = now_ms() if now is None else now
        with self.lock:
            held = self._held(entity, session, now)
            held.locked_until_ms = now + entity.lock_duration_ms
            for msg in entity.session_messages_locked(session):
                msg.locked_until_ms = held.locked_until_ms
            self.counters.lock_renewals += 1
            return held.locked_until_ms

    def expire_sessions(self, now: int | None = None) -> tuple[list[uuid.UUID], list[Entity]]:
        """Drop every session lock that lapsed: the owners that lost their session, and the
        entities whose messages became deliverable (the session's unsettled messages come
        back with a delivery count, like a lapsed message lock)."""
        now = now_ms() if now is None else now
        owners: list[uuid.UUID] = []
        touched: list[Entity] = []
        with self.lock:
            owners.extend(self._lost_session_owners)
            self._lost_session_owners.clear()
            for entity in self._receivables():
                if not entity.session_locks:
                    continue
                for session, held in list(entity.session_locks.items()):
                    if held.locked_until_ms <= now:
                        self._lapse(entity, session, held, now)
                        owners.append(held.owner)
                        touched.append(entity)
            self._flush_persistence()
        return owners, touched

    def _lapse(self, entity: Entity, session: str, held: SessionLock, now: int) -> None:
        del entity.session_locks[session]
        for msg in entity.session_messages_locked(session):
            self.counters.lock_expirations += 1
            self._unlock_and_requeue(entity, msg, now, count=True)

    def session_state(self, entity: Entity, session: str, now: int | None = None) -> bytes | None:
        now = now_ms() if now is None else now
        with self.lock:
            self._held(entity, session, now)
            return entity.session_states.get(session)

    def set_session_state(
        self, entity: Entity, session: str, state: bytes | None, now: int | None = None
    ) -> None:
        now = now_ms() if now is None else now
        with self.lock:
            self._held(entity, session, now)
            if state is None:
                entity.session_states.pop(session, None)
            else:
                entity.session_states[session] = state
            entity.session_state_updated[session] = now

    def list_sessions(
        self, entity: Entity, updated_after_ms: int | None, skip: int, top: int
    ) -> list[str]:
        """A page of the entity's session ids, sorted: with `updated_after_ms` None the
        sessions that have messages (scheduled ones aside) or a state, else those whose
        state was set after that time."""
        with self.lock:
            if not entity.sessionful:
                raise not_sessionful(entity)
            if updated_after_ms is None:
                ids = {
                    m.session_id
                    for m in entity.messages.values()
                    if m.session_id is not None and m.state != MessageState.SCHEDULED
                }
                ids.update(entity.session_states)
            else:
                ids = {s for s, t in entity.session_state_updated.items() if t > updated_after_ms}
            return sorted(ids)[max(skip, 0) : max(skip, 0) + max(top, 0)]

    def _held(self, entity: Entity, session: str, now: int) -> SessionLock:
        """The live lock on `session`: session operations need one, as on Service Bus."""
        if not entity.sessionful:
            raise not_sessionful(entity)
        held = entity.session_holder(session, now)
        if held is None:
            raise session_lock_lost(session)
        return held
