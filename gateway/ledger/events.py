"""Ledger v2: the gateway's event-log contract (one JSON object per line).

Every line has all of these keys (``null`` when not applicable); extra keys may follow and are
ignored by readers::

    {"v": 2, "event_id": "<uuid4 hex>", "ts": "2025-01-31T12:00:00.123456Z",
     "replica": "gw-0", "message_id": "m-1", "entity": "orders", "event": "accepted",
     "route": "primary", "backlog": null, "size": 1024, "latency_ms": 3.2,
     "session_id": "customer-7", "seq": 1738324800123456}

``event_id`` is unique per line so that lines duplicated by an at-least-once log shipper can be
dropped by the reader. ``session_id`` is the message's SessionId (null without one). ``seq``
orders one replica's events: the event's time in microseconds since the epoch, raised to one
more than the previous event's when the clock did not move forward (the same microsecond, or
a clock stepped back), so it strictly increases in the order events were emitted — the order
in which a replica acknowledged its requests — and, on synchronised clocks, compares across
replicas as a time. Version 1 lines (without the last two keys) are still read by the audit.
``pipeline.schemas.LEDGER_SCHEMA`` is the same contract for Spark.
"""

from __future__ import annotations

import os
import time
from typing import Final, Literal

LEDGER_VERSION: Final = 2
# Every line's keys, in this order (the line template and the record dict both follow it).
LEDGER_KEYS: Final = (
    "v",
    "event_id",
    "ts",
    "replica",
    "message_id",
    "entity",
    "event",
    "route",
    "backlog",
    "size",
    "latency_ms",
    "session_id",
    "seq",
)

LedgerEvent = Literal[
    "accepted",  # the gateway answered 2xx: the message is stored (route says where)
    "syphoned",  # the syphon moved a message from a backlog queue to its primary entity
    "expired",  # a message's TTL ran out (in a backlog queue, before it could be syphoned)
    "dead_lettered",  # the syphon dead-lettered a message in its backlog queue
    "rejected",  # the gateway answered 4xx/5xx: the message is NOT stored
    "failover_start",  # an entity failed over to the backlog queues
    "failover_end",  # a ping was delivered: the entity is back on the primary
    "ping",  # a ping was sent to an unavailable primary entity (a billed operation)
]
LEDGER_EVENTS: Final[frozenset[str]] = frozenset(LedgerEvent.__args__)  # type: ignore[attr-defined]

Route = Literal["primary", "backlog"]


def next_seq(epoch: float, previous: int) -> int:
    """The ``seq`` of an event emitted at ``epoch`` after one stamped ``previous``: its time in
    microseconds (as ``ts`` shows it), or ``previous + 1`` when that would not move forward."""
    seconds = int(epoch)
    return max(seconds * 1_000_000 + int((epoch - seconds) * 1_000_000), previous + 1)


def format_ts(epoch: float) -> str:
    """``epoch`` (seconds) as ISO 8601 UTC, always with microseconds and a ``Z``."""
    seconds = int(epoch)
    micros = round((epoch - seconds) * 1_000_000)
    if micros >= 1_000_000:  # rounding up the last microsecond of a second
        seconds, micros = seconds + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{micros:06d}Z"


_VERSION_4 = bytes((b & 0x0F) | 0x40 for b in range(256))  # byte 6: version nibble 4
_VARIANT_10 = bytes((b & 0x3F) | 0x80 for b in range(256))  # byte 8: variant bits 10


def new_event_ids(count: int) -> list[str]:
    """``count`` random version-4 UUIDs as 32 hex digits.

    One ``os.urandom`` call and byte-table translations for the whole batch: about a tenth of
    the cost of ``uuid.uuid4().hex`` per id (the ledger's writer calls it once per batch).
    """
    return _uuid4_hex(count).split()


def new_event_ids_bytes(count: int) -> list[bytes]:
    """`new_event_ids` as ASCII bytes (what the ledger's line template takes)."""
    return _uuid4_hex(count).encode().split()


def _uuid4_hex(count: int) -> str:
    """``count`` random UUID4s in hex, separated by spaces."""
    raw = bytearray(os.urandom(16 * count))
    raw[6::16] = raw[6::16].translate(_VERSION_4)
    raw[8::16] = raw[8::16].translate(_VARIANT_10)
    return raw.hex(" ", 16)
