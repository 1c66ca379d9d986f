"""Session fences, their logic (docs/failover.md#sessions-keep-their-order): one queue per
session, exact counting of acknowledged writes and moves, generations, the lift."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.config import ConfigError, load_settings
from gateway.core.backlog import FENCE_TOKEN, restore, rewrite, session_ranking
from gateway.core.message import OutboundMessage
from gateway.state.fence import Fence, FenceTable, generations, order_found
from gateway.syphon.syphon import fence_stamp

pytestmark = pytest.mark.unit

QUEUES = [f"ns/x-servicebus-transfer/{i}" for i in range(10)]
KEY = ("orders", "s1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_ranks_the_queues_alike_everywhere_and_sessions_spread():
    first = session_ranking("orders", "s1", QUEUES)
    assert first == session_ranking("orders", "s1", list(reversed(QUEUES)))
    assert sorted(first) == sorted(QUEUES)
    # Without one queue, the others keep their order: only its sessions move.
    assert session_ranking("orders", "s1", [q for q in QUEUES if q != first[0]]) == first[1:]
    heads = {session_ranking("orders", f"s{i}", QUEUES)[0] for i in range(200)}
    assert len(heads) == len(QUEUES)
    assert session_ranking("orders", "s1", QUEUES) != session_ranking("invoices", "s1", QUEUES)


def test_the_fence_token_goes_into_the_backlog_and_comes_back_out():
    m = OutboundMessage(body=b"x", message_id="m1", session_id="s1")
    stored = rewrite(m, "orders", 1000.0, "tok1")
    assert stored.application_properties[FENCE_TOKEN] == "tok1" and stored.session_id is None
    back = restore(stored, 1001.0)
    assert back is not None and back.fence_token == "tok1"
    assert back.message.session_id == "s1"
    assert FENCE_TOKEN not in back.message.application_properties


def test_the_fence_lifts_only_when_every_acknowledged_message_is_home():
    t = FenceTable(Clock())
    q, gen, created = t.begin(KEY, "w1", QUEUES, (), deadline=2000.0) or ("", 0, False)
    assert created and gen == 1 and q == QUEUES[0]
    assert t.end(KEY, "w1", ["a", "b"], ok=True) is None
    t.begin(KEY, "w2", QUEUES, (), deadline=2000.0)
    assert t.end(KEY, "w2", ["c"], ok=True) is None
    assert t.moved(KEY, ["a"]) is None and t.moved(KEY, ["b"]) is None
    assert KEY in t.fences
    assert t.moved(KEY, ["c"]) is not None
    assert KEY not in t.fences


def test_a_write_in_flight_holds_the_fence_even_when_every_move_is_counted():
    t = FenceTable(Clock())
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    t.end(KEY, "w1", ["a"], ok=True)
    t.begin(KEY, "w2", QUEUES, (), deadline=2000.0)  # another replica's write, in flight
    assert t.moved(KEY, ["a"]) is None, "lifting now would let w2's message be overtaken"
    assert t.end(KEY, "w2", ["b"], ok=True) is None
    assert t.moved(KEY, ["b"]) is not None


def test_a_move_may_be_counted_before_its_acknowledgement():
    t = FenceTable(Clock())
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    assert t.moved(KEY, ["a"]) is None  # the syphon was faster than the writer's bookkeeping
    assert t.end(KEY, "w1", ["a"], ok=True) is not None


def test_a_write_whose_outcome_is_unknown_does_not_hold_the_fence():
    t = FenceTable(Clock())
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    assert t.end(KEY, "w1", ["a"], ok=False) is not None  # answered 503: never acknowledged


def test_a_dead_replicas_pending_write_stops_holding_at_its_deadline():
    clock = Clock()
    t = FenceTable(clock)
    t.begin(KEY, "w1", QUEUES, (), deadline=1010.0)  # its replica dies: no end
    t.begin(KEY, "w2", QUEUES, (), deadline=1010.0)
    t.end(KEY, "w2", ["b"], ok=True)
    assert t.moved(KEY, ["b"]) is None
    clock.now = 1011.0
    t.begin(KEY, "w3", QUEUES, (), deadline=1030.0)
    t.end(KEY, "w3", ["c"], ok=True)
    assert t.moved(KEY, ["c"]) is not None


def test_a_new_generation_waits_for_the_older_queue():
    t = FenceTable(Clock())
    ranked = session_ranking(*KEY, QUEUES)
    t.begin(KEY, "w1", ranked, (), deadline=2000.0)
    t.end(KEY, "w1", ["a"], ok=True)
    q2, gen, created = t.begin(KEY, "w2", ranked, {ranked[0]}, deadline=2000.0) or ("", 0, True)
    assert (q2, gen, created) == (ranked[1], 2, False), "its queue left rotation: the next one"
    t.end(KEY, "w2", ["b"], ok=True)
    assert not t.may_move(KEY, ranked[1], ["b"]), "b waits while a is in the older queue"
    assert t.may_move(KEY, ranked[0], ["a"])
    t.moved(KEY, ["a"])
    assert t.may_move(KEY, ranked[1], ["b"])
    # Back in rotation, the first queue is not taken again while the fence stands.
    q, _, _ = t.begin(KEY, "w3", ranked, (), deadline=2000.0) or ("", 0, False)
    assert q == ranked[1]


def test_a_receiver_without_the_oldest_message_waits():
    t = FenceTable(Clock())
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    t.end(KEY, "w1", ["a", "b"], ok=True)
    t.begin(KEY, "w2", QUEUES, (), deadline=2000.0)
    t.end(KEY, "w2", ["c"], ok=True)
    # Another syphon holds a and b locked: c must not go first.
    assert not t.may_move(KEY, QUEUES[0], ["c"])
    assert t.may_move(KEY, QUEUES[0], ["a", "b", "c"])
    assert t.may_move(("orders", "unfenced"), QUEUES[3], ["z"])


def test_no_queue_in_rotation_records_nothing():
    t = FenceTable(Clock())
    assert t.begin(KEY, "w1", QUEUES, set(QUEUES), deadline=2000.0) is None
    assert KEY not in t.fences


def test_an_unknown_fence_lifts_only_on_an_empty_backlog():
    t = FenceTable(Clock())
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    t.end(KEY, "w1", ["a"], ok=True)
    t.fences[KEY].unknown = True  # its contents were lost
    assert t.moved(KEY, ["a"]) is None
    assert t.backlog_empty({"invoices"}) == []
    assert [k for k, _ in t.backlog_empty({"orders"})] == [KEY]


def test_the_policy_is_a_setting_and_an_entity_may_override_it(tmp_path):
    cs = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s"
    env = {"SBGATE_PRIMARY_CONNECTION_STRING": cs}
    f = tmp_path / "gw.toml"
    f.write_text(
        '[[entities]]\npath = "a"\n[[entities]]\npath = "b"\nsession_order = "availability"\n'
    )
    s = load_settings(env, f)
    assert s.failover.session_order == "strict"
    assert [e.session_order for e in s.entities] == [None, "availability"]
    assert load_settings(
        {**env, "SBGATE_SESSION_ORDER": "availability"}, f
    ).failover.session_order == ("availability")
    f.write_text('[[entities]]\npath = "a"\nsession_order = "sometimes"\n')
    with pytest.raises(ConfigError, match="session_order"):
        load_settings(env, f)


def test_an_end_that_comes_twice_counts_its_tokens_once():
    table = FenceTable(Clock())
    assert table.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    assert table.begin(KEY, "w2", QUEUES, (), deadline=2000.0)
    table.end(KEY, "w1", ["t1"], ok=True)
    table.moved(KEY, ["t1"])
    table.end(KEY, "w1", ["t1"], ok=True)  # again: its pending entry is gone
    table.end(KEY, "w2", ["t2"], ok=True)
    assert table.moved(KEY, ["t2"]) is not None, "nothing outstanding: the fence lifts"


def test_a_fence_held_only_by_an_expired_write_lifts_when_the_backlog_is_found_empty():
    """A write recorded as pending whose replica never ended it (it died, or its end was
    lost) stops holding the fence at its deadline, but nothing else may ever come to lift
    it: the depth check that finds the backlog empty does."""
    clock = Clock()
    table = FenceTable(clock)
    assert table.begin(KEY, "w1", QUEUES, (), deadline=1010.0)  # never ended
    assert table.begin(KEY, "w2", QUEUES, (), deadline=1010.0)
    table.end(KEY, "w2", ["t2"], ok=True)
    assert table.moved(KEY, ["t2"]) is None, "w1 may still land"
    assert table.backlog_empty(["orders"]) == [], "w1 may still land"
    clock.now = 1011.0
    assert [key for key, _ in table.backlog_empty(["orders"])] == [KEY]
    assert KEY not in table.fences


# -- a fence Redis lost, rebuilt from the backlog -----------------------------------------


def test_the_backlog_order_merges_queues_by_acceptance_and_keeps_each_queues_order():
    found = {
        "qa": [("a0", 10.0), ("a1", 11.0), ("a2", 30.0)],
        "qb": [("b0", 20.0), ("b1", 5.0)],  # a skewed stamp cannot reorder its own queue
    }
    assert order_found(found) == [
        ("a0", "qa"),
        ("a1", "qa"),
        ("b0", "qb"),
        ("b1", "qb"),
        ("a2", "qa"),
    ]
    assert generations(order_found(found)) == [
        ("a0", -3, -5, "qa"),
        ("a1", -3, -4, "qa"),
        ("b0", -2, -3, "qb"),
        ("b1", -2, -2, "qb"),
        ("a2", -1, -1, "qa"),
    ]
    assert order_found({}) == [] and order_found({"qa": []}) == []


def unknown_fence(t: FenceTable) -> None:
    """KEY's fence as a replica writes it back after Redis restarted empty."""
    t.fences[KEY] = Fence(since=999.0, unknown=True)


def test_an_unknown_fence_moves_nothing_until_rebuilt_then_old_messages_go_first():
    t = FenceTable(Clock())
    unknown_fence(t)
    qa, qb = QUEUES[0], QUEUES[1]
    # A new message after the write-back: counted exactly, in generation 1 (queue qa).
    assert t.begin(KEY, "w1", QUEUES, (), deadline=2000.0) == (qa, 1, False)
    assert t.end(KEY, "w1", ["new"], ok=True) is None
    assert t.movable(KEY, qa, ["old0", "new"]) == 0, "unknown: nothing moves"
    assert not t.may_move(KEY, qa, ["old0", "new"])
    assert t.unknown(KEY)
    # The backlog holds old0 (qa), old1 (qb), then "new" (qa); "gone" was moved meanwhile.
    t.moved(KEY, ["gone"])
    old = order_found({qa: [("old0", 1.0), ("new", 9.0)], qb: [("old1", 2.0), ("gone", 3.0)]})
    assert t.rebuild(KEY, old) is None
    assert not t.unknown(KEY)
    assert t.movable(KEY, qb, ["old1"]) == 0, "old0, in qa, goes first"
    assert t.movable(KEY, qa, ["old0", "new"]) == 1, "only up to the later generation"
    assert t.moved(KEY, ["old0"]) is None
    assert t.movable(KEY, qa, ["new"]) == 0, "old1, in qb, before new"
    assert t.movable(KEY, qb, ["old1", None]) == 2
    assert t.moved(KEY, ["old1"]) is None
    assert t.movable(KEY, qa, ["new"]) == 1
    assert t.moved(KEY, ["new"]) is not None, "nothing left: lifted"
    assert KEY not in t.fences


def test_a_rebuild_runs_once_and_one_that_finds_nothing_lifts_the_fence():
    t = FenceTable(Clock())
    unknown_fence(t)
    assert t.rebuild(KEY, []) is not None, "nothing in the backlog holds it"
    assert KEY not in t.fences
    t.begin(KEY, "w1", QUEUES, (), deadline=2000.0)
    t.end(KEY, "w1", ["a"], ok=True)
    assert t.rebuild(KEY, [("x", QUEUES[3])]) is None
    assert t.fences[KEY].tokens == {"a": (1, 1)}, "a known fence is left alone"


def test_a_hostile_stamp_is_an_unstamped_message():
    entities = {"orders"}
    m = OutboundMessage(body=b"x", message_id="m1", session_id="s1")
    good = rewrite(m, "Orders", 1000.0, "tok1")
    assert fence_stamp(good, entities, 1001.0) == ("orders", "s1", "tok1", 1000.0)
    assert fence_stamp(None, entities, 1001.0) is None
    assert fence_stamp(rewrite(m, "other", 1000.0, "tok1"), entities, 1001.0) is None
    assert fence_stamp(rewrite(m, "orders", 1000.0), entities, 1001.0) is None
    for name, value in [
        (FENCE_TOKEN, 7),
        (FENCE_TOKEN, "x" * 500),
        ("x-ms-acceptedtimeutc", "yesterday"),
        ("x-ms-acceptedtimeutc", 10**30),
        ("x-ms-sessionid", b"\x00"),
        ("x-ms-types", "{not json"),
    ]:
        props = {**good.application_properties, name: value}
        hostile = replace(good, application_properties=props)
        assert fence_stamp(hostile, entities, 1001.0) is None, (name, value)


def test_after_a_rebuild_a_receiver_without_the_oldest_message_waits():
    """Two syphon receivers (two replicas) each hold some of S's older messages of one
    queue: only the one holding the oldest moves, then the other."""
    t = FenceTable(Clock())
    unknown_fence(t)
    q = QUEUES[0]
    t.rebuild(KEY, order_found({q: [(f"m{i}", 1.0 + i) for i in range(4)]}))
    assert t.movable(KEY, q, ["m2", "m3"]) == 0, "m0 is held by the other receiver"
    assert t.movable(KEY, q, ["m0", "m1"]) == 2
    t.moved(KEY, ["m0", "m1"])
    assert t.movable(KEY, q, ["m2", "m3"]) == 2
    assert t.moved(KEY, ["m2", "m3"]) is not None
