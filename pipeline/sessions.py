"""Per-session order in strict entities, with Spark: the ``session_order`` table.

The rule (what an inversion is, and what is not) is ``pipeline.ordering``'s, written there in
plain Python; this module computes the same over the whole data set with one aggregation per
side, a join on (entity, message id) and a window per (entity, session, destination). Pure
DataFrame → DataFrame transformations, like ``pipeline.reconcile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

ALL_ENTITIES: Final = "*"

INVERSION_COLUMNS: Final = (
    "entity",
    "session_id",
    "destination",
    "earlier_message_id",
    "earlier_ack_ts",
    "earlier_ack_seq",
    "earlier_position",
    "later_message_id",
    "later_ack_ts",
    "later_ack_seq",
    "later_position",
)


def strict_keys(entities: Sequence[str]) -> tuple[str, ...]:
    """The entity keys of ``--strict-sessions`` values (comma-separated, repeatable): lower
    case, without surrounding slashes, as ``pipeline.inputs.entity_key``; ``*`` is every
    entity."""
    keys: list[str] = []
    for value in entities:
        for part in value.split(","):
            key = part.strip().strip("/").lower()
            if key and key not in keys:
                keys.append(key)
    return tuple(keys)


def _strict(keys: Sequence[str]) -> Column:
    if not keys:
        return F.lit(False)
    if ALL_ENTITIES in keys:
        return F.col("ekey").isNotNull()
    return F.col("ekey").isin(*keys)


def session_acks(ledger: DataFrame, keys: Sequence[str]) -> DataFrame:
    """(ekey, message_id): the acknowledgement key of each strict entity's message, from its
    first ``accepted`` event — ``seq``, or for a version 1 line its ``ts`` in microseconds —
    with that event's time and session."""
    accepted = ledger.where(
        (F.col("event") == "accepted") & F.col("message_id").isNotNull() & _strict(keys)
    ).withColumn("ack_seq", F.coalesce(F.col("seq"), F.unix_micros("ts")))
    return accepted.groupBy("ekey", "message_id").agg(
        F.min("ack_seq").alias("ack_seq"),
        F.min_by("ts", "ack_seq").alias("ack_ts"),
        F.min_by("session_id", "ack_seq").alias("ack_session"),
    )


def stored_positions(delivered: DataFrame, keys: Sequence[str]) -> DataFrame:
    """(ekey, message_id, destination): each message's first copy at a destination of a strict
    entity — copies at home only (not in a backlog queue, not dead-lettered), with a sequence
    number — and the session the broker stored it in."""
    home = delivered.where(
        (F.col("source") == "primary")
        & ~F.col("backlog_copy")
        & F.col("endpoint").isNotNull()
        & F.col("sequence_number").isNotNull()
        & _strict(keys)
    )
    return home.groupBy("ekey", "message_id", F.col("endpoint").alias("destination")).agg(
        F.min("sequence_number").alias("position"),
        F.min_by("session_id", "sequence_number").alias("stored_session"),
    )


def session_order(
    ledger: DataFrame, delivered: DataFrame, keys: Sequence[str], names: DataFrame
) -> tuple[DataFrame, DataFrame]:
    """(checked, inversions) for the strict entities ``keys``.

    ``checked``: one row per (entity key, session, destination, message) compared — a message
    acknowledged with a session and found at home. ``inversions``: one row per adjacent pair
    in acknowledgement order stored the other way round (``INVERSION_COLUMNS``). The session
    is the one the gateway logged, else the one the broker stored (a version 1 ledger).
    """
    joined = session_acks(ledger, keys).join(
        stored_positions(delivered, keys), ["ekey", "message_id"]
    )
    checked = joined.select(
        "ekey",
        F.coalesce("ack_session", "stored_session").alias("session_id"),
        "destination",
        "message_id",
        "ack_seq",
        "ack_ts",
        "position",
    ).where(F.col("session_id").isNotNull())
    w = Window.partitionBy("ekey", "session_id", "destination").orderBy("ack_seq", "message_id")
    prev = {c: F.lag(c).over(w) for c in ("message_id", "ack_seq", "ack_ts", "position")}
    pairs = checked.select(
        "ekey",
        "session_id",
        "destination",
        prev["message_id"].alias("earlier_message_id"),
        prev["ack_ts"].alias("earlier_ack_ts"),
        prev["ack_seq"].alias("earlier_ack_seq"),
        prev["position"].alias("earlier_position"),
        F.col("message_id").alias("later_message_id"),
        F.col("ack_ts").alias("later_ack_ts"),
        F.col("ack_seq").alias("later_ack_seq"),
        F.col("position").alias("later_position"),
    )
    inverted = pairs.where(
        (F.col("earlier_ack_seq") < F.col("later_ack_seq"))
        & (F.col("later_position") < F.col("earlier_position"))
    )
    inversions = inverted.join(F.broadcast(names), "ekey", "left").select(
        F.coalesce(F.col("entity"), F.col("ekey")).alias("entity"),
        *INVERSION_COLUMNS[1:],
    )
    return checked, inversions


INVERSION_KIND: Final = "session_order_inversion"


def inversion_anomalies(inversions: DataFrame) -> DataFrame:
    """One ``session_order_inversion`` anomaly (error) per inversion, on the later message."""
    detail = F.format_string(
        "session %s at %s: acknowledged after %s (ack seq %d < %d) but stored before it "
        "(sequence number %d < %d)",
        "session_id",
        "destination",
        "earlier_message_id",
        "earlier_ack_seq",
        "later_ack_seq",
        "later_position",
        "earlier_position",
    )
    return inversions.select(
        F.lit(INVERSION_KIND).alias("kind"),
        F.lit("error").alias("severity"),
        "entity",
        F.col("later_message_id").alias("message_id"),
        detail.alias("detail"),
        F.col("later_ack_ts").alias("ts"),
    )
