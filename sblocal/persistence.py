"""Durable mode: one SQLite file per namespace, written through under the namespace lock.

Every store operation marks the messages it changed; `commit` writes them in one transaction
before the operation returns, i.e. before the AMQP layer settles the transfer. A broker
restart therefore keeps every message a sender saw accepted. Locks are not persisted: after a
restart every message is available again (its delivery count kept).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sqlite3
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sblocal import codec
from sblocal.config import parse_properties
from sblocal.entities import (
    TIMESPAN_MAX,
    QueueProperties,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.store.messages import MessageState, StoredMessage

if TYPE_CHECKING:  # the namespace calls in; only `load` needs its type
    from sblocal.store import Namespace

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entities (kind TEXT NOT NULL, path TEXT NOT NULL PRIMARY KEY,
                                     props TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS messages (entity TEXT NOT NULL, seq INTEGER NOT NULL,
                                     meta TEXT NOT NULL, annotations BLOB NOT NULL,
                                     tail BLOB NOT NULL, PRIMARY KEY (entity, seq));
CREATE TABLE IF NOT EXISTS sequences (path TEXT NOT NULL PRIMARY KEY, next_seq INTEGER NOT NULL);
"""


def _props_to_json(props: Any) -> str:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(props):
        value = getattr(props, f.name)
        if isinstance(value, dt.timedelta):
            value = "max" if value >= TIMESPAN_MAX else value.total_seconds()
        out[f.name] = value
    return json.dumps(out)


class Persistence:
    """SQLite write-through store of one namespace (used only under the namespace lock)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The reactor thread and the HTTP thread both call in, always under the namespace
        # lock, so sharing the connection across threads is safe.
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._upserts: dict[tuple[str, int], StoredMessage] = {}
        self._deletes: set[tuple[str, int]] = set()

    def load(self, ns: Namespace) -> None:
        rows = self._db.execute("SELECT kind, path, props FROM entities ORDER BY rowid").fetchall()
        for kind, path, props_json in rows:
            raw = json.loads(props_json)
            if kind == "queue":
                if ns.get_queue(path) is None:
                    ns.create_queue(path, parse_properties(QueueProperties, raw, path))
            elif kind == "topic":
                if ns.get_topic(path) is None:
                    ns.create_topic(path, parse_properties(TopicProperties, raw, path))
            elif kind == "subscription":
                topic, name = path.rsplit("/Subscriptions/", 1)
                if ns.get_topic(topic) is not None and ns.get_subscription(topic, name) is None:
                    ns.create_subscription(
                        topic, name, parse_properties(SubscriptionProperties, raw, path)
                    )
        for entity, seq, meta_json, ann_blob, tail in self._db.execute(
            "SELECT entity, seq, meta, annotations, tail FROM messages ORDER BY entity, seq"
        ):
            meta = json.loads(meta_json)
            msg = StoredMessage(
                seq=seq,
                durable=meta["durable"],
                priority=meta["priority"],
                ttl_ms=meta["ttl_ms"],
                annotations=dict(codec.section_body(ann_blob) or {}),
                tail=bytes(tail),
                app_range=(meta["app_range"][0], meta["app_range"][1]),
                message_id=meta["message_id"],
                session_id=meta["session_id"],
                content_type=meta["content_type"],
                enqueued_ms=meta["enqueued_ms"],
                scheduled_ms=meta["scheduled_ms"],
                expires_ms=meta["expires_ms"],
                delivery_count=meta["delivery_count"],
                state=MessageState(meta["state"]),
                size=meta["size"],
            )
            ns.restore_message(entity, msg)
        for path, next_seq in self._db.execute("SELECT path, next_seq FROM sequences"):
            ns.restore_sequence(path, next_seq)

    def save_entity(self, kind: str, path: str, props: Any) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO entities (kind, path, props) VALUES (?, ?, ?)",
            (kind, path, _props_to_json(props)),
        )

    def delete_entity(self, kind: str, path: str) -> None:
        self._db.execute("DELETE FROM entities WHERE path = ?", (path,))
        self._db.execute(
            "DELETE FROM messages WHERE entity = ? OR entity LIKE ?", (path, path + "/%")
        )

    def upsert(self, entity: str, msg: StoredMessage) -> None:
        key = (entity, msg.seq)
        self._deletes.discard(key)
        self._upserts[key] = msg

    def delete(self, entity: str, seq: int) -> None:
        key = (entity, seq)
        self._upserts.pop(key, None)
        self._deletes.add(key)

    def commit(self, sequences: Callable[[], Mapping[str, int]]) -> None:
        """Write the marked changes and the entities' next sequence numbers
        (`sequences`, called only when there is something to write) in one transaction."""
        if not self._upserts and not self._deletes:
            return
        rows = []
        for (entity, seq), msg in self._upserts.items():
            meta = {
                "durable": msg.durable,
                "priority": msg.priority,
                "ttl_ms": msg.ttl_ms,
                "app_range": list(msg.app_range),
                "message_id": msg.message_id,
                "session_id": msg.session_id,
                "content_type": msg.content_type,
                "enqueued_ms": msg.enqueued_ms,
                "scheduled_ms": msg.scheduled_ms,
                "expires_ms": msg.expires_ms,
                "delivery_count": msg.delivery_count,
                "state": int(msg.state),
                "size": msg.size,
            }
            rows.append(
                (entity, seq, json.dumps(meta), codec.encode_annotations(msg.annotations), msg.tail)
            )
        with self._db:  # one transaction
            self._db.execute("BEGIN")
            if self._deletes:
                self._db.executemany(
                    "DELETE FROM messages WHERE entity = ? AND seq = ?", list(self._deletes)
                )
            if rows:
                self._db.executemany(
                    "INSERT OR REPLACE INTO messages (entity, seq, meta, annotations, tail) "
                    "VALUES (?, ?, ?, ?, ?)",
                    rows,
                )
            self._db.executemany(
                "INSERT OR REPLACE INTO sequences (path, next_seq) VALUES (?, ?)",
                list(sequences().items()),
            )
        self._upserts.clear()
        self._deletes.clear()

    def clear_messages(self) -> None:
        self._upserts.clear()
        self._deletes.clear()
        self._db.execute("DELETE FROM messages")

    def close(self) -> None:
        self._db.close()
