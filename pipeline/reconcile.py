"""The reconciliation: pure DataFrame → DataFrame transformations (no I/O, no actions).

Messages are keyed by (entity, message_id), the entity compared case-insensitively
(``ekey``): the same MessageId sent to two entities is two messages. A topic message
delivered once to each of its subscriptions is delivered, not duplicated.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from pipeline.schemas import BILLING_STAGES, TTL_EXPIRED_REASON

# Backlog queue paths (gateway.core.backlog.BACKLOG_PATH_PATTERN, where the rule is defined):
# a copy, because the pipeline imports nothing from the gateway (its --py-files archive holds
# only pipeline/). tests/pipeline/test_pipeline_units.py holds the two equal.
DEFAULT_BACKLOG_PATTERN: Final = r"/x-servicebus-transfer/\d+$"


@dataclass(frozen=True, slots=True)
class AuditOptions:
    """Knobs of the reconciliation (all have command-line flags)."""

    grace_seconds: float = 60.0
    price_per_million_ops: float = 0.05
    stage_prices: Mapping[str, float] = field(default_factory=dict)
    billing_chunk_kib: int = 64  # each started 64 KiB of a message is one more operation
    backlog_pattern: str = DEFAULT_BACKLOG_PATTERN
    # False (docs/pipeline.md, "2. Client acknowledgements"): a 5xx promises "not stored", so
    # a delivered 5xx is a broken promise (failed-but-delivered). True: a 5xx after a send was
    # tried may have stored the message (a broker timeout), so a delivered 5xx is an allowed
    # "unexpected", like a timeout.
    failed_may_be_stored: bool = False
    # Entity keys whose sessions must keep their order (``--strict-sessions``; "*" is every
    # entity): their per-session inversions fail the audit (pipeline.ordering).
    strict_sessions: tuple[str, ...] = ()

    def price(self, stage: str) -> float:
        return self.stage_prices.get(stage, self.price_per_million_ops)


def _seconds_between(start: Column, end: Column) -> Column:
    return (F.unix_micros(end) - F.unix_micros(start)) / F.lit(1_000_000.0)


# -- messages ---------------------------------------------------------------------------------
#
# Performance note: every per-message aggregate below has a fixed-width result (counts,
# booleans, timestamps, small integer codes), so Spark uses hash aggregation with generated
# code; a string-valued aggregate (first(entity), collect_set, ...) would force a sort-based
# aggregate over every input row. The three inputs become "evidence" rows with one shared
# column set and are aggregated per message in a single shuffle (no full outer joins).

_ROUTE_CODES: Final[Mapping[str, int]] = {"primary": 1, "backlog": 2}


def _route_code(col: Column) -> Column:
    return F.when(col == "primary", F.lit(1)).when(col == "backlog", F.lit(2))


def _route_name(code: Column) -> Column:
    return F.when(code == 1, F.lit("primary")).when(code == 2, F.lit("backlog"))


_EVIDENCE: Final = {
    # column: (type, aggregate)
    "ack_attempts": ("long", "sum"),
    "any_acked": ("boolean", "max"),
    "any_indeterminate": ("boolean", "max"),
    "any_failed": ("boolean", "max"),
    "first_ack_ts": ("timestamp", "min"),
    "first_attempt_ts": ("timestamp", "min"),
    "accepted_ts": ("timestamp", "min"),
    "accepted_count": ("long", "sum"),
    "backlog_ts": ("timestamp", "min"),
    "syphoned_ts": ("timestamp", "min"),
    "ledger_expired": ("boolean", "max"),
    "ledger_rejected": ("boolean", "max"),
    "size": ("long", "max"),
    "deliveries": ("long", "sum"),
    "endpoints": ("long", "sum"),
    "max_endpoint_copies": ("long", "max"),
    "live_copies": ("long", "sum"),
    "backlog_copies": ("long", "sum"),
    "dlq_copies": ("long", "sum"),
    "dlq_expired": ("boolean", "max"),
    "first_enqueued_time": ("timestamp", "min"),
    "max_delivery_count": ("long", "max"),
}


def _evidence(df: DataFrame, **cols: Column) -> DataFrame:
    """``df`` as evidence rows: the key, the given columns, nulls for the rest."""
    select = [F.col("ekey"), F.col("message_id")]
    for name, (typ, _) in _EVIDENCE.items():
        select.append((cols[name] if name in cols else F.lit(None)).cast(typ).alias(name))
    # (value, ordering) pairs for min_by/max_by.
    for name in (
        "status",
        "status_ts",
        "client_route",
        "client_route_ts",
        "gateway_route",
        "gateway_route_ts",
    ):
        typ = "timestamp" if name.endswith("_ts") else "int"
        select.append((cols[name] if name in cols else F.lit(None)).cast(typ).alias(name))
    return df.select(*select)


def ack_evidence(acks: DataFrame) -> DataFrame:
    """One evidence row per acknowledgement line (a retried message has several)."""
    acked = F.col("outcome") == "acked"
    return _evidence(
        acks,
        ack_attempts=F.lit(1),
        any_acked=acked,
        any_indeterminate=F.col("outcome") == "indeterminate",
        any_failed=F.col("outcome") == "failed",
        first_ack_ts=F.when(acked, F.col("ts")),
        first_attempt_ts=F.col("ts"),
        status=F.col("status"),
        status_ts=F.col("ts"),
        client_route=F.when(acked, _route_code(F.col("route"))),
        client_route_ts=F.when(acked, F.col("ts")),
    )


def ledger_evidence(ledger: DataFrame) -> DataFrame:
    """One evidence row per ledger event about a message."""
    ev = F.col("event")
    accepted = ev == "accepted"
    return _evidence(
        ledger.where(F.col("message_id").isNotNull() & F.col("ekey").isNotNull()),
        accepted_ts=F.when(accepted, F.col("ts")),
        accepted_count=accepted.cast("long"),
        gateway_route=F.when(accepted, _route_code(F.col("route"))),
        gateway_route_ts=F.when(accepted, F.col("ts")),
        backlog_ts=F.when(accepted & (F.col("route") == "backlog"), F.col("ts")),
        syphoned_ts=F.when(ev == "syphoned", F.col("ts")),
        ledger_expired=ev == "expired",
        ledger_rejected=ev == "rejected",
        size=F.when(accepted, F.col("size")),
    )


def delivery_evidence(delivered: DataFrame) -> DataFrame:
    """One evidence row per (message, destination): copies counted per destination first."""
    expired_copy = (F.col("source") == "dlq") & (F.col("dead_letter_reason") == TTL_EXPIRED_REASON)
    per_endpoint = delivered.groupBy("ekey", "message_id", "endpoint").agg(
        F.count(F.lit(1)).alias("n"),
        F.count_if(~expired_copy).alias("live"),
        F.count_if(F.col("backlog_copy")).alias("backlog"),
        F.count_if(F.col("source") == "dlq").alias("dlq"),
        F.bool_or(expired_copy).alias("expired"),
        F.min("enqueued_time").alias("enqueued"),
        F.max("delivery_count").alias("delivery_count"),
    )
    return _evidence(
        per_endpoint,
        deliveries=F.col("n"),
        endpoints=F.col("endpoint").isNotNull().cast("long"),
        max_endpoint_copies=F.when(F.col("endpoint").isNotNull(), F.col("n")),
        live_copies=F.col("live"),
        backlog_copies=F.col("backlog"),
        dlq_copies=F.col("dlq"),
        dlq_expired=F.col("expired"),
        first_enqueued_time=F.col("enqueued"),
        max_delivery_count=F.col("delivery_count"),
    )


def message_facts(acks: DataFrame, ledger: DataFrame, delivered: DataFrame) -> DataFrame:
    """One row per (ekey, message_id) with everything the three inputs say about it."""
    evidence = (
        ack_evidence(acks)
        .unionByName(ledger_evidence(ledger))
        .unionByName(delivery_evidence(delivered))
    )
    aggs = [getattr(F, agg)(F.col(name)).alias(name) for name, (_, agg) in _EVIDENCE.items()]
    aggs += [
        F.max_by("status", "status_ts").alias("last_status"),
        _route_name(F.min_by("client_route", "client_route_ts")).alias("client_route"),
        _route_name(F.min_by("gateway_route", "gateway_route_ts")).alias("gateway_route"),
    ]
    return evidence.groupBy("ekey", "message_id").agg(*aggs)


def entity_names(*frames: DataFrame) -> DataFrame:
    """(ekey, entity): one display spelling per entity key (entities are few)."""
    pairs = frames[0].select("ekey", "entity")
    for df in frames[1:]:
        pairs = pairs.unionByName(df.select("ekey", "entity"))
    return (
        pairs.where(F.col("ekey").isNotNull())
        .distinct()
        .groupBy("ekey")
        .agg(F.min("entity").alias("entity"))
    )


def _classification(
    cutoff: dt.datetime | None, failed_may_be_stored: bool
) -> tuple[Column, Column, Column, Column, Column]:
    """`classify`'s classification column, over its facts and its ``outcome`` and
    ``promise_ts`` columns; and the columns it is computed from that the table shows:
    (classification, deliveries, backlog copies, backlog shadow, expired)."""
    deliveries = F.coalesce(F.col("deliveries"), F.lit(0))
    is_delivered = F.coalesce(F.col("live_copies"), F.lit(0)) > 0
    stored = is_delivered | F.coalesce(F.col("dlq_expired"), F.lit(False))
    expired = F.coalesce(F.col("dlq_expired"), F.lit(False)) | F.coalesce(
        F.col("ledger_expired"), F.lit(False)
    )
    # Duplicated: a destination holds it more than once (its DLQ counts with it), or, with no
    # copy at the primary, the backlogs hold it more than once. A copy at the primary *and*
    # one left in a backlog is a "backlog shadow": the ambiguous primary send (stored, but the
    # gateway saw the send fail and backlogged it too), which the primary's duplicate
    # detection absorbs when the syphon moves it: reported, not a duplicate.
    backlog_copies = F.coalesce(F.col("backlog_copies"), F.lit(0))
    primary_copies = deliveries - backlog_copies
    duplicated = (F.coalesce(F.col("max_endpoint_copies"), F.lit(0)) > 1) | (
        (primary_copies == 0) & (backlog_copies > 1)
    )
    shadow = (primary_copies > 0) & (backlog_copies > 0)
    young = (
        F.col("promise_ts") > F.lit(cutoff).cast("timestamp") if cutoff is not None else F.lit(True)
    )
    o = F.col("outcome")
    classification = (
        F.when(duplicated & o.isin("acked", "indeterminate"), "duplicated")
        .when((o == "acked") & is_delivered, "delivered")
        .when((o == "acked") & expired, "expired")
        .when((o == "acked") & young, "pending")
        .when(o == "acked", "lost")
        .when((o == "indeterminate") & is_delivered, "unexpected")
        .when((o == "indeterminate") & expired, "expired")
        .when(o == "indeterminate", "indeterminate")
        .when(
            (o == "failed") & stored,
            "unexpected" if failed_may_be_stored else "failed-but-delivered",
        )
        .when(o == "failed", "failed")
        .when((o == "rejected") & stored, "rejected-but-delivered")
        .when(o == "rejected", "rejected")
        .when(is_delivered, "unexpected")
        .when(expired, "expired")
        .otherwise("unknown")
    )
    return classification, deliveries, backlog_copies, shadow, expired


def classify(
    acks: DataFrame,
    ledger: DataFrame,
    delivered: DataFrame,
    cutoff: dt.datetime | None,
    names: DataFrame | None = None,
    *,
    failed_may_be_stored: bool = False,
) -> DataFrame:
    """The messages table: one row per message with its classification.

    With ``failed_may_be_stored`` a delivered 5xx is ``unexpected`` (allowed) instead of
    ``failed-but-delivered`` (see ``AuditOptions``).

    The promise comes from the client's acknowledgement when there is one, else from the
    ledger (an ``accepted`` or ``syphoned`` event means the gateway answered 2xx). ``cutoff``
    is (latest ledger/delivery time - grace): a promise newer than that and not yet delivered
    is ``pending``, not ``lost``.
    """
    facts = message_facts(acks, ledger, delivered)
    ledger_promised = F.col("accepted_ts").isNotNull() | F.col("syphoned_ts").isNotNull()
    has_ack = F.coalesce(F.col("ack_attempts"), F.lit(0)) > 0
    outcome = (
        F.when(F.col("any_acked"), "acked")
        .when(F.col("any_indeterminate"), "indeterminate")
        .when(F.col("any_failed"), "failed")
        .when(has_ack, "rejected")
        .when(ledger_promised, "acked")
        .when(F.col("ledger_rejected"), "rejected")
    )
    promised_by = (
        F.when(F.col("any_acked"), "client")
        .when(~has_ack & ledger_promised, "ledger")
        .otherwise(F.lit(None).cast("string"))
    )
    promise_ts = F.when(
        F.col("outcome") == "acked",
        F.coalesce("first_ack_ts", "accepted_ts", "syphoned_ts", "first_attempt_ts"),
    )
    classification, deliveries, backlog_copies, shadow, expired = _classification(
        cutoff, failed_may_be_stored
    )
    if names is None:
        names = entity_names(acks, ledger, delivered)
    return (
        facts.withColumn("outcome", outcome)
        .withColumn("promise_ts", promise_ts)
        .withColumn("classification", classification)
        .join(F.broadcast(names), "ekey", "left")
        .select(
            F.coalesce(F.col("entity"), F.col("ekey")).alias("entity"),
            "message_id",
            "classification",
            "outcome",
            promised_by.alias("promised_by"),
            "promise_ts",
            F.coalesce(F.col("ack_attempts"), F.lit(0)).alias("ack_attempts"),
            "last_status",
            "client_route",
            "gateway_route",
            "accepted_ts",
            F.coalesce(F.col("accepted_count"), F.lit(0)).alias("accepted_count"),
            "backlog_ts",
            "syphoned_ts",
            deliveries.alias("deliveries"),
            F.coalesce(F.col("endpoints"), F.lit(0)).alias("endpoints"),
            backlog_copies.alias("backlog_copies"),
            F.coalesce(F.col("dlq_copies"), F.lit(0)).alias("dlq_copies"),
            shadow.alias("backlog_shadow"),
            "first_enqueued_time",
            "first_attempt_ts",
            "max_delivery_count",
            expired.alias("expired"),
            "size",
            "ekey",
        )
    )


# Classifications that are anomalies, with their severity. "unexpected" is an anomaly only
# when nothing could explain the delivery (no indeterminate outcome): see anomalies().
ANOMALY_SEVERITY: Final[Mapping[str, str]] = {
    "lost": "error",
    "failed-but-delivered": "error",
    "rejected-but-delivered": "error",
    "unexpected": "error",
    "duplicated": "warning",
}

_DETAILS: Final[Mapping[str, str]] = {
    "lost": "acknowledged, never delivered, not expired, older than the grace window",
    "failed-but-delivered": "the client got a 5xx (not stored) but the message was delivered",
    "rejected-but-delivered": "the client got a 4xx (not stored) but the message was delivered",
    "unexpected": "delivered, but no client or gateway ever acknowledged it",
    "duplicated": "delivered more than once to one destination (or, never at the primary, "
    "more than once to the backlogs)",
}
BACKLOG_SHADOW: Final = "backlog_shadow"
_SHADOW_DETAIL: Final = (
    "a copy at the primary and another left in a backlog queue: an ambiguous primary send, "
    "absorbed by the primary's duplicate detection when syphoned"
)


def message_anomalies(messages: DataFrame) -> DataFrame:
    """Anomaly rows for the messages that break a promise (or look suspicious)."""
    kind = F.col("classification")
    # coalesce: a message nobody acknowledged has a null outcome, and is not explained.
    unknown_outcome = F.coalesce(F.col("outcome").isin("indeterminate", "failed"), F.lit(False))
    explained = (kind == "unexpected") & unknown_outcome
    is_anomaly = kind.isin(*ANOMALY_SEVERITY) & ~explained
    severity = F.create_map(*[F.lit(x) for kv in ANOMALY_SEVERITY.items() for x in kv])
    details = F.create_map(*[F.lit(x) for kv in _DETAILS.items() for x in kv])
    ts = F.coalesce("promise_ts", "first_enqueued_time", "accepted_ts").alias("ts")
    by_class = messages.where(is_anomaly).select(
        kind.alias("kind"),
        severity[kind].alias("severity"),
        "entity",
        "message_id",
        F.concat(
            details[kind],
            F.lit(" (deliveries="),
            F.col("deliveries").cast("string"),
            F.lit(", outcome="),
            F.coalesce(F.col("outcome"), F.lit("none")),
            F.lit(")"),
        ).alias("detail"),
        ts,
    )
    shadows = messages.where(F.col("backlog_shadow")).select(
        F.lit(BACKLOG_SHADOW).alias("kind"),
        F.lit("info").alias("severity"),
        "entity",
        "message_id",
        F.lit(_SHADOW_DETAIL).alias("detail"),
        ts,
    )
    return by_class.unionByName(shadows)


# -- throughput and latency ------------------------------------------------------------------


_THROUGHPUT_COUNTS: Final = (
    "accepted",
    "accepted_primary",
    "accepted_backlog",
    "syphoned",
    "rejected",
    "bytes_accepted",
    "client_acked",
    "client_rejected",
    "client_failed",
    "client_indeterminate",
)


def throughput(ledger: DataFrame, acks: DataFrame, names: DataFrame | None = None) -> DataFrame:
    """Per entity and minute: what the gateway did (ledger) and what clients saw (acks)."""
    ev, route, o = F.col("event"), F.col("route"), F.col("outcome")
    accepted = ev == "accepted"

    def rows(df: DataFrame, **cols: Column) -> DataFrame:
        return df.select(
            "ekey",
            F.date_trunc("minute", "ts").alias("minute"),
            *[(cols.get(c, F.lit(0))).cast("long").alias(c) for c in _THROUGHPUT_COUNTS],
        )

    gateway = rows(
        ledger.where(F.col("ekey").isNotNull() & ev.isin("accepted", "syphoned", "rejected")),
        accepted=accepted,
        accepted_primary=accepted & (route == "primary"),
        accepted_backlog=accepted & (route == "backlog"),
        syphoned=ev == "syphoned",
        rejected=ev == "rejected",
        bytes_accepted=F.when(accepted, F.coalesce(F.col("size"), F.lit(0))).otherwise(0),
    )
    client = rows(
        acks,
        client_acked=o == "acked",
        client_rejected=o == "rejected",
        client_failed=o == "failed",
        client_indeterminate=o == "indeterminate",
    )
    per_minute = (
        gateway.unionByName(client)
        .groupBy("ekey", "minute")
        .agg(*[F.sum(c).alias(c) for c in _THROUGHPUT_COUNTS])
    )
    if names is None:
        names = entity_names(ledger, acks)
    return (
        per_minute.join(F.broadcast(names), "ekey", "left")
        .select(
            F.coalesce(F.col("entity"), F.col("ekey")).alias("entity"),
            "minute",
            *_THROUGHPUT_COUNTS,
        )
        .orderBy("minute", "entity")
    )


PERCENTILES: Final = (0.5, 0.9, 0.99, 0.999)


def latency(ledger: DataFrame, acks: DataFrame) -> DataFrame:
    """Latency percentiles per route, as the gateway measured them and as clients saw them."""
    gateway = ledger.where((F.col("event") == "accepted") & F.col("latency_ms").isNotNull()).select(
        F.lit("gateway").alias("source"), "route", "latency_ms"
    )
    client = acks.where((F.col("outcome") == "acked") & F.col("latency_ms").isNotNull()).select(
        F.lit("client").alias("source"), "route", "latency_ms"
    )
    both = gateway.unionByName(client).withColumn(
        "route", F.coalesce(F.col("route"), F.lit("unknown"))
    )
    agg = both.groupBy("source", "route").agg(
        F.count(F.lit(1)).alias("count"),
        F.avg("latency_ms").alias("mean_ms"),
        F.percentile_approx("latency_ms", list(PERCENTILES), 10_000).alias("pct"),
        F.max("latency_ms").alias("max_ms"),
    )
    return agg.select(
        "source",
        "route",
        "count",
        "mean_ms",
        *[F.col("pct")[i].alias(_pct_name(p)) for i, p in enumerate(PERCENTILES)],
        "max_ms",
    ).orderBy("source", "route")


def _pct_name(p: float) -> str:
    digits = f"{p * 100:g}".replace(".", "")
    return f"p{digits}_ms"


# -- failover windows ---------------------------------------------------------------------------


def failover_windows(
    ledger: DataFrame, start_of_data: dt.datetime | None, end_of_data: dt.datetime | None
) -> DataFrame:
    """One row per failover window per entity, from failover_start to failover_end.

    Failover state is shared by all replicas (Redis), so events are paired per entity,
    whichever replica wrote them; repeats (several replicas logging the same transition) are
    collapsed. A window still open at the end of the data is closed there (``closed_by =
    end_of_data``); an end without a start opens at the start of the data.
    """
    w = Window.partitionBy("ekey").orderBy("ts", "event")
    transitions = (
        ledger.where(
            F.col("event").isin("failover_start", "failover_end") & F.col("ekey").isNotNull()
        )
        .select("ekey", "entity", "replica", "ts", "event")
        .withColumn("prev", F.lag("event").over(w))
        .where(F.col("prev").isNull() | (F.col("prev") != F.col("event")))
        .withColumn("next_event", F.lead("event").over(w))
        .withColumn("next_ts", F.lead("ts").over(w))
    )
    eod = F.lit(end_of_data).cast("timestamp")
    sod = F.lit(start_of_data).cast("timestamp")
    starts = transitions.where(F.col("event") == "failover_start").select(
        "ekey",
        "entity",
        F.col("ts").alias("start_ts"),
        F.when(F.col("next_event") == "failover_end", F.col("next_ts"))
        .otherwise(eod)
        .alias("end_ts"),
        F.lit("failover_start").alias("opened_by"),
        F.when(F.col("next_event") == "failover_end", "failover_end")
        .otherwise("end_of_data")
        .alias("closed_by"),
        F.col("replica").alias("start_replica"),
    )
    orphan_ends = transitions.where(
        (F.col("event") == "failover_end") & F.col("prev").isNull()
    ).select(
        "ekey",
        "entity",
        sod.alias("start_ts"),
        F.col("ts").alias("end_ts"),
        F.lit("start_of_data").alias("opened_by"),
        F.lit("failover_end").alias("closed_by"),
        F.lit(None).cast("string").alias("start_replica"),
    )
    return (
        starts.unionByName(orphan_ends)
        .withColumn("duration_s", _seconds_between(F.col("start_ts"), F.col("end_ts")))
        .orderBy("start_ts", "ekey")
    )


def window_activity(ledger: DataFrame, windows: DataFrame) -> DataFrame:
    """Pings and backlog sends inside each failover window (windows are few: broadcast)."""
    events = ledger.where(
        (F.col("event") == "ping")
        | ((F.col("event") == "accepted") & (F.col("route") == "backlog"))
    ).select("ekey", "ts", "event")
    # Renamed columns: both sides derive from the ledger, so their columns must not clash.
    win = windows.select(
        F.col("ekey").alias("w_ekey"),
        F.col("start_ts").alias("w_start"),
        F.col("end_ts").alias("w_end"),
    )
    hits = events.join(
        F.broadcast(win),
        (F.col("ekey") == F.col("w_ekey"))
        & (F.col("ts") >= F.col("w_start"))
        & (F.col("ts") <= F.col("w_end")),
    )
    counts = hits.groupBy(F.col("w_ekey").alias("ekey"), F.col("w_start").alias("start_ts")).agg(
        F.count_if(F.col("event") == "ping").alias("pings"),
        F.count_if(F.col("event") == "accepted").alias("sent_to_backlog"),
    )
    return (
        windows.join(counts, ["ekey", "start_ts"], "left")
        .withColumn("pings", F.coalesce(F.col("pings"), F.lit(0)))
        .withColumn("sent_to_backlog", F.coalesce(F.col("sent_to_backlog"), F.lit(0)))
        .select(
            "entity",
            "start_ts",
            "end_ts",
            "duration_s",
            "opened_by",
            "closed_by",
            "start_replica",
            "pings",
            "sent_to_backlog",
        )
        .orderBy("start_ts", "entity")
    )


# -- backlog ------------------------------------------------------------------------------------


def backlog_dwell(ledger: DataFrame, messages: DataFrame) -> DataFrame:
    """Per message sent to a backlog queue: which one, and how long it waited until syphoned."""
    state = (
        F.when(F.col("syphoned_ts").isNotNull(), "syphoned")
        .when(F.col("expired"), "expired")
        .otherwise("waiting")
    )
    queues = (
        ledger.where(
            (F.col("event") == "accepted")
            & (F.col("route") == "backlog")
            & F.col("message_id").isNotNull()
        )
        .select("ekey", "message_id", F.col("ts").alias("backlog_ts"), "backlog")
        .dropDuplicates(["ekey", "message_id", "backlog_ts"])
    )
    backlogged = messages.where(F.col("backlog_ts").isNotNull()).select(
        "ekey", "entity", "message_id", "backlog_ts", "syphoned_ts", "expired"
    )
    return backlogged.join(queues, ["ekey", "message_id", "backlog_ts"], "left").select(
        "entity",
        "message_id",
        "backlog",
        "backlog_ts",
        "syphoned_ts",
        _seconds_between(F.col("backlog_ts"), F.col("syphoned_ts")).alias("dwell_s"),
        state.alias("state"),
    )


def backlog_depth(ledger: DataFrame) -> DataFrame:
    """Messages in the backlog queues per minute: cumulative (sent to backlog - taken out)."""
    ev = F.col("event")
    into = (ev == "accepted") & (F.col("route") == "backlog")
    out = (ev == "syphoned") | (ev.isin("expired", "dead_lettered") & F.col("backlog").isNotNull())
    per_minute = (
        ledger.where(into | out)
        .groupBy(F.date_trunc("minute", "ts").alias("minute"))
        .agg(
            F.count_if(into).alias("into_backlog"),
            F.count_if(out).alias("out_of_backlog"),
        )
    )
    # One row per minute of data: a single partition for the running sum is fine here.
    running = Window.orderBy("minute").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    return per_minute.withColumn(
        "depth", F.sum(F.col("into_backlog") - F.col("out_of_backlog")).over(running)
    ).orderBy("minute")


# -- billing ------------------------------------------------------------------------------------


def billed_operations(ledger: DataFrame, options: AuditOptions) -> DataFrame:
    """Billed operations and their cost per day and stage, from the ledger.

    A message sent straight to the primary costs a send and (its consumer's) receive; a
    syphoned one costs four (docs/design.md#the-syphon: send to backlog, receive from backlog,
    send to primary, receive from primary); a ping costs one; a message the syphon
    dead-letters or finds expired in a backlog costs its receive from the backlog. A message
    over ``billing_chunk_kib`` counts one operation per started chunk. Receives from the
    primary are estimated as one per message (a topic with N subscriptions bills N).
    """
    ev, route = F.col("event"), F.col("route")
    stages = (
        F.when(
            (ev == "accepted") & (route == "backlog"),
            F.array(F.lit("send_backlog")),
        )
        .when(ev == "accepted", F.array(F.lit("send_primary"), F.lit("receive_primary")))
        .when(
            ev == "syphoned",
            F.array(F.lit("receive_backlog"), F.lit("send_primary"), F.lit("receive_primary")),
        )
        .when(
            ev.isin("expired", "dead_lettered") & F.col("backlog").isNotNull(),
            F.array(F.lit("receive_backlog")),
        )
        .when(ev == "ping", F.array(F.lit("ping")))
    )
    if options.billing_chunk_kib > 0:
        chunk = float(options.billing_chunk_kib * 1024)
        ops = F.greatest(F.lit(1), F.ceil(F.coalesce(F.col("size"), F.lit(0)) / F.lit(chunk)))
    else:
        ops = F.lit(1)
    price = F.create_map(
        *[x for s in BILLING_STAGES for x in (F.lit(s), F.lit(float(options.price(s))))]
    )
    return (
        ledger.select(
            F.to_date("ts").alias("day"),
            F.explode(stages).alias("stage"),
            ops.cast("long").alias("ops"),
        )
        .groupBy("day", "stage")
        .agg(F.count(F.lit(1)).alias("events"), F.sum("ops").alias("operations"))
        .withColumn("price_per_million", price[F.col("stage")])
        .withColumn("cost", F.col("operations") / F.lit(1e6) * F.col("price_per_million"))
        .orderBy("day", "stage")
    )
