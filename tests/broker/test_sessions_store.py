"""Pure-logic tests of the store's sessions: which session is next, the session lock's
life (accept, renew, release, expiry) and what happens to the messages it held."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
from proton import Message

from sblocal import codec
from sblocal.config import NamespaceConfig, QueueConfig
from sblocal.entities import QueueProperties
from sblocal.persistence import Persistence
from sblocal.store import BrokerError, Entity, Namespace

pytestmark = pytest.mark.unit

NOW = 1_000_000


def session_ns() -> tuple[Namespace, Entity]:
    props = QueueProperties(requires_session=True, lock_duration=dt.timedelta(seconds=10))
    ns = Namespace(NamespaceConfig(name="t", keys=(), queues=(QueueConfig("q", props),)))
    q = ns.receive_source("q")
    assert q is not None
    return ns, q


def send(ns: Namespace, session: str, body: str) -> int:
    raw = bytes(Message(body=body, group_id=session).encode())
    target = ns.send_target("q")
    assert target is not None
    [seq] = ns.enqueue(target, [codec.parse_message(raw)], [len(raw)], now=NOW).sequence_numbers
    return seq


def test_next_available_is_the_unlocked_session_with_the_oldest_message() -> None:
    ns, q = session_ns()
    for session in ("b", "a", "b", "c"):
        send(ns, session, session)
    first, second = uuid.uuid4(), uuid.uuid4()
    assert ns.accept_session(q, None, first, now=NOW) == ("b", NOW + 10_000)
    assert ns.accept_session(q, None, second, now=NOW) == ("a", NOW + 10_000)
    assert ns.accept_session(q, None, uuid.uuid4(), now=NOW) == ("c", NOW + 10_000)
    assert ns.accept_session(q, None, uuid.uuid4(), now=NOW) is None
    with pytest.raises(BrokerError) as refused:
        ns.accept_session(q, "b", uuid.uuid4(), now=NOW)
    assert refused.value.condition == "com.microsoft:session-cannot-be-locked"


def test_a_holder_takes_its_session_only_and_in_order() -> None:
    ns, q = session_ns()
    for i in range(3):
        send(ns, "a", f"a{i}")
        send(ns, "b", f"b{i}")
    owner = uuid.uuid4()
    ns.accept_session(q, "b", owner, now=NOW)
    assert ns.take(q, lock=True, now=NOW, session="b", owner=uuid.uuid4()) is None  # not ours
    taken = [ns.take(q, lock=True, now=NOW, session="b", owner=owner) for _ in range(4)]
    assert [m.seq if m else None for m in taken] == [2, 4, 6, None]
    assert all(m.locked_until_ms == NOW + 10_000 for m in taken if m)
    assert "b" not in q._session_ready  # a drained session keeps no heap


def test_release_puts_messages_back_uncounted_and_frees_the_session() -> None:
    ns, q = session_ns()
    send(ns, "a", "a0")
    owner = uuid.uuid4()
    ns.accept_session(q, "a", owner, now=NOW)
    m = ns.take(q, lock=True, now=NOW, session="a", owner=owner)
    assert m is not None
    assert not ns.release_session(q, "a", uuid.uuid4(), now=NOW)  # not the holder: no-op
    assert ns.release_session(q, "a", owner, now=NOW)
    assert m.lock_token is None and m.delivery_count == 0
    assert ns.accept_session(q, None, uuid.uuid4(), now=NOW) == ("a", NOW + 10_000)


def test_renewal_extends_the_session_and_its_messages_and_expiry_counts_them() -> None:
    ns, q = session_ns()
    send(ns, "a", "a0")
    owner = uuid.uuid4()
    ns.accept_session(q, "a", owner, now=NOW)
    m = ns.take(q, lock=True, now=NOW, session="a", owner=owner)
    assert m is not None
    assert ns.renew_session(q, "a", now=NOW + 5_000) == NOW + 15_000
    assert m.locked_until_ms == NOW + 15_000
    assert ns.housekeeping(NOW + 12_000) == []  # the renewed message lock holds
    assert ns.expire_sessions(NOW + 12_000) == ([], [])
    ns.housekeeping(NOW + 15_000)
    assert ns.expire_sessions(NOW + 15_000) == ([owner], [q])
    assert m.lock_token is None and m.delivery_count == 1
    with pytest.raises(BrokerError) as lost:
        ns.renew_session(q, "a", now=NOW + 15_000)
    assert lost.value.condition == "com.microsoft:session-lock-lost"


def test_session_state_needs_the_lock_and_outlives_it() -> None:
    ns, q = session_ns()
    with pytest.raises(BrokerError):
        ns.set_session_state(q, "a", b"x", now=NOW)
    owner = uuid.uuid4()
    ns.accept_session(q, "a", owner, now=NOW)
    ns.set_session_state(q, "a", b"x", now=NOW)
    ns.release_session(q, "a", owner, now=NOW)
    ns.accept_session(q, "a", uuid.uuid4(), now=NOW)
    assert ns.session_state(q, "a", now=NOW) == b"x"


def test_plain_entities_and_dead_letter_queues_have_no_sessions() -> None:
    ns = Namespace(NamespaceConfig(name="t", keys=(), queues=(QueueConfig("plain"),)))
    plain = ns.receive_source("plain")
    _, q = session_ns()
    assert plain is not None and q.dlq is not None
    assert not plain.sessionful and not q.dlq.sessionful and q.sessionful
    with pytest.raises(BrokerError) as refused:
        ns.accept_session(plain, "a", uuid.uuid4(), now=NOW)
    assert refused.value.condition == "amqp:not-allowed"


def test_a_lapsed_lock_taken_over_before_housekeeping_still_reports_its_owner_lost() -> None:
    ns, q = session_ns()
    send(ns, "a", "a0")
    old, new = uuid.uuid4(), uuid.uuid4()
    ns.accept_session(q, "a", old, now=NOW)
    m = ns.take(q, lock=True, now=NOW, session="a", owner=old)
    assert m is not None
    later = NOW + 10_001  # lapsed; housekeeping has not run yet
    assert ns.accept_session(q, "a", new, now=later) == ("a", later + 10_000)
    assert m.lock_token is None and m.delivery_count == 1  # swept as lapsed
    assert ns.expire_sessions(later) == ([old], [])
    assert ns.take(q, lock=True, now=later, session="a", owner=new) is m


def test_durable_mode_keeps_session_messages_in_order_and_frees_every_session(
    tmp_path: Path,
) -> None:
    props = QueueProperties(requires_session=True)
    cfg = NamespaceConfig(name="t", keys=(), queues=(QueueConfig("q", props),))
    db = tmp_path / "t.sqlite3"
    ns = Namespace(cfg, persistence=Persistence(db))
    for i in range(3):
        send(ns, "a", f"a{i}")
        send(ns, "b", f"b{i}")
    q = ns.receive_source("q")
    assert q is not None
    ns.accept_session(q, "a", uuid.uuid4(), now=NOW)
    ns.close()

    again = Namespace(cfg, persistence=Persistence(db))
    q2 = again.receive_source("q")
    assert q2 is not None
    owner = uuid.uuid4()
    assert again.accept_session(q2, "a", owner, now=NOW) == ("a", NOW + 60_000)  # lock gone
    taken = [again.take(q2, lock=True, now=NOW, session="a", owner=owner) for _ in range(3)]
    assert [m.seq for m in taken if m] == [1, 3, 5]
    again.close()
