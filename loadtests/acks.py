"""The client acknowledgement file: one JSON line per message id per attempt.

The format is shared with the Spark audit — keep it exactly::

    {"ts": "2025-01-01T00:00:00.000000+00:00", "message_id": "...", "entity": "orders",
     "status": 201, "outcome": "acked", "route": "primary", "latency_ms": 3.2}

Outcomes, from the client's point of view:

* ``acked`` — a 2xx answer: the gateway promises the message is stored (primary or backlog).
* ``rejected`` — the gateway refused before sending (4xx, or 503 ``saturated`` /
  ``shutting_down``), or the connection was refused: nothing can have been stored.
* ``failed`` — a 5xx after the gateway tried to send: not acknowledged, but a broker-side
  timeout means the message *may* have been stored (the outcome is unknown to the gateway).
* ``indeterminate`` — no answer at all (timeout, reset, disconnect): anything may have happened.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import orjson

Outcome = Literal["acked", "rejected", "failed", "indeterminate"]

# 503 codes the gateway answers before anything is sent to a broker.
NOT_SENT_CODES = frozenset({"saturated", "shutting_down"})


def classify(status: int | None, error_code: str | None = None) -> Outcome:
    """The outcome of one HTTP attempt (`status` None = no answer)."""
    if status is None:
        return "indeterminate"
    if 200 <= status < 300:
        return "acked"
    if status < 500 or (error_code in NOT_SENT_CODES):
        return "rejected"
    return "failed"


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


@dataclass(frozen=True, slots=True)
class Ack:
    ts: str
    message_id: str
    entity: str
    status: int | None
    outcome: Outcome
    route: str | None
    latency_ms: float | None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "ts": self.ts,
                "message_id": self.message_id,
                "entity": self.entity,
                "status": self.status,
                "outcome": self.outcome,
                "route": self.route,
                "latency_ms": self.latency_ms,
            }
        )


class AckWriter:
    """Appends ack lines to one file. Thread-safe (Locust's greenlets, asyncio tasks);
    buffered, flushed every `flush_every` lines and on `close()`."""

    def __init__(self, path: str | Path, flush_every: int = 256) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "ab")
        self._lock = threading.Lock()
        self._pending = 0
        self._flush_every = flush_every
        self.lines = 0

    def write(
        self,
        message_ids: Iterable[str],
        entity: str,
        status: int | None,
        outcome: Outcome,
        route: str | None,
        latency_ms: float | None,
    ) -> None:
        ts = now_iso()
        lat = None if latency_ms is None else round(latency_ms, 3)
        chunk = b"".join(
            Ack(ts, mid, entity, status, outcome, route, lat).to_json() + b"\n"
            for mid in message_ids
        )
        with self._lock:
            self._file.write(chunk)
            n = chunk.count(b"\n")
            self.lines += n
            self._pending += n
            if self._pending >= self._flush_every:
                self._file.flush()
                self._pending = 0

    def flush(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                self._file.close()


def read_acks(paths: Iterable[str | Path]) -> Iterator[Ack]:
    """Every ack line of `paths` (files or directories of ``*.jsonl``); a torn last line
    (a killed writer) is skipped."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                try:
                    d = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                yield Ack(
                    d["ts"],
                    d["message_id"],
                    d["entity"],
                    d["status"],
                    d["outcome"],
                    d["route"],
                    d["latency_ms"],
                )
