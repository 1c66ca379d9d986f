"""The audit job: reconcile ledger + client acknowledgements + delivered ids, write the report.

Runs unchanged under ``spark-submit``, on a laptop or a cluster (``make pipeline-dist`` builds
the ``--py-files`` archive the cluster's driver and executors import ``pipeline`` from)::

    spark-submit --master <url> --deploy-mode cluster --py-files dist/sbgate-pipeline.zip \\
        pipeline/job.py --ledger abfss://…/ledger --delivered abfss://…/delivered \\
        --out abfss://…/audit --report-dir abfss://…/audit/report

or locally through ``python -m pipeline`` / ``gateway audit`` (``pipeline.cli``), which builds
an offline-safe ``local[*]`` session. Exit codes: 0 no acknowledged message lost, 3 at least
one lost or (``--strict-sessions``) a session's order inverted, 2 bad input.

Where things go:

* ``--out`` is a URI (``file://``, ``hdfs://``, ``abfss://``, ``s3a://``…) or a plain path, as
  Spark resolves it (a plain path is on the default filesystem: local in local mode). The
  tables are written through Spark's DataFrameWriter, as Parquet, each table a folder under
  it, partitioned by UTC day (``day=YYYY-MM-DD/``) where the table has a time.
* ``--report-dir`` gets report.md, report.json and the PNG charts. A plain path is a local
  directory (on the driver); a URI goes through Hadoop's FileSystem API with the session's
  Hadoop configuration, so in cluster mode the report lands in the same storage as the
  tables (``--report-dir abfss://…``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):  # run as a file by spark-submit: make `pipeline` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pipeline import report, sessions
from pipeline.inputs import (
    VALID,
    InputError,
    ResolvedInput,
    parse_acks,
    parse_delivered,
    parse_ledger,
    read_jsonl,
    resolve,
)
from pipeline.reconcile import (
    ANOMALY_SEVERITY,
    BACKLOG_SHADOW,
    DEFAULT_BACKLOG_PATTERN,
    AuditOptions,
    backlog_depth,
    backlog_dwell,
    billed_operations,
    classify,
    entity_names,
    failover_windows,
    latency,
    message_anomalies,
    throughput,
    window_activity,
)
from pipeline.schemas import (
    ACK_SCHEMA,
    BILLING_STAGES,
    CLASSIFICATIONS,
    DELIVERED_SCHEMA,
    LEDGER_SCHEMA,
)

log = logging.getLogger("pipeline")

EXIT_OK: Final = 0
EXIT_BAD_INPUT: Final = 2
EXIT_LOST: Final = 3
# A strict entity's session delivered out of acknowledgement order breaks the promise as a
# loss does: the same exit code, the verdict line says which.
EXIT_INVERTED: Final = EXIT_LOST

TABLES: Final = (
    "messages",
    "anomalies",
    "throughput",
    "latency",
    "failover_windows",
    "backlog_dwell",
    "backlog_depth",
    "billed_ops",
    "session_order",
)
ANOMALY_SCHEMA: Final = StructType(
    [
        StructField("kind", StringType()),
        StructField("severity", StringType()),
        StructField("entity", StringType()),
        StructField("message_id", StringType()),
        StructField("detail", StringType()),
        StructField("ts", TimestampType()),
    ]
)
_FEATURE_STAGES: Final = ("send_backlog", "receive_backlog", "ping")

# Tables partitioned by UTC day (Parquet ``day=YYYY-MM-DD/`` folders) and the time columns the
# day comes from, first non-null wins (a message never promised has no promise time). A reader
# filtering on ``day`` then reads only those folders. ``latency`` has no time: not partitioned.
TABLE_DAY: Final[Mapping[str, tuple[str, ...]]] = {
    "messages": ("promise_ts", "accepted_ts", "first_attempt_ts", "first_enqueued_time"),
    "anomalies": ("ts",),
    "throughput": ("minute",),
    "failover_windows": ("start_ts",),
    "backlog_dwell": ("backlog_ts",),
    "backlog_depth": ("minute",),
    "billed_ops": ("day",),
    # Not "session_order": its rows are inversions, normally none, and an unpartitioned empty
    # table still has a Parquet file with its columns (a partitioned one has no file at all).
}
DEFAULT_REPORT_DIR: Final = "audit-report"
_SCHEME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True, slots=True)
class JobOptions:
    """Everything one run needs (``parse_args`` builds it from the command line)."""

    ledger: tuple[str, ...]
    delivered: tuple[str, ...]
    out: str  # a URI or a plain path, handed to Spark as it is
    acks: tuple[str, ...] = ()
    report_dir: str = DEFAULT_REPORT_DIR  # a local directory, or a URI (Hadoop FileSystem)
    audit: AuditOptions = field(default_factory=AuditOptions)
    charts: bool = True
    lost_sample: int = 20


# -- command line -----------------------------------------------------------------------------


def build_parser(prog: str = "pipeline", *, local: bool = False) -> argparse.ArgumentParser:
    """The job's arguments; ``local`` adds the options of a locally built session."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Reconcile the gateway's ledger, client acknowledgements and delivered "
        "ids; write Parquet tables, report.md, report.json and charts. Exit code 3 when an "
        "acknowledged message was lost or a strict entity's session order was inverted, 2 on "
        "bad input.",
    )
    paths = "file, directory (searched recursively for *.jsonl[.gz]) or glob; repeatable"
    p.add_argument("--ledger", action="extend", nargs="+", default=[], help=f"ledger v1/v2 {paths}")
    p.add_argument(
        "--acks", action="extend", nargs="+", default=[], help=f"client acknowledgements {paths}"
    )
    p.add_argument(
        "--delivered", action="extend", nargs="+", default=[], help=f"delivered ids {paths}"
    )
    p.add_argument(
        "--out",
        required=True,
        help="where the Parquet tables go (overwritten): a URI (file://, hdfs://, abfss://, "
        "s3a://) or a plain path, written through Spark",
    )
    p.add_argument(
        "--report-dir",
        default=DEFAULT_REPORT_DIR,
        help="where report.md, report.json and the charts go: a local directory (default "
        "./%(default)s), or a URI written through Hadoop's FileSystem (e.g. abfss://…)",
    )
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=60.0,
        help="promises newer than (end of data - grace) are pending, not lost (default 60)",
    )
    p.add_argument(
        "--price-per-million-ops",
        type=float,
        default=0.05,
        help="price of a million billed operations, any currency (default 0.05)",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="STAGE=PRICE",
        help=f"price per million for one stage ({', '.join(BILLING_STAGES)}); repeatable",
    )
    p.add_argument(
        "--billing-chunk-kib",
        type=int,
        default=64,
        help="each started chunk of this size is one more operation; 0 = one per message",
    )
    p.add_argument(
        "--backlog-pattern",
        default=DEFAULT_BACKLOG_PATTERN,
        help="regex matching backlog queue paths in delivered ids (default %(default)s)",
    )
    p.add_argument(
        "--failed-may-be-stored",
        action="store_true",
        help="a 5xx after a send was tried may have stored the message (broker timeout): "
        "a delivered 5xx is then an allowed 'unexpected', not 'failed-but-delivered'",
    )
    p.add_argument(
        "--strict-sessions",
        action="append",
        default=[],
        metavar="ENTITY[,ENTITY…]",
        help="entities whose sessions must keep their order (the gateway's session_order = "
        "strict); '*' for every entity; repeatable. Any message of a session stored before "
        "the one acknowledged just before it is an inversion: exit code 3",
    )
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    if local:
        p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
        p.add_argument("--driver-memory", default="2g", help="Spark driver memory (default 2g)")
    return p


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobOptions:
    stage_prices: dict[str, float] = {}
    for item in args.price:
        stage, sep, value = item.partition("=")
        if not sep or stage not in BILLING_STAGES:
            parser.error(f"--price {item!r}: expected STAGE=PRICE, STAGE in {BILLING_STAGES}")
        try:
            stage_prices[stage] = float(value)
        except ValueError:
            parser.error(f"--price {item!r}: {value!r} is not a number")
    if args.grace_seconds < 0:
        parser.error("--grace-seconds must be >= 0")
    if args.billing_chunk_kib < 0:
        parser.error("--billing-chunk-kib must be >= 0")
    return JobOptions(
        ledger=tuple(args.ledger),
        acks=tuple(args.acks),
        delivered=tuple(args.delivered),
        out=args.out,
        report_dir=args.report_dir,
        audit=AuditOptions(
            grace_seconds=args.grace_seconds,
            price_per_million_ops=args.price_per_million_ops,
            stage_prices=stage_prices,
            billing_chunk_kib=args.billing_chunk_kib,
            backlog_pattern=args.backlog_pattern,
            failed_may_be_stored=args.failed_may_be_stored,
            strict_sessions=sessions.strict_keys(args.strict_sessions),
        ),
        charts=not args.no_charts,
    )


def parse_args(argv: Sequence[str] | None, prog: str = "pipeline") -> JobOptions:
    """Options from the command line; raises SystemExit(2) on a usage error."""
    parser = build_parser(prog)
    return options_from_args(parser.parse_args(argv), parser)


# -- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Loaded:
    ledger: DataFrame
    acks: DataFrame
    delivered: DataFrame
    stats: dict[str, dict[str, Any]]
    start: dt.datetime | None  # earliest time in any input
    end: dt.datetime | None  # latest time in any input
    latest_evidence: dt.datetime | None  # latest ledger event or delivery
    cached: list[DataFrame]  # to unpersist at the end


def _load(spark: SparkSession, opts: JobOptions) -> _Loaded:
    """Read, validate and cache the inputs: one pass over each input's JSON (`_read_input`).
    Raises `InputError` when a required input is missing."""
    resolved = {
        "ledger": resolve("ledger", opts.ledger, required=True),
        "acks": resolve("acks", opts.acks, required=False),
        "delivered": resolve("delivered", opts.delivered, required=True),
    }
    plan: dict[str, tuple[StructType, Any, str]] = {
        "ledger": (LEDGER_SCHEMA, parse_ledger, "ts"),
        "acks": (ACK_SCHEMA, parse_acks, "ts"),
        "delivered": (
            DELIVERED_SCHEMA,
            lambda raw: parse_delivered(raw, opts.audit.backlog_pattern),
            "enqueued_time",
        ),
    }
    inputs = {name: _read_input(spark, name, resolved[name], *plan[name]) for name in plan}
    ranges = {name: (i.lo, i.hi) for name, i in inputs.items()}
    los = [lo for lo, _ in ranges.values() if lo is not None]
    his = [hi for _, hi in ranges.values() if hi is not None]
    evidence = [ranges[n][1] for n in ("ledger", "delivered") if ranges[n][1] is not None]
    return _Loaded(
        inputs["ledger"].frame,
        inputs["acks"].frame,
        inputs["delivered"].frame,
        {name: i.stats for name, i in inputs.items()},
        min(los) if los else None,
        max(his) if his else None,
        max(evidence) if evidence else (max(his) if his else None),  # type: ignore[type-var]
        [df for i in inputs.values() for df in i.cached],
    )


@dataclass(frozen=True, slots=True)
class _Input:
    """One input, read: its valid rows (cached), its counts and its time range."""

    frame: DataFrame
    stats: dict[str, Any]
    lo: dt.datetime | None
    hi: dt.datetime | None
    cached: list[DataFrame]


def _read_input(
    spark: SparkSession, name: str, r: ResolvedInput, schema: StructType, parse: Any, ts_col: str
) -> _Input:
    """One pass over an input's JSON counts its lines, its valid lines and (for the ledger)
    its distinct event ids, and finds its time range; the valid rows stay cached for the rest
    of the job. Ledger duplicates are dropped only when that pass saw some."""
    rows = parse(read_jsonl(spark, r, schema)).cache()
    cached = [rows]
    valid = F.col(VALID)
    aggs = [
        F.count(F.lit(1)).alias("lines"),
        F.count_if(valid).alias("valid"),
        F.min(F.when(valid, F.col(ts_col))).alias("lo"),
        F.max(F.when(valid, F.col(ts_col))).alias("hi"),
    ]
    if name == "ledger":
        # Distinct 64-bit hashes: a hash aggregate on longs instead of on strings. Real
        # duplicates always show (equal ids, equal hashes); a collision can only make us
        # de-duplicate (exactly, by event_id) when there was nothing to drop.
        distinct = F.count_distinct(F.when(valid, F.xxhash64("event_id")))
        aggs.append(distinct.alias("distinct"))
    row = rows.agg(*aggs).first()
    assert row is not None
    kept = row["distinct"] if name == "ledger" else row["valid"]
    frame = rows.where(valid).drop(VALID)
    if name == "ledger" and kept < row["valid"]:
        # Only when the pass above saw duplicates: de-duplicating costs a shuffle.
        frame = frame.dropDuplicates(["event_id"]).cache()
        cached.append(frame)
        kept = frame.count()
    stats = {
        "paths": list(r.paths) if r.local_files is None else None,
        "files": r.local_files,
        "lines": row["lines"],
        "valid": row["valid"],
        "ignored": row["lines"] - row["valid"],
        "duplicates_dropped": row["valid"] - kept,
    }
    log.info("%s: %d lines, %d valid, %d kept", name, row["lines"], row["valid"], kept)
    return _Input(frame, stats, row["lo"], row["hi"], cached)


def table_uri(out: str, name: str) -> str:
    """Where table `name` goes: under `out`, its scheme and authority kept as they are."""
    return f"{out.rstrip('/')}/{name}"


def _write(df: DataFrame, out: str, name: str, *, small: bool = False) -> None:
    """Write one table through Spark: Parquet, partitioned by day where it has a time."""
    day_from = TABLE_DAY.get(name)
    if day_from and day_from != ("day",):
        df = df.withColumn("day", F.to_date(F.coalesce(*(F.col(c) for c in day_from))))
    writer = (df.coalesce(1) if small else df).write.mode("overwrite")
    if day_from:
        writer = writer.partitionBy("day")
    writer.parquet(table_uri(out, name))


def publish_report(spark: SparkSession, staging: Path, report_dir: str) -> str:
    """Copy the report files from `staging` to `report_dir`; returns where report.md went.

    A URI goes through Hadoop's FileSystem (the session's Hadoop configuration: the same
    credentials and connectors as the tables); a plain path is a local directory.
    """
    files = sorted(p for p in staging.iterdir() if p.is_file())
    if _SCHEME.match(report_dir):
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        hadoop_path = jvm.org.apache.hadoop.fs.Path
        target = hadoop_path(report_dir)
        conf = spark.sparkContext._jsc.hadoopConfiguration()  # type: ignore[union-attr]
        fs = target.getFileSystem(conf)
        fs.mkdirs(target)
        for f in files:
            # delSrc=False, overwrite=True
            fs.copyFromLocalFile(False, True, hadoop_path(str(f)), hadoop_path(target, f.name))
        return f"{report_dir.rstrip('/')}/report.md"
    local = Path(report_dir)
    local.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, local / f.name)
    return str(local / "report.md")


def _as_dicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in rows]


def run(spark: SparkSession, opts: JobOptions) -> int:
    """Run the audit on ``spark``; returns the exit code (0, 2 or 3). Never calls sys.exit."""
    started = time.monotonic()
    try:
        loaded = _load(spark, opts)
    except InputError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with tempfile.TemporaryDirectory(prefix="sbgate-report-") as staging:
        return _run(spark, opts, loaded, started, Path(staging))


def _run(
    spark: SparkSession, opts: JobOptions, loaded: _Loaded, started: float, staging: Path
) -> int:
    """The audit after loading, in stages: reconcile the messages, then the session order of
    strict entities, failover windows, anomalies, throughput, latency, backlog and billing —
    each writes its table to ``opts.out`` and returns its section of the report — then the
    charts, and the report, staged locally and published. Returns the exit code."""
    audit = _Audit(spark, opts, loaded, staging)
    reconciled = _reconcile(audit)
    order = _session_order(audit, reconciled)
    windows = _failover(audit)
    _anomalies(audit, reconciled, windows, order)
    activity = _throughput(audit, reconciled.names)
    latency_ms = _latency(audit)
    backlog, depth = _backlog(audit, reconciled.messages)
    billing = _billing(audit)
    exit_code = EXIT_LOST if reconciled.lost else EXIT_INVERTED if order.inversions else EXIT_OK
    chart_files = _charts(audit, windows, activity, depth, latency_ms) if opts.charts else []
    summary: dict[str, Any] = {
        "version": 1,
        "generated_at": dt.datetime.now(dt.UTC),
        "exit_code": exit_code,
        "verdict": report.verdict(
            lost=reconciled.lost,
            pending=reconciled.by_class.get("pending", 0),
            promised=reconciled.promised,
            grace_seconds=opts.audit.grace_seconds,
            order=order.verdict(),
        ),
        "time_range": {"start": loaded.start, "end": loaded.end},
        "grace_seconds": opts.audit.grace_seconds,
        "cutoff": audit.cutoff,
        "inputs": loaded.stats,
        **reconciled.report(),
        "session_order": order.report(),
        **_failover_report(windows),
        "backlog": backlog,
        "latency_ms": latency_ms,
        "throughput": activity.report(),
        "billing": billing,
        "tables": list(TABLES),
        "out": opts.out,
        "charts": chart_files,
        "elapsed_seconds": round(time.monotonic() - started, 2),
    }
    _publish(audit, summary, started)
    return exit_code


@dataclass(slots=True)
class _Audit:
    """One run after loading: its options, inputs and local staging directory, and the
    DataFrames it cached (unpersisted once the report is out)."""

    spark: SparkSession
    opts: JobOptions
    loaded: _Loaded
    staging: Path
    cached: list[DataFrame] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cached = list(self.loaded.cached)

    @property
    def cutoff(self) -> dt.datetime | None:
        """Promises newer than this are pending, not lost (the grace window)."""
        latest = self.loaded.latest_evidence
        grace = dt.timedelta(seconds=self.opts.audit.grace_seconds)
        return latest - grace if latest is not None else None

    def keep(self, df: DataFrame) -> DataFrame:
        """`df`, cached for the rest of the run."""
        self.cached.append(df.cache())
        return self.cached[-1]

    def write(self, df: DataFrame, name: str, *, small: bool = False) -> None:
        _write(df, self.opts.out, name, small=small)


@dataclass(slots=True)
class _Reconciled:
    """The messages stage's result: every message classified, and its counts."""

    names: DataFrame  # entity keys and names, for the throughput table
    messages: DataFrame
    by_class: dict[str, int]
    by_kind: dict[str, dict[str, Any]]  # anomaly counts by kind; later stages add theirs
    promised: int
    lost_sample: list[dict[str, Any]]

    @property
    def lost(self) -> int:
        return self.by_class["lost"]

    def report(self) -> dict[str, Any]:
        """The report's messages, lost sample and anomalies sections."""
        kinds = self.by_kind.values()
        return {
            "messages": {
                "total": sum(self.by_class.values()),
                "promised": self.promised,
                "by_classification": self.by_class,
            },
            "lost_sample": self.lost_sample,
            "anomalies": {
                "total": sum(v["count"] for v in kinds),
                "errors": sum(v["count"] for v in kinds if v["severity"] == "error"),
                "by_kind": self.by_kind,
            },
        }


def _reconcile(audit: _Audit) -> _Reconciled:
    """Classify every message (the heart of the audit) and write the messages table. One
    count per (classification, outcome) gives the classification totals, the promises and
    the message-level anomaly counts."""
    loaded = audit.loaded
    names = audit.keep(entity_names(loaded.acks, loaded.ledger, loaded.delivered))
    messages = audit.keep(
        classify(
            loaded.acks,
            loaded.ledger,
            loaded.delivered,
            audit.cutoff,
            names,
            failed_may_be_stored=audit.opts.audit.failed_may_be_stored,
        )
    )
    audit.write(messages.drop("ekey"), "messages")
    counts = messages.groupBy("classification", "outcome", "backlog_shadow").agg(
        F.count(F.lit(1)).alias("n")
    )
    by_class = {c: 0 for c in CLASSIFICATIONS}
    by_kind: dict[str, dict[str, Any]] = {}
    promised = 0
    for r in counts.collect():
        cls, outcome, n = r["classification"], r["outcome"], r["n"]
        by_class[cls] += n
        promised += n if outcome == "acked" else 0
        explained = cls == "unexpected" and outcome in ("indeterminate", "failed")
        if cls in ANOMALY_SEVERITY and not explained:
            kind = by_kind.setdefault(cls, {"severity": ANOMALY_SEVERITY[cls], "count": 0})
            kind["count"] += n
        if r["backlog_shadow"]:
            kind = by_kind.setdefault(BACKLOG_SHADOW, {"severity": "info", "count": 0})
            kind["count"] += n
    lost_sample = (
        _as_dicts(
            messages.where(F.col("classification") == "lost")
            .orderBy("promise_ts", "entity", "message_id")
            .select("entity", "message_id", "promise_ts", "promised_by")
            .limit(audit.opts.lost_sample)
            .collect()
        )
        if by_class["lost"]
        else []
    )
    return _Reconciled(names, messages, by_class, by_kind, promised, lost_sample)


def _failover(audit: _Audit) -> list[dict[str, Any]]:
    """The failover windows (the anomalies and the charts need them too), written."""
    ledger = audit.loaded.ledger
    windows_df = audit.keep(
        window_activity(ledger, failover_windows(ledger, audit.loaded.start, audit.loaded.end))
    )
    windows = _as_dicts(windows_df.collect())
    audit.write(windows_df, "failover_windows", small=True)
    return windows


def _failover_report(windows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report's failover summary and windows."""
    durations = [w["duration_s"] for w in windows if w["duration_s"] is not None]
    return {
        "failover": {
            "count": len(windows),
            "total_seconds": float(sum(durations)),
            "longest_seconds": max(durations) if durations else None,
            "open_at_end": sum(1 for w in windows if w["closed_by"] == "end_of_data"),
        },
        "failover_windows": list(windows),
    }


@dataclass(slots=True)
class _SessionOrder:
    """The session order stage's result (``--strict-sessions``): what was compared, and the
    inversions found (their DataFrame feeds the anomalies table)."""

    entities: tuple[str, ...]
    inversions_df: DataFrame
    sessions: int = 0
    messages: int = 0
    inversions: int = 0
    by_entity: dict[str, int] = field(default_factory=dict)
    sample: list[dict[str, Any]] = field(default_factory=list)

    def verdict(self) -> str | None:
        """The verdict line's session part (None when no entity is strict)."""
        if not self.entities:
            return None
        if self.inversions:
            return f"{self.inversions} session order INVERSION(S) in strict entities"
        return (
            f"session order kept ({self.messages} message(s) in {self.sessions} "
            "session(s) of strict entities checked)"
        )

    def report(self) -> dict[str, Any]:
        return {
            "strict_entities": list(self.entities),
            "sessions_checked": self.sessions,
            "messages_checked": self.messages,
            "inversions": self.inversions,
            "inversions_by_entity": self.by_entity,
            "inversion_sample": self.sample,
        }


def _session_order(audit: _Audit, reconciled: _Reconciled) -> _SessionOrder:
    """The session_order table (inversions in strict entities), written; the counts for the
    report. Nothing to compute (and an empty table) without ``--strict-sessions``."""
    keys = audit.opts.audit.strict_sessions
    loaded = audit.loaded
    checked, inversions = sessions.session_order(
        loaded.ledger, loaded.delivered, keys, reconciled.names
    )
    if keys:  # counted and searched for inversions: the join is computed once
        checked = audit.keep(checked)
    inversions = audit.keep(inversions)
    audit.write(inversions, "session_order", small=True)
    order = _SessionOrder(keys, inversions)
    if not keys:
        return order
    counts = checked.agg(
        F.count(F.lit(1)).alias("messages"),
        F.count_distinct("ekey", "session_id").alias("sessions"),
    ).first()
    assert counts is not None
    order.messages, order.sessions = counts["messages"], counts["sessions"]
    for r in inversions.groupBy("entity").count().collect():
        order.by_entity[r["entity"]] = r["count"]
    order.inversions = sum(order.by_entity.values())
    if order.inversions:
        kind = reconciled.by_kind.setdefault(
            sessions.INVERSION_KIND, {"severity": "error", "count": 0}
        )
        kind["count"] += order.inversions
        order.sample = _as_dicts(
            inversions.orderBy("later_ack_ts", "entity", "session_id", "destination")
            .limit(audit.opts.lost_sample)
            .collect()
        )
    return order


def _anomalies(
    audit: _Audit,
    reconciled: _Reconciled,
    windows: list[dict[str, Any]],
    order: _SessionOrder,
) -> None:
    """The anomalies table: the message-level ones from the classification and the session
    order inversions, plus the data-level ones, which are also counted into
    ``reconciled.by_kind``."""
    extra = _data_anomalies(audit.loaded.stats, windows)
    for kind, severity, *_ in extra:
        reconciled.by_kind.setdefault(kind, {"severity": severity, "count": 0})["count"] += 1
    anomalies = (
        message_anomalies(reconciled.messages)
        .unionByName(sessions.inversion_anomalies(order.inversions_df))
        .unionByName(audit.spark.createDataFrame(extra, ANOMALY_SCHEMA))
    )
    audit.write(anomalies, "anomalies", small=True)


@dataclass(frozen=True, slots=True)
class _Activity:
    """Messages per minute, summed over entities, for the report and the chart."""

    per_minute: dict[dt.datetime, dict[str, int]]

    @property
    def minutes(self) -> list[dt.datetime]:
        return sorted(self.per_minute)

    def report(self) -> dict[str, Any]:
        return {
            "minutes": len(self.per_minute),
            "peak_accepted_per_minute": max(
                (v["accepted_primary"] + v["accepted_backlog"] for v in self.per_minute.values()),
                default=0,
            ),
        }


def _throughput(audit: _Audit, names: DataFrame) -> _Activity:
    """The throughput table (per entity and minute), written, and summed per minute."""
    tp_df = audit.keep(throughput(audit.loaded.ledger, audit.loaded.acks, names))
    tp = tp_df.collect()
    audit.write(tp_df, "throughput", small=True)
    per_minute: dict[dt.datetime, dict[str, int]] = {}
    for r in tp:
        agg = per_minute.setdefault(r["minute"], defaultdict(int))
        for c in ("accepted_primary", "accepted_backlog", "syphoned", "client_acked"):
            agg[c] += r[c]
    return _Activity(per_minute)


def _latency(audit: _Audit) -> list[dict[str, Any]]:
    """The latency table (by route), written; its rows are the report's latency section."""
    lat_df = audit.keep(latency(audit.loaded.ledger, audit.loaded.acks))
    lat = _as_dicts(lat_df.collect())
    audit.write(lat_df, "latency", small=True)
    return lat


def _backlog(audit: _Audit, messages: DataFrame) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The backlog dwell and depth tables, written. Returns the report's backlog section and
    the depth per minute (for the chart)."""
    dwell = audit.keep(backlog_dwell(audit.loaded.ledger, messages))
    audit.write(dwell, "backlog_dwell", small=True)
    stats = dwell.agg(
        F.count(F.lit(1)).alias("messages"),
        F.count_if(F.col("state") == "syphoned").alias("syphoned"),
        F.count_if(F.col("state") == "expired").alias("expired"),
        F.count_if(F.col("state") == "waiting").alias("waiting"),
        F.percentile_approx("dwell_s", [0.5, 0.9, 0.99], 10_000).alias("pct"),
        F.max("dwell_s").alias("max"),
    ).first()
    assert stats is not None
    pct = stats["pct"] or [None, None, None]
    depth_df = audit.keep(backlog_depth(audit.loaded.ledger))
    depth = _as_dicts(depth_df.collect())
    audit.write(depth_df, "backlog_depth", small=True)
    section = {
        "messages": stats["messages"],
        "syphoned": stats["syphoned"],
        "expired": stats["expired"],
        "waiting": stats["waiting"],
        "dwell_seconds": {"p50": pct[0], "p90": pct[1], "p99": pct[2], "max": stats["max"]},
        "max_depth": max((d["depth"] for d in depth), default=0),
    }
    return section, depth


def _billing(audit: _Audit) -> dict[str, Any]:
    """The billed operations table (by stage and day), written; returns the report's
    billing section with totals and the paired-namespace feature's own overhead."""
    a = audit.opts.audit
    billed_df = audit.keep(billed_operations(audit.loaded.ledger, a))
    billed = _as_dicts(billed_df.collect())
    audit.write(billed_df, "billed_ops", small=True)
    by_stage: dict[str, dict[str, Any]] = {
        s: {"operations": 0, "events": 0, "price_per_million": a.price(s), "cost": 0.0}
        for s in BILLING_STAGES
    }
    for row in billed:
        st = by_stage[row["stage"]]
        st["operations"] += row["operations"]
        st["events"] += row["events"]
        st["cost"] += row["cost"]
    return {
        "chunk_kib": a.billing_chunk_kib,
        "by_stage": by_stage,
        "total_operations": sum(v["operations"] for v in by_stage.values()),
        "total_cost": sum(v["cost"] for v in by_stage.values()),
        "failover_overhead_operations": sum(by_stage[s]["operations"] for s in _FEATURE_STAGES),
        "failover_overhead_cost": sum(by_stage[s]["cost"] for s in _FEATURE_STAGES),
        "by_day": billed,
    }


def _charts(
    audit: _Audit,
    windows: Sequence[dict[str, Any]],
    activity: _Activity,
    depth: Sequence[dict[str, Any]],
    latency_ms: Sequence[dict[str, Any]],
) -> list[str]:
    """The PNG charts, drawn into the staging directory; returns their file names."""
    # Imported here, not at the top: matplotlib's first import on a machine builds its font
    # cache by running `fc-list`, which `sbgate audit --help` (and --no-charts) need not do.
    from pipeline import charts

    spans = [(w["start_ts"], w["end_ts"], w["entity"]) for w in windows]
    series = {
        "accepted → primary": "accepted_primary",
        "accepted → backlog": "accepted_backlog",
        "syphoned": "syphoned",
        "client acks (2xx)": "client_acked",
    }
    minutes, per_minute = activity.minutes, activity.per_minute
    return [
        charts.throughput_chart(
            minutes,
            {label: [per_minute[m][c] for m in minutes] for label, c in series.items()},
            spans,
            audit.staging / "throughput.png",
        ).name,
        charts.backlog_depth_chart(
            [d["minute"] for d in depth],
            [d["depth"] for d in depth],
            spans,
            audit.staging / "backlog_depth.png",
        ).name,
        charts.latency_chart(latency_ms, audit.staging / "latency_by_route.png").name,
    ]


def _publish(audit: _Audit, summary: dict[str, Any], started: float) -> None:
    """Write report.json and report.md to the staging directory, publish them with the
    charts to ``--report-dir``, and release the cached DataFrames."""
    report.write_json(summary, audit.staging / "report.json")
    report.write_markdown(summary, audit.staging / "report.md")
    where = publish_report(audit.spark, audit.staging, audit.opts.report_dir)
    for df in audit.cached:
        df.unpersist()
    log.info("audit done in %.1f s: %s", time.monotonic() - started, summary["verdict"])
    print(f"{summary['verdict']}; report: {where}; tables: {audit.opts.out}", file=sys.stderr)


def _data_anomalies(
    stats: dict[str, dict[str, Any]], windows: Sequence[dict[str, Any]]
) -> list[tuple[Any, ...]]:
    """Anomalies about the data rather than one message (rows of ANOMALY_SCHEMA)."""
    rows: list[tuple[Any, ...]] = []
    for w in windows:
        if w["closed_by"] == "end_of_data":
            rows.append(
                (
                    "open_failover_window",
                    "info",
                    w["entity"],
                    None,
                    f"failover window opened at {report._default(w['start_ts'])} has no "
                    "failover_end",
                    w["start_ts"],
                )
            )
    for name, s in stats.items():
        if s["ignored"]:
            rows.append(
                (
                    f"{name}_lines_ignored",
                    "warning",
                    None,
                    None,
                    f"{s['ignored']} of {s['lines']} {name} lines are malformed or not the "
                    "contract",
                    None,
                )
            )
    dupes = stats["ledger"]["duplicates_dropped"]
    if dupes:
        rows.append(
            ("ledger_duplicate_lines", "info", None, None, f"{dupes} duplicate event_id(s)", None)
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under spark-submit: uses the session spark-submit configured."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        opts = parse_args(argv, prog="job.py")
    except SystemExit as exc:
        return int(exc.code or 0)
    from pipeline.session import apply_runtime_conf

    spark = SparkSession.builder.appName("sbgate-audit").getOrCreate()
    apply_runtime_conf(spark)
    try:
        return run(spark, opts)
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
