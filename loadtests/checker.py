"""The checker: after a run, classify every message id, Jepsen-style.

Inputs: the client acknowledgement files (see `loadtests.acks`) and what a drain of the
primary entities, every backlog queue and every dead-letter queue delivered.

Per id (all attempts of an id taken together):

* **acknowledged** — at least one attempt was answered 2xx. Then it is
  *delivered* (found at least once), **lost** (found nowhere — must be 0), *expired* (found
  only in a dead-letter queue with a TTL reason — allowed), *dead-lettered* (found only in a
  dead-letter queue for another reason), *in backlog* (still waiting in a backlog queue:
  delivered to the system but not yet syphoned home), and **duplicated** when the primary
  holds it more than once (or, with no copy at the primary, a backlog does) — with duplicate
  detection on at the primary, must be 0.
* **backlog shadow** — a copy at the primary *and* a copy left in a backlog queue (or its
  dead-letter queue). This is the ambiguous primary send: the broker stored the message but
  the gateway saw the send fail (a cut connection, a timeout) and stored it in a backlog too.
  The syphon's move of the shadow is dropped by the primary's duplicate detection, so a
  consumer sees it once; a shadow left behind (no syphon, or expired first) is reported but
  allowed.
* **unexpected** — delivered but never acknowledged. Allowed only when some attempt of that id
  had no definite answer (`indeterminate`, or a 5xx `failed` after a send was tried, whose
  outcome the gateway itself cannot know); otherwise it is a **violation** (the gateway said
  "not stored" and stored it).
* delivered ids that no client ever sent are **phantoms** (violations) unless the scenario
  injected them itself (`injected`).
* **misrouted**: acknowledged for one entity, delivered to another (violation).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.core.backlog import is_backlog_path
from loadtests.acks import Ack

TTL_REASONS = frozenset({"TTLExpiredException", "TTLExpired", "MessageExpired"})


@dataclass
class Verdict:
    """Counts per class, plus examples of each violation (for the report)."""

    acked: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0  # ids found more than once (see the module docstring)
    extra_copies: int = 0  # copies beyond the first
    backlog_shadows: int = 0  # a copy at the primary and another left in a backlog
    unexpected: int = 0  # delivered, never acknowledged, with an unknown outcome (allowed)
    unexpected_violations: int = 0  # delivered after a definite "not stored"
    phantoms: int = 0
    misrouted: int = 0
    expired: int = 0
    dead_lettered: int = 0
    in_backlog: int = 0
    not_acked: int = 0  # ids never acknowledged (and not delivered)
    attempts: int = 0  # ack lines
    status_5xx: int = 0  # ack lines (messages) answered 5xx
    status_4xx: int = 0
    indeterminate: int = 0  # ack lines without an answer
    routes: dict[str, int] = field(default_factory=dict)  # acked ids by final route
    p50_ms: float | None = None
    p99_ms: float | None = None
    examples: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values.sort()
    k = max(0, min(len(values) - 1, math.ceil(q * len(values)) - 1))
    return round(values[k], 1)


def in_backlog(record: dict[str, Any]) -> bool:
    """Found in a backlog queue (or its DLQ)? Judged by the path drained, so that records of
    either drain (ours, or `gateway drain`, whose DLQ records say ``source: dlq``) work."""
    return is_backlog_path(str(record.get("queue", "")))


def is_dlq(record: dict[str, Any]) -> bool:
    return str(record.get("queue", "")).lower().endswith("/$deadletterqueue")


def _entity_of(record: dict[str, Any]) -> str:
    e = str(record.get("entity") or "")
    # A subscription delivery belongs to its topic.
    return e.split("/Subscriptions/", 1)[0].split("/subscriptions/", 1)[0].lower()


def _count_copies(
    v: Verdict, mid: str, found: list[dict[str, Any]], note: Callable[[str, str], None]
) -> None:
    at_primary = sum(1 for r in found if not in_backlog(r))
    in_backlogs = len(found) - at_primary
    copies = at_primary if at_primary else in_backlogs
    if copies > 1:
        v.duplicated += 1
        v.extra_copies += copies - 1
        note("duplicated", mid)
    if at_primary and in_backlogs:
        v.backlog_shadows += 1
        note("backlog_shadow", mid)


@dataclass
class _Sent:
    """What the acknowledgements say was sent, and how each attempt ended."""

    entity: dict[str, str] = field(default_factory=dict)  # acked id -> entity (lower case)
    route: dict[str, str | None] = field(default_factory=dict)  # acked id -> route
    unknown_outcome: set[str] = field(default_factory=set)  # indeterminate or failed
    ids: set[str] = field(default_factory=set)  # every id sent


def _tally(acks: Iterable[Ack], v: Verdict) -> _Sent:
    sent = _Sent()
    latencies: list[float] = []
    for a in acks:
        v.attempts += 1
        sent.ids.add(a.message_id)
        if a.status is not None and a.status >= 500:
            v.status_5xx += 1
        elif a.status is not None and 400 <= a.status < 500:
            v.status_4xx += 1
        if a.outcome == "indeterminate":
            v.indeterminate += 1
        if a.outcome in ("indeterminate", "failed"):
            sent.unknown_outcome.add(a.message_id)
        if a.latency_ms is not None:
            latencies.append(a.latency_ms)
        if a.outcome == "acked":
            sent.entity[a.message_id] = a.entity.lower()
            sent.route[a.message_id] = a.route
    v.p50_ms = _percentile(latencies, 0.50)
    v.p99_ms = _percentile(latencies, 0.99)
    return sent


def _check_acked(
    v: Verdict,
    sent: _Sent,
    copies: dict[str, list[dict[str, Any]]],
    note: Callable[[str, str], None],
) -> None:
    """Every acknowledged message: delivered once, to its entity, live or expired."""
    v.acked = len(sent.entity)
    routes: Counter[str] = Counter()
    for mid, entity in sent.entity.items():
        routes[sent.route.get(mid) or "?"] += 1
        found = copies.get(mid, [])
        if not found:
            v.lost += 1
            note("lost", mid)
            continue
        v.delivered += 1
        _count_copies(v, mid, found, note)
        if any(_entity_of(r) != entity for r in found):
            v.misrouted += 1
            note("misrouted", mid)
        dlq = [r for r in found if is_dlq(r)]
        live = [r for r in found if r not in dlq]
        if not live:
            if all(r.get("dead_letter_reason") in TTL_REASONS for r in dlq):
                v.expired += 1
            else:
                v.dead_lettered += 1
                note("dead_lettered", mid)
        elif all(in_backlog(r) for r in live):
            v.in_backlog += 1
    v.routes = dict(routes)


def _check_unacked(
    v: Verdict,
    sent: _Sent,
    copies: dict[str, list[dict[str, Any]]],
    injected: set[str],
    note: Callable[[str, str], None],
) -> None:
    """Every delivered message nobody acknowledged: sent with an unknown outcome, or not at all."""
    for mid, found in copies.items():
        if mid in sent.entity:
            continue
        if mid not in sent.ids:
            if mid not in injected:
                v.phantoms += 1
                note("phantom", mid)
            continue
        _count_copies(v, mid, found, note)
        if mid in sent.unknown_outcome:
            v.unexpected += 1
        else:
            v.unexpected_violations += 1
            note("unexpected_violation", mid)
    v.not_acked = len(sent.ids - set(sent.entity) - set(copies))


def check(
    acks: Iterable[Ack],
    delivered: Iterable[dict[str, Any]],
    *,
    injected: Iterable[str] = (),
    example_limit: int = 5,
) -> Verdict:
    v = Verdict()
    sent = _tally(acks, v)
    copies: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in delivered:
        mid = rec.get("message_id")
        if mid is not None:
            copies[str(mid)].append(rec)

    examples: dict[str, list[str]] = defaultdict(list)

    def note(kind: str, mid: str) -> None:
        if len(examples[kind]) < example_limit:
            examples[kind].append(mid)

    _check_acked(v, sent, copies, note)
    _check_unacked(v, sent, copies, set(injected), note)
    v.examples = dict(examples)
    return v
