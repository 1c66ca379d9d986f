"""Generated audit inputs with planted anomalies, for the tests and the benchmark.

``generate(out, messages=N)`` writes a ledger (partitioned like the gateway's directory sink,
one replica plain and one gzipped, with duplicated lines and junk lines), client
acknowledgements and delivered ids for N messages over two entities (a queue and a topic
with two subscriptions), with failover windows, backlog routing, syphoning and pings, and
plants one or more messages of every classification. It returns what the audit must find.

``generate(out, sessions=SessionPlan(...))`` adds session traffic for the strict-order check
(``--strict-sessions``): sequential senders on a session queue and on the topic, ledger v2
lines (``session_id``, ``seq``; some sessions in v1 lines, without them), delivered lines with
sequence numbers, sessions kept in order through a backlog (the fence working), a duplicate
(not an inversion), and ``inverted`` sessions whose message waited in a backlog while the
next one went straight home: an inversion.
"""

from __future__ import annotations

import datetime as dt
import gzip
import random
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import orjson

from pipeline import ordering

START = dt.datetime(2025, 3, 4, 10, 0, 0, tzinfo=dt.UTC)
BACKLOG_PREFIX = "contoso/x-servicebus-transfer/"
QUEUE = "orders"
TOPIC = "events"
SUBSCRIPTIONS = ("events/subscriptions/audit", "events/subscriptions/billing")
SESSION_QUEUE = "payments"  # a queue whose messages all carry sessions
BIG_SIZE = 100 * 1024  # 2 billed operations per stage with 64 KiB chunks

Key = tuple[str, str]  # (entity, message_id)


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class FailoverPlan:
    entity: str
    start_s: float
    end_s: float | None  # None: still open at the end of the data


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """Session traffic: ``sessions`` sessions (alternately on SESSION_QUEUE and TOPIC) of
    ``per_session`` messages each; the first ``inverted`` ones get one inversion each."""

    sessions: int = 12
    per_session: int = 5
    inverted: int = 0


# One inversion as the audit reports it: (entity, session, destination, earlier, later).
InversionKey = tuple[str, str, str, str, str]


@dataclass(slots=True)
class Expected:
    """What the audit must report for the generated data."""

    classification: dict[Key, str] = field(default_factory=dict)
    shadows: set[Key] = field(default_factory=set)  # at the primary and left in a backlog
    end: dt.datetime = START  # the latest time in any input
    latest_evidence: dt.datetime = START  # the latest ledger event or delivery
    windows: list[tuple[str, dt.datetime, dt.datetime | None]] = field(default_factory=list)
    stage_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ledger_lines: int = 0
    ledger_valid: int = 0
    ledger_duplicates: int = 0
    ack_lines: int = 0
    delivered_lines: int = 0
    pings: int = 0
    syphoned: int = 0
    waiting_in_backlog: int = 0
    inversions: list[InversionKey] = field(default_factory=list)  # from pipeline.ordering
    planted_inversions: set[InversionKey] = field(default_factory=set)
    session_messages: int = 0  # (destination, message) pairs the order check compares
    sessions: int = 0  # (entity, session) pairs with a message compared

    def keys(self, classification: str) -> set[Key]:
        return {k for k, c in self.classification.items() if c == classification}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.classification.values():
            out[c] += 1
        return dict(out)


class _Writer:
    """Streams the three inputs to files as they are generated (memory stays flat)."""

    def __init__(self, out: Path, seed: int, track: bool) -> None:
        self.rng = random.Random(seed)  # noqa: S311 (test data, not secrets)
        self.out = out
        self.track = track
        self.expected = Expected()
        self._ledger_files: dict[Path, IO[bytes]] = {}
        self._first_ledger_lines: list[tuple[str, bytes]] = []  # re-sent as duplicates
        (out / "acks").mkdir(parents=True, exist_ok=True)
        (out / "delivered").mkdir(parents=True, exist_ok=True)
        self._acks = (out / "acks" / "acks.jsonl").open("wb")
        self._delivered = (out / "delivered" / "delivered.jsonl").open("wb")
        self._max_evidence = ""
        self._max_any = ""

    def _ledger_file(self, replica: str, ts: str) -> IO[bytes]:
        part = self.out / "ledger" / f"dt={ts[:10]}" / f"hour={ts[11:13]}"
        path = part / (f"{replica}.jsonl.gz" if replica == "gw-1" else f"{replica}.jsonl")
        f = self._ledger_files.get(path)
        if f is None:
            part.mkdir(parents=True, exist_ok=True)
            raw = path.open("ab")
            if path.suffix == ".gz":
                f = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="ab", compresslevel=1, mtime=0))
            else:
                f = raw
            self._ledger_files[path] = f
        return f

    def write_ledger_line(self, replica: str, ts: str, line: bytes) -> None:
        self._ledger_file(replica, ts).write(line + b"\n")
        self.expected.ledger_lines += 1
        self._max_evidence = max(self._max_evidence, ts)
        self._max_any = max(self._max_any, ts)

    def close(self) -> None:
        """Finish: duplicated ledger lines (a new gzip member for gw-1), junk lines, times."""
        exp = self.expected
        exp.ledger_valid = exp.ledger_lines
        for f in self._ledger_files.values():
            if isinstance(f, gzip.GzipFile):
                raw = f.fileobj
                f.close()
                assert raw is not None
                raw.close()
            else:
                f.close()
        self._ledger_files.clear()
        for replica, line in self._first_ledger_lines:
            # Re-opened gzip files get a second member, as the ledger's gzip sink appends.
            ts = orjson.loads(line)["ts"]
            self.write_ledger_line(replica, ts, line)
            exp.ledger_duplicates += 1
        exp.ledger_valid = exp.ledger_lines
        first = self._first_ledger_lines[0][1] if self._first_ledger_lines else b""
        ts0 = orjson.loads(first)["ts"] if first else iso(START)
        junk = self._ledger_file("gw-0", ts0)
        junk.write(b"not json at all\n")
        junk.write(b'{"level":"info","msg":"a log line sharing stdout"}\n')
        exp.ledger_lines += 2
        for f in self._ledger_files.values():
            f.close()
        self._acks.close()
        self._delivered.close()
        exp.latest_evidence = dt.datetime.fromisoformat(self._max_evidence)
        exp.end = dt.datetime.fromisoformat(self._max_any)

    def event_id(self) -> str:
        return uuid.UUID(int=self.rng.getrandbits(128), version=4).hex

    def ledger_event(
        self,
        t: dt.datetime,
        event: str,
        *,
        message_id: str | None = None,
        entity: str | None = None,
        route: str | None = None,
        backlog: str | None = None,
        size: int | None = None,
        latency_ms: float | None = None,
        replica: str | None = None,
        session_id: str | None = None,
        seq: int | None = None,
    ) -> None:
        """One ledger line: v1 (the regular traffic), or v2 when given a ``seq``."""
        replica = replica or self.rng.choice(("gw-0", "gw-1"))
        ts = iso(t)
        record: dict[str, object] = {
            "v": 1,
            "event_id": self.event_id(),
            "ts": ts,
            "replica": replica,
            "message_id": message_id,
            "entity": entity,
            "event": event,
            "route": route,
            "backlog": backlog,
            "size": size,
            "latency_ms": latency_ms,
        }
        if seq is not None:
            record.update(v=2, session_id=session_id, seq=seq)
        line = orjson.dumps(record)
        self.write_ledger_line(replica, ts, line)
        if len(self._first_ledger_lines) < 5 and self.expected.ledger_lines % 97 == 1:
            self._first_ledger_lines.append((replica, line))
        ops = max(1, -(-(size or 0) // (64 * 1024)))
        st = self.expected.stage_ops
        if event == "accepted" and route == "backlog":
            st["send_backlog"] += ops
        elif event == "accepted":
            st["send_primary"] += ops
            st["receive_primary"] += ops
        elif event == "syphoned":
            st["receive_backlog"] += ops
            st["send_primary"] += ops
            st["receive_primary"] += ops
        elif event in ("expired", "dead_lettered") and backlog:
            st["receive_backlog"] += ops
        elif event == "ping":
            st["ping"] += ops
            self.expected.pings += 1

    def ack(
        self,
        t: dt.datetime,
        key: Key,
        outcome: str,
        *,
        status: int | None = None,
        route: str | None = None,
        latency_ms: float | None = None,
    ) -> None:
        default_status = {"acked": 201, "rejected": 400, "failed": 503, "indeterminate": None}
        ts = iso(t)
        self._max_any = max(self._max_any, ts)
        self.expected.ack_lines += 1
        self._acks.write(
            orjson.dumps(
                {
                    "ts": ts,
                    "message_id": key[1],
                    "entity": key[0],
                    "status": status if status is not None else default_status[outcome],
                    "outcome": outcome,
                    "route": route,
                    "latency_ms": latency_ms,
                },
                option=orjson.OPT_APPEND_NEWLINE,
            )
        )

    def deliver(
        self,
        t: dt.datetime | None,
        key: Key,
        *,
        source: str = "primary",
        queue: str | None = None,
        reason: str | None = None,
        sequence_numbers: dict[str, int] | None = None,
        session_id: str | None = None,
    ) -> None:
        """Delivered lines, one per destination; with ``sequence_numbers`` (per destination)
        and the session, as ``gateway drain`` writes them today."""
        queues = [queue] if queue else (list(SUBSCRIPTIONS) if key[0] == TOPIC else [key[0]])
        if t is not None:
            self._max_evidence = max(self._max_evidence, iso(t))
            self._max_any = max(self._max_any, iso(t))
        for q in queues:
            self.expected.delivered_lines += 1
            record: dict[str, object] = {
                "message_id": key[1],
                "entity": key[0],
                "source": source,
                "queue": q,
                "enqueued_time": iso(t) if t else None,
                "dead_letter_reason": reason,
                "delivery_count": 1 if source != "backlog" else 0,
            }
            if sequence_numbers is not None:
                record.update(sequence_number=sequence_numbers[q], session_id=session_id)
            self._delivered.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))


def generate(
    out: Path,
    *,
    messages: int = 2000,
    seed: int = 7,
    duration_s: float | None = None,
    grace_s: float = 60.0,
    failovers: Iterable[FailoverPlan] | None = None,
    plant: bool = True,
    track: bool = True,
    sessions: SessionPlan | None = None,
) -> Expected:
    """Write ``out/ledger/``, ``out/acks/acks.jsonl``, ``out/delivered/delivered.jsonl``.

    ``track=False`` leaves the regular messages out of ``Expected.classification`` (they are
    all "delivered"): for benchmarks with millions of messages.
    """
    w = _Writer(out, seed, track)
    rng = w.rng
    exp = w.expected
    duration = duration_s if duration_s is not None else max(600.0, messages / 200.0)
    plans = list(
        failovers
        if failovers is not None
        else [
            FailoverPlan(QUEUE, duration * 0.3, duration * 0.5),
            FailoverPlan(TOPIC, duration * 0.8, None),
        ]
    )
    end = START + dt.timedelta(seconds=duration)

    _failover_windows(w, plans, end)

    def in_window(entity: str, t: dt.datetime) -> tuple[dt.datetime, dt.datetime | None] | None:
        for ent, s, e in exp.windows:
            if ent == entity and s <= t and (e is None or t < e):
                return s, e
        return None

    step = duration * 0.95 / max(1, messages)
    for i in range(messages):
        entity = QUEUE if i % 3 else TOPIC
        key = (entity, f"m-{i:08d}")
        t = START + dt.timedelta(seconds=1 + i * step)
        size = BIG_SIZE if i % 997 == 5 else 200 + (i % 700)
        lat = 2.0 + rng.random() * 8
        window = in_window(entity, t)
        if window is None:
            _to_primary(w, key, t, size, lat)
        else:
            _to_backlog(w, key, t, size, lat + 20, f"{BACKLOG_PREFIX}{i % 4}", window[1])
        if track:
            exp.classification[key] = "delivered"

    if plant:
        _plant(w, end, grace_s)
    if sessions is not None:
        _sessions(w, sessions)

    # A few ledger lines duplicated by an at-least-once shipper.
    w.close()
    return exp


def _to_primary(w: _Writer, key: tuple[str, str], t: dt.datetime, size: int, lat: float) -> None:
    """A regular message accepted to the primary, acknowledged and delivered."""
    entity, message_id = key
    w.ledger_event(
        t,
        "accepted",
        message_id=message_id,
        entity=entity,
        route="primary",
        size=size,
        latency_ms=lat,
    )
    w.ack(t + dt.timedelta(milliseconds=lat), key, "acked", route="primary", latency_ms=lat + 1)
    w.deliver(t + dt.timedelta(milliseconds=1), key)


def _to_backlog(
    w: _Writer,
    key: tuple[str, str],
    t: dt.datetime,
    size: int,
    lat: float,
    backlog: str,
    window_end: dt.datetime | None,
) -> None:
    """A regular message accepted to a backlog queue during a failover window: syphoned home
    after the window ends, or still in the backlog when drained (the window never ended)."""
    entity, message_id = key
    w.ledger_event(
        t,
        "accepted",
        message_id=message_id,
        entity=entity,
        route="backlog",
        backlog=backlog,
        size=size,
        latency_ms=lat,
    )
    w.ack(t + dt.timedelta(milliseconds=lat), key, "acked", route="backlog", latency_ms=lat + 1)
    if window_end is not None:
        ts = window_end + dt.timedelta(seconds=1 + w.rng.random() * 30)
        w.ledger_event(
            ts,
            "syphoned",
            message_id=message_id,
            entity=entity,
            backlog=backlog,
            size=size,
            replica="gw-0",
        )
        w.deliver(ts + dt.timedelta(milliseconds=2), key)
        w.expected.syphoned += 1
    else:  # still in the backlog queue when drained
        w.deliver(t, key, source="backlog", queue=backlog)
        w.expected.waiting_in_backlog += 1


def _failover_windows(w: _Writer, plans: Iterable[FailoverPlan], end: dt.datetime) -> None:
    """Failover transitions, pings every 10 s inside each window; two replicas log the start."""
    exp = w.expected
    for plan in plans:
        s = START + dt.timedelta(seconds=plan.start_s)
        e = START + dt.timedelta(seconds=plan.end_s) if plan.end_s is not None else None
        exp.windows.append((plan.entity, s, e))
        w.ledger_event(s, "failover_start", entity=plan.entity, replica="gw-0")
        w.ledger_event(
            s + dt.timedelta(seconds=0.2), "failover_start", entity=plan.entity, replica="gw-1"
        )
        t = s + dt.timedelta(seconds=10)
        stop = e if e is not None else end
        while t < stop:
            w.ledger_event(t, "ping", entity=plan.entity, size=0, replica="gw-0")
            t += dt.timedelta(seconds=10)
        if e is not None:
            w.ledger_event(e, "failover_end", entity=plan.entity, replica="gw-1")


def _plant(w: _Writer, end: dt.datetime, grace_s: float) -> None:
    """One or more messages of every classification, at known times."""
    _plant_lost_and_duplicated(w)
    _plant_pending_and_expired(w, end, grace_s)
    _plant_unexpected_and_answered(w)


_EARLY = START + dt.timedelta(seconds=30)  # planted messages, early in the run


def _at(seconds: float) -> dt.datetime:
    return _EARLY + dt.timedelta(seconds=seconds)


def _accepted(w: _Writer, t: dt.datetime, key: Key, route: str = "primary") -> None:
    w.ledger_event(
        t, "accepted", message_id=key[1], entity=key[0], route=route, size=300, latency_ms=3.0
    )


def _plant_lost_and_duplicated(w: _Writer) -> None:
    """Lost, duplicated, and delivered once (a shadow in a backlog, a topic's fan-out)."""
    exp = w.expected
    for n in range(3):  # lost: acked, gateway accepted, never delivered
        key = (QUEUE, f"lost-{n}")
        _accepted(w, _at(n), key)
        w.ack(_at(n), key, "acked", route="primary", latency_ms=4.0)
        exp.classification[key] = "lost"
    key = (QUEUE, "lost-client-only")  # acked by the client, no ledger line at all
    w.ack(_at(5), key, "acked", route="primary", latency_ms=4.0)
    exp.classification[key] = "lost"

    for n in range(2):  # duplicated: delivered twice to the same queue
        key = (QUEUE, f"dup-{n}")
        _accepted(w, _at(10 + n), key)
        w.ack(_at(10 + n), key, "acked", route="primary")
        w.deliver(_at(10 + n), key)
        w.deliver(_at(10.5 + n), key)
        exp.classification[key] = "duplicated"
    key = (QUEUE, "shadow-0")  # at the primary and left in a backlog: delivered, shadow
    _accepted(w, _at(14), key, route="backlog")
    w.ack(_at(14), key, "acked", route="backlog")
    w.deliver(_at(15), key)
    w.deliver(_at(14), key, source="backlog", queue=f"{BACKLOG_PREFIX}1")
    exp.classification[key] = "delivered"
    exp.shadows.add(key)
    key = (QUEUE, "dup-backlog")  # never at the primary, twice in the backlogs
    _accepted(w, _at(15), key, route="backlog")
    w.ack(_at(15), key, "acked", route="backlog")
    w.deliver(_at(15), key, source="backlog", queue=f"{BACKLOG_PREFIX}1")
    w.deliver(_at(15), key, source="backlog", queue=f"{BACKLOG_PREFIX}2")
    exp.classification[key] = "duplicated"

    key = (TOPIC, "fanout-ok")  # once per subscription: delivered, not duplicated
    _accepted(w, _at(16), key)
    w.ack(_at(16), key, "acked", route="primary")
    w.deliver(_at(16), key)
    exp.classification[key] = "delivered"


def _plant_pending_and_expired(w: _Writer, end: dt.datetime, grace_s: float) -> None:
    """Pending (inside the grace window) and expired (dead-lettered, or in a backlog)."""
    exp = w.expected
    for n in range(2):  # pending: acked inside the grace window, not delivered yet
        key = (QUEUE, f"late-{n}")
        t = end - dt.timedelta(seconds=grace_s / 3 + n)
        _accepted(w, t, key)
        w.ack(t, key, "acked", route="primary")
        exp.classification[key] = "pending"

    key = (QUEUE, "expired-dlq")  # dead-lettered on expiry
    _accepted(w, _at(20), key)
    w.ack(_at(20), key, "acked", route="primary")
    w.deliver(
        _at(20), key, source="dlq", queue=f"{QUEUE}/$DeadLetterQueue", reason="TTLExpiredException"
    )
    exp.classification[key] = "expired"
    key = (QUEUE, "expired-ledger")  # expired in a backlog queue, as the syphon logged it
    _accepted(w, _at(21), key, route="backlog")
    w.ack(_at(21), key, "acked", route="backlog")
    w.ledger_event(
        _at(80), "expired", message_id=key[1], entity=QUEUE, backlog=f"{BACKLOG_PREFIX}2", size=300
    )
    exp.classification[key] = "expired"


def _plant_unexpected_and_answered(w: _Writer) -> None:
    """Delivered without a promise, timed out, and answered 4xx/5xx (stored or not)."""
    exp = w.expected
    key = (QUEUE, "unexpected-0")  # delivered, nobody ever acknowledged it: anomaly
    w.deliver(_at(25), key)
    exp.classification[key] = "unexpected"
    key = (QUEUE, "timeout-stored")  # client timed out, the gateway had stored it: allowed
    _accepted(w, _at(26), key)
    w.ack(_at(26), key, "indeterminate", route=None)
    w.deliver(_at(26), key)
    exp.classification[key] = "unexpected"
    key = (QUEUE, "timeout-lost")  # client timed out, nothing stored: fine
    w.ack(_at(27), key, "indeterminate")
    exp.classification[key] = "indeterminate"
    key = (QUEUE, "retried")  # timeout, then a successful retry: one delivery
    w.ack(_at(28), key, "indeterminate")
    _accepted(w, _at(29), key)
    w.ack(_at(29), key, "acked", route="primary")
    w.deliver(_at(29), key)
    exp.classification[key] = "delivered"

    key = (QUEUE, "broken-5xx")  # 5xx answered, yet delivered: a broken promise
    w.ack(_at(30), key, "failed", status=500)
    w.deliver(_at(30), key)
    exp.classification[key] = "failed-but-delivered"
    key = (QUEUE, "honest-5xx")  # 5xx answered, not stored
    w.ledger_event(_at(31), "rejected", message_id=key[1], entity=QUEUE, size=300)
    w.ack(_at(31), key, "failed", status=503)
    exp.classification[key] = "failed"
    key = (QUEUE, "bad-request")  # 4xx, not stored
    w.ack(_at(32), key, "rejected", status=400)
    exp.classification[key] = "rejected"
    key = (QUEUE, "broken-4xx")  # 4xx, yet delivered
    w.ack(_at(33), key, "rejected", status=413)
    w.deliver(_at(33), key)
    exp.classification[key] = "rejected-but-delivered"


_SESSIONS_AT = START + dt.timedelta(seconds=100)  # before any failover window


def _micros(t: dt.datetime) -> int:
    return int((t - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) / dt.timedelta(microseconds=1))


@dataclass(slots=True)
class _SessionMessage:
    key: Key
    session: str
    acked: dt.datetime
    stored: list[dt.datetime]  # when each copy reached home (a duplicate has two)


def _sessions(w: _Writer, plan: SessionPlan) -> None:
    """Sequential senders, one per session, interleaved 50 ms apart; see `SessionPlan`."""
    sent: list[_SessionMessage] = []
    step = dt.timedelta(milliseconds=50)
    for k in range(plan.per_session):
        for i in range(plan.sessions):
            entity = SESSION_QUEUE if i % 2 == 0 else TOPIC
            session = f"s-{i:03d}"
            key = (entity, f"{session}-m{k}")
            t = _SESSIONS_AT + (k * plan.sessions + i) * step
            inverted = i < plan.inverted and k == 1  # waits in a backlog, the next goes home
            fenced = i >= plan.inverted and i % 4 == 1 and k >= 1  # the fence: all to backlog
            route = "backlog" if inverted or fenced else "primary"
            stored = t + dt.timedelta(milliseconds=1)
            if fenced:  # syphoned in order, after the fence: 20 s later
                stored = t + dt.timedelta(seconds=20)
            elif inverted:  # syphoned after the session's next message went home
                stored = t + plan.sessions * step + dt.timedelta(seconds=1)
            copies = [stored]
            if i == plan.inverted and k == 0:  # a duplicate, stored again later
                copies.append(t + dt.timedelta(seconds=30))
            sent.append(_SessionMessage(key, session, t, copies))
            if inverted and plan.per_session > 2:  # m2 goes home straight: stored before m1
                for q in list(SUBSCRIPTIONS) if entity == TOPIC else [entity]:
                    planted = (entity, session, q, key[1], f"{session}-m2")
                    w.expected.planted_inversions.add(planted)
            _session_ledger(w, sent[-1], route, v1=i % 5 == 3)
            w.expected.classification[key] = "duplicated" if len(copies) > 1 else "delivered"
    _session_deliveries(w, sent)


def _session_ledger(w: _Writer, m: _SessionMessage, route: str, *, v1: bool) -> None:
    """The accepted event (v2 with the session and seq, or v1 without), the client's
    acknowledgement, and the syphoned event of a message that went through a backlog."""
    entity, message_id = m.key
    backlog = f"{BACKLOG_PREFIX}0" if route == "backlog" else None
    w.ledger_event(
        m.acked,
        "accepted",
        message_id=message_id,
        entity=entity,
        route=route,
        backlog=backlog,
        size=300,
        latency_ms=3.0,
        session_id=None if v1 else m.session,
        seq=None if v1 else _micros(m.acked),
    )
    w.ack(m.acked + dt.timedelta(milliseconds=3), m.key, "acked", route=route, latency_ms=4.0)
    if backlog is not None:
        at = m.stored[0] - dt.timedelta(milliseconds=1)
        w.ledger_event(
            at,
            "syphoned",
            message_id=message_id,
            entity=entity,
            backlog=backlog,
            size=300,
            replica="gw-0",
            seq=_micros(at),
        )
        w.expected.syphoned += 1


def _session_deliveries(w: _Writer, sent: list[_SessionMessage]) -> None:
    """Sequence numbers per destination in the order copies reached home; the delivered
    lines; and the inversions `pipeline.ordering` finds in them (what the audit must find)."""
    copies = sorted((t, n, m) for n, m in enumerate(sent) for t in m.stored)
    next_seq: dict[str, int] = defaultdict(lambda: 1)
    positions: dict[tuple[str, str, str], list[tuple[str, int]]] = defaultdict(list)
    for t, _, m in copies:
        queues = list(SUBSCRIPTIONS) if m.key[0] == TOPIC else [m.key[0]]
        numbers = {}
        for q in queues:
            numbers[q] = next_seq[q]
            next_seq[q] += 1
            positions[(m.key[0], m.session, q)].append((m.key[1], numbers[q]))
        w.deliver(t, m.key, sequence_numbers=numbers, session_id=m.session)
    acked = {m.key: _micros(m.acked) for m in sent}
    exp = w.expected
    exp.sessions = len({(m.key[0], m.session) for m in sent})
    for (entity, session, q), stored in sorted(positions.items()):
        first = ordering.first_stored(stored)
        exp.session_messages += len(first)
        acks = {mid: acked[(entity, mid)] for mid in first}
        for inv in ordering.inversions(acks, first):
            exp.inversions.append((entity, session, q, inv.earlier, inv.later))
