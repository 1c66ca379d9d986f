"""What counts as a per-session inversion (pipeline.ordering, plain Python), the option that
names the strict entities, and the verdict line's session part."""

from __future__ import annotations

import pytest

from pipeline.job import parse_args
from pipeline.ordering import Inversion, first_ack, first_stored, inversions
from pipeline.report import verdict
from pipeline.sessions import strict_keys


def pairs(found: list[Inversion]) -> list[tuple[str, str]]:
    return [(i.earlier, i.later) for i in found]


def test_in_order_has_no_inversion() -> None:
    acked = {"a": 1, "b": 2, "c": 3}
    assert inversions(acked, {"a": 10, "b": 11, "c": 15}) == []


def test_a_message_that_waited_in_a_backlog_is_one_inversion() -> None:
    # b waited in a backlog while c, d, e went home: the consumer gets c before b.
    acked = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}
    found = inversions(acked, {"a": 1, "c": 2, "d": 3, "e": 4, "b": 5})
    assert found == [Inversion("b", "c", 2, 3, 5, 2)]


def test_a_message_that_overtook_a_run_is_one_inversion() -> None:
    acked = {"a": 1, "b": 2, "c": 3, "d": 4}
    assert pairs(inversions(acked, {"d": 1, "a": 2, "b": 3, "c": 4})) == [("c", "d")]


def test_every_descent_is_reported() -> None:
    acked = {"a": 1, "b": 2, "c": 3, "d": 4}
    assert pairs(inversions(acked, {"a": 4, "b": 3, "c": 2, "d": 1})) == [
        ("a", "b"),
        ("b", "c"),
        ("c", "d"),
    ]


def test_a_duplicate_counts_by_its_first_stored_copy() -> None:
    # b stored twice (an outcome-unknown send retried): its second copy comes after c.
    stored = first_stored([("a", 1), ("b", 2), ("c", 3), ("b", 4)])
    assert stored == {"a": 1, "b": 2, "c": 3}
    assert inversions({"a": 1, "b": 2, "c": 3}, stored) == []


def test_the_first_acceptance_orders_a_retried_message() -> None:
    assert first_ack([("a", 5), ("b", 3), ("a", 2)]) == {"a": 2, "b": 3}


def test_messages_not_at_home_are_left_out_and_ties_are_not_ordered() -> None:
    acked = {"a": 1, "b": 2, "c": 3}
    # b is not at home (in a backlog, lost): a and c are compared with each other.
    assert inversions(acked, {"a": 2, "c": 1}) == [Inversion("a", "c", 1, 3, 2, 1)]
    # Same acknowledgement key: which came first is unknown, so never an inversion.
    assert inversions({"a": 7, "b": 7}, {"a": 2, "b": 1}) == []


def test_strict_sessions_option() -> None:
    assert strict_keys(["Payments, /events/", "payments", ""]) == ("payments", "events")
    opts = parse_args(
        ["--ledger", "l", "--delivered", "d", "--out", "o", "--strict-sessions", "Orders,events"]
    )
    assert opts.audit.strict_sessions == ("orders", "events")
    star = parse_args(["--ledger", "l", "--delivered", "d", "--out", "o", "--strict-sessions=*"])
    assert star.audit.strict_sessions == ("*",)
    assert (
        parse_args(["--ledger", "l", "--delivered", "d", "--out", "o"]).audit.strict_sessions == ()
    )


@pytest.mark.parametrize(
    ("lost", "order", "expected"),
    [
        (0, None, "no acknowledged message was lost (9 checked)"),
        (
            0,
            "2 session order INVERSION(S) in strict entities",
            "no acknowledged message was lost (9 checked); 2 session order INVERSION(S) in "
            "strict entities",
        ),
        (
            1,
            "session order kept (8 message(s) in 2 session(s) of strict entities checked)",
            "1 acknowledged message(s) LOST; session order kept (8 message(s) in 2 session(s) "
            "of strict entities checked)",
        ),
    ],
)
def test_the_verdict_says_the_session_order(lost: int, order: str | None, expected: str) -> None:
    assert verdict(lost=lost, pending=0, promised=9, grace_seconds=60, order=order) == expected
