"""The audit's per-session order check (``--strict-sessions``) with real Spark, on generated
session traffic: planted inversions found exactly and failing the audit, in-order sessions
(a fenced backlog, a duplicate, v1 ledger lines) passing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.job import EXIT_INVERTED, EXIT_OK, JobOptions, run
from pipeline.reconcile import AuditOptions
from pipeline.sessions import INVERSION_KIND
from pipeline.synthetic import SESSION_QUEUE, TOPIC, Expected, SessionPlan, generate

pytestmark = pytest.mark.timeout(600)

STRICT = (SESSION_QUEUE, TOPIC)


class Audit:
    def __init__(self, spark: Any, expected: Expected, root: Path, rc: int) -> None:
        self.spark = spark
        self.expected = expected
        self.root = root
        self.rc = rc
        self.report: dict[str, Any] = json.loads((root / "report" / "report.json").read_text())

    def table(self, name: str) -> list[dict[str, Any]]:
        rows = self.spark.read.parquet(str(self.root / "out" / name)).collect()
        return [r.asDict(recursive=True) for r in rows]


def audit_of(spark: Any, root: Path, plan: SessionPlan, strict: tuple[str, ...] = STRICT) -> Audit:
    expected = generate(root / "in", messages=30, seed=5, plant=False, sessions=plan)
    opts = JobOptions(
        ledger=(str(root / "in" / "ledger"),),
        acks=(str(root / "in" / "acks"),),
        delivered=(str(root / "in" / "delivered"),),
        out=str(root / "out"),
        report_dir=str(root / "report"),
        audit=AuditOptions(grace_seconds=0, strict_sessions=strict),
        charts=False,
    )
    return Audit(spark, expected, root, run(spark, opts))


@pytest.fixture(scope="module")
def inverted(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Audit:
    plan = SessionPlan(sessions=10, per_session=4, inverted=3)
    return audit_of(spark, tmp_path_factory.mktemp("inverted"), plan)


@pytest.fixture(scope="module")
def in_order(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Audit:
    plan = SessionPlan(sessions=10, per_session=4, inverted=0)
    return audit_of(spark, tmp_path_factory.mktemp("in-order"), plan)


def keys(rows: list[dict[str, Any]]) -> set[tuple[str, str, str, str, str]]:
    return {
        (
            r["entity"],
            r["session_id"],
            r["destination"],
            r["earlier_message_id"],
            r["later_message_id"],
        )
        for r in rows
    }


def test_every_planted_inversion_is_found_and_fails_the_audit(inverted: Audit) -> None:
    exp = inverted.expected
    # Three sessions: two on the queue, one on the topic (one inversion per subscription).
    assert len(exp.planted_inversions) == 4
    rows = inverted.table("session_order")
    assert keys(rows) == exp.planted_inversions == set(exp.inversions)
    assert len(rows) == 4
    for r in rows:
        assert r["earlier_ack_seq"] < r["later_ack_seq"]
        assert r["later_position"] < r["earlier_position"]
        assert r["earlier_ack_ts"] < r["later_ack_ts"]
    assert inverted.rc == inverted.report["exit_code"] == EXIT_INVERTED
    order = inverted.report["session_order"]
    assert order["inversions"] == 4
    assert order["inversions_by_entity"] == {SESSION_QUEUE: 2, TOPIC: 2}
    assert order["messages_checked"] == exp.session_messages
    assert order["sessions_checked"] == exp.sessions == 10
    assert len(order["inversion_sample"]) == 4
    assert inverted.report["verdict"] == (
        f"no acknowledged message was lost ({len(exp.classification)} checked); "
        "4 session order INVERSION(S) in strict entities"
    )
    md = (inverted.root / "report" / "report.md").read_text()
    assert "## Session order" in md and "s-000-m1 (seq" in md


def test_each_inversion_is_an_error_anomaly(inverted: Audit) -> None:
    anomalies = [a for a in inverted.table("anomalies") if a["kind"] == INVERSION_KIND]
    assert sorted((a["entity"], a["message_id"]) for a in anomalies) == sorted(
        (e, later) for e, _, _, _, later in inverted.expected.inversions
    )
    assert {a["severity"] for a in anomalies} == {"error"}
    by_kind = inverted.report["anomalies"]["by_kind"]
    assert by_kind[INVERSION_KIND] == {"severity": "error", "count": 4}


def test_in_order_sessions_pass(in_order: Audit) -> None:
    exp = in_order.expected
    assert exp.inversions == []
    assert in_order.table("session_order") == []
    assert in_order.rc == EXIT_OK, in_order.report["verdict"]
    order = in_order.report["session_order"]
    assert (order["inversions"], order["messages_checked"]) == (0, exp.session_messages)
    assert in_order.report["verdict"].endswith(
        f"session order kept ({exp.session_messages} message(s) in 10 session(s) of strict "
        "entities checked)"
    )
    # The fenced sessions went through a backlog, and one message was stored twice: a
    # duplicate (a warning), never an inversion.
    assert in_order.report["backlog"]["syphoned"] == exp.syphoned > 0
    messages = {(r["entity"], r["message_id"]): r for r in in_order.table("messages")}
    assert messages[(SESSION_QUEUE, "s-000-m0")]["classification"] == "duplicated"
    assert exp.counts() == {"delivered": 4 * 10 + 30 - 1, "duplicated": 1}


def test_only_the_strict_entities_are_checked(spark: Any, inverted: Audit, tmp_path: Path) -> None:
    """The same data with only the queue strict: the topic's inversions are not judged."""
    del inverted  # after the module's other runs: the JVM is warm
    plan = SessionPlan(sessions=10, per_session=4, inverted=3)
    queue_only = audit_of(spark, tmp_path / "queue", plan, strict=(SESSION_QUEUE,))
    assert {r["entity"] for r in queue_only.table("session_order")} == {SESSION_QUEUE}
    assert queue_only.report["session_order"]["inversions"] == 2
    assert queue_only.rc == EXIT_INVERTED
