"""The three input contracts as explicit Spark schemas (JSON lines, ``.jsonl`` or ``.jsonl.gz``).

Timestamps are read as strings and parsed with ``to_timestamp`` afterwards, so that a line
with a malformed timestamp is counted as invalid instead of silently becoming null. Each
schema ends with ``_corrupt_record``: Spark's PERMISSIVE mode puts unparsable lines there.
Extra keys in the input are ignored (they are not in the schema).
"""

from __future__ import annotations

from typing import Final

from pyspark.sql.types import (
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

CORRUPT: Final = "_corrupt_record"

# 1. Ledger v2 — written by gateway.ledger (see gateway/ledger/events.py). Version 1 lines
# (without session_id and seq) are still read: their keys are a subset.
LEDGER_VERSION: Final = 2
LEDGER_VERSIONS: Final = (1, 2)
LEDGER_EVENTS: Final = (
    "accepted",
    "syphoned",
    "expired",
    "dead_lettered",
    "rejected",
    "failover_start",
    "failover_end",
    "ping",
)
ROUTES: Final = ("primary", "backlog")
LEDGER_SCHEMA: Final = StructType(
    [
        StructField("v", IntegerType()),
        StructField("event_id", StringType()),
        StructField("ts", StringType()),
        StructField("replica", StringType()),
        StructField("message_id", StringType()),
        StructField("entity", StringType()),
        StructField("event", StringType()),
        StructField("route", StringType()),
        StructField("backlog", StringType()),
        StructField("size", LongType()),
        StructField("latency_ms", DoubleType()),
        StructField("session_id", StringType()),
        StructField("seq", LongType()),
        StructField(CORRUPT, StringType()),
    ]
)

# 2. Client acknowledgements — one line per HTTP attempt (the Locust load tests, any client).
ACK_OUTCOMES: Final = ("acked", "rejected", "failed", "indeterminate")
ACK_SCHEMA: Final = StructType(
    [
        StructField("ts", StringType()),
        StructField("message_id", StringType()),
        StructField("entity", StringType()),
        StructField("status", IntegerType()),
        StructField("outcome", StringType()),
        StructField("route", StringType()),
        StructField("latency_ms", DoubleType()),
        StructField(CORRUPT, StringType()),
    ]
)

# 3. Delivered ids — written by gateway.audit.drain, one line per received message.
DELIVERY_SOURCES: Final = ("primary", "backlog", "dlq")
DELIVERED_SCHEMA: Final = StructType(
    [
        StructField("message_id", StringType()),
        StructField("entity", StringType()),
        StructField("source", StringType()),
        StructField("queue", StringType()),
        StructField("enqueued_time", StringType()),
        StructField("dead_letter_reason", StringType()),
        StructField("delivery_count", LongType()),
        StructField("sequence_number", LongType()),  # absent from older drain files: null
        StructField("session_id", StringType()),
        StructField(CORRUPT, StringType()),
    ]
)

# The dead-letter reason Service Bus gives a message that expired (dead-lettering on expiry).
TTL_EXPIRED_REASON: Final = "TTLExpiredException"

# Classifications of the messages table, and which of them are anomalies.
CLASSIFICATIONS: Final = (
    "delivered",  # promised (2xx) and delivered exactly once per destination
    "duplicated",  # delivered more than once to one destination (or also still in a backlog)
    "expired",  # promised, then expired (dead-lettered with TTLExpiredException / ledger)
    "pending",  # promised within the grace window before the end of data, not delivered yet
    "lost",  # promised, never delivered, not expired, older than the grace window
    "unexpected",  # delivered but never promised (fine only after an indeterminate outcome)
    "indeterminate",  # timeout/reset at the client, not delivered: nothing was promised
    "failed",  # 5xx and not delivered: the promise "not stored" was kept
    "failed-but-delivered",  # 5xx and delivered: a broken promise
    "rejected",  # 4xx and not delivered
    "rejected-but-delivered",  # 4xx and delivered: a broken promise
    "unknown",  # only ledger events without any outcome (e.g. a lone dead_lettered)
)

# Billed-operation stages (docs/design.md#the-syphon: a syphoned message costs 4 operations).
BILLING_STAGES: Final = (
    "send_primary",
    "receive_primary",
    "send_backlog",
    "receive_backlog",
    "ping",
)
