"""The audit job: reconcile ledger + client acknowledgements + delivered ids, write the report.

Runs unchanged under ``spark-submit``, on a laptop or a cluster (``make pipeline-dist`` builds
the ``--py-files`` archive the cluster's driver and executors import ``pipeline`` from)::

    spark-submit --master <url> --deploy-mode cluster --py-files dist/sbgate-pipeline.zip \\
        pipeline/job.py --ledger abfss://…/ledger --delivered abfss://…/delivered \\
        --out abfss://…/audit --report-dir abfss://…/audit/report

or locally through ``python -m pipeline`` / ``gateway audit`` (``pipeline.cli``), which builds
an offline-safe ``local[*]`` session. Exit codes: 0 no acknowledged message lost, 3 at least
one lost, 2 bad input.

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

from pipeline import charts, report
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

TABLES: Final = (
    "messages",
    "anomalies",
    "throughput",
    "latency",
    "failover_windows",
    "backlog_dwell",
    "backlog_depth",
    "billed_ops",
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
        "acknowledged message was lost, 2 on bad input.",
    )
    paths = "file, directory (searched recursively for *.jsonl[.gz]) or glob; repeatable"
    p.add_argument("--ledger", action="extend", nargs="+", default=[], help=f"ledger v1 {paths}")
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
    """Read, validate and cache the inputs: one pass over each input's JSON.

    That pass counts lines, valid lines and distinct ledger event ids, and finds the time
    range; the valid rows stay cached for the rest of the job.
    """
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
    frames: dict[str, DataFrame] = {}
    cached: list[DataFrame] = []
    stats: dict[str, dict[str, Any]] = {}
    ranges: dict[str, tuple[dt.datetime | None, dt.datetime | None]] = {}
    for name, (schema, parse, ts_col) in plan.items():
        r: ResolvedInput = resolved[name]
        rows = parse(read_jsonl(spark, r, schema)).cache()
        cached.append(rows)
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
        frames[name] = frame
        ranges[name] = (row["lo"], row["hi"])
        stats[name] = {
            "paths": list(r.paths) if r.local_files is None else None,
            "files": r.local_files,
            "lines": row["lines"],
            "valid": row["valid"],
            "ignored": row["lines"] - row["valid"],
            "duplicates_dropped": row["valid"] - kept,
        }
        log.info("%s: %d lines, %d valid, %d kept", name, row["lines"], row["valid"], kept)
    los = [lo for lo, _ in ranges.values() if lo is not None]
    his = [hi for _, hi in ranges.values() if hi is not None]
    evidence = [ranges[n][1] for n in ("ledger", "delivered") if ranges[n][1] is not None]
    return _Loaded(
        frames["ledger"],
        frames["acks"],
        frames["delivered"],
        stats,
        min(los) if los else None,
        max(his) if his else None,
        max(evidence) if evidence else (max(his) if his else None),  # type: ignore[type-var]
        cached,
    )


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
    """The audit after loading: tables to ``opts.out``, report files staged locally first."""
    out = opts.out
    a = opts.audit
    start, end, latest = loaded.start, loaded.end, loaded.latest_evidence
    cutoff = latest - dt.timedelta(seconds=a.grace_seconds) if latest is not None else None
    cached: list[DataFrame] = list(loaded.cached)

    def keep(df: DataFrame) -> DataFrame:
        cached.append(df.cache())
        return cached[-1]

    # Messages: the heart of the audit. One count per (classification, outcome) gives the
    # classification totals, the promises and the message-level anomaly counts.
    names = keep(entity_names(loaded.acks, loaded.ledger, loaded.delivered))
    messages = keep(
        classify(
            loaded.acks,
            loaded.ledger,
            loaded.delivered,
            cutoff,
            names,
            failed_may_be_stored=a.failed_may_be_stored,
        )
    )
    _write(messages.drop("ekey"), out, "messages")
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
    lost = by_class["lost"]
    lost_sample = (
        _as_dicts(
            messages.where(F.col("classification") == "lost")
            .orderBy("promise_ts", "entity", "message_id")
            .select("entity", "message_id", "promise_ts", "promised_by")
            .limit(opts.lost_sample)
            .collect()
        )
        if lost
        else []
    )

    # Failover windows (the anomalies and the charts need them too).
    windows_df = keep(window_activity(loaded.ledger, failover_windows(loaded.ledger, start, end)))
    windows = _as_dicts(windows_df.collect())
    _write(windows_df, out, "failover_windows", small=True)

    # Anomalies: message-level ones from the classification, plus data-level ones.
    extra = _data_anomalies(loaded.stats, windows)
    for kind, severity, *_ in extra:
        by_kind.setdefault(kind, {"severity": severity, "count": 0})["count"] += 1
    anomalies = message_anomalies(messages).unionByName(
        spark.createDataFrame(extra, ANOMALY_SCHEMA)
    )
    _write(anomalies, out, "anomalies", small=True)

    # Throughput, latency, backlog, billing: small tables, collected for the report.
    tp_df = keep(throughput(loaded.ledger, loaded.acks, names))
    tp = tp_df.collect()
    _write(tp_df, out, "throughput", small=True)
    per_minute: dict[dt.datetime, dict[str, int]] = {}
    for r in tp:
        agg = per_minute.setdefault(r["minute"], defaultdict(int))
        for c in ("accepted_primary", "accepted_backlog", "syphoned", "client_acked"):
            agg[c] += r[c]
    minutes = sorted(per_minute)

    lat_df = keep(latency(loaded.ledger, loaded.acks))
    lat = _as_dicts(lat_df.collect())
    _write(lat_df, out, "latency", small=True)

    dwell = keep(backlog_dwell(loaded.ledger, messages))
    _write(dwell, out, "backlog_dwell", small=True)
    dwell_stats = dwell.agg(
        F.count(F.lit(1)).alias("messages"),
        F.count_if(F.col("state") == "syphoned").alias("syphoned"),
        F.count_if(F.col("state") == "expired").alias("expired"),
        F.count_if(F.col("state") == "waiting").alias("waiting"),
        F.percentile_approx("dwell_s", [0.5, 0.9, 0.99], 10_000).alias("pct"),
        F.max("dwell_s").alias("max"),
    ).first()
    assert dwell_stats is not None
    pct = dwell_stats["pct"] or [None, None, None]
    depth_df = keep(backlog_depth(loaded.ledger))
    depth = _as_dicts(depth_df.collect())
    _write(depth_df, out, "backlog_depth", small=True)

    billed_df = keep(billed_operations(loaded.ledger, a))
    billed = _as_dicts(billed_df.collect())
    _write(billed_df, out, "billed_ops", small=True)
    by_stage: dict[str, dict[str, Any]] = {
        s: {"operations": 0, "events": 0, "price_per_million": a.price(s), "cost": 0.0}
        for s in BILLING_STAGES
    }
    for row in billed:
        st = by_stage[row["stage"]]
        st["operations"] += row["operations"]
        st["events"] += row["events"]
        st["cost"] += row["cost"]

    exit_code = EXIT_LOST if lost else EXIT_OK
    chart_files: list[str] = []
    if opts.charts:
        spans = [(w["start_ts"], w["end_ts"], w["entity"]) for w in windows]
        series = {
            "accepted → primary": "accepted_primary",
            "accepted → backlog": "accepted_backlog",
            "syphoned": "syphoned",
            "client acks (2xx)": "client_acked",
        }
        chart_files = [
            charts.throughput_chart(
                minutes,
                {label: [per_minute[m][c] for m in minutes] for label, c in series.items()},
                spans,
                staging / "throughput.png",
            ).name,
            charts.backlog_depth_chart(
                [d["minute"] for d in depth],
                [d["depth"] for d in depth],
                spans,
                staging / "backlog_depth.png",
            ).name,
            charts.latency_chart(lat, staging / "latency_by_route.png").name,
        ]

    durations = [w["duration_s"] for w in windows if w["duration_s"] is not None]
    summary: dict[str, Any] = {
        "version": 1,
        "generated_at": dt.datetime.now(dt.UTC),
        "exit_code": exit_code,
        "verdict": (
            f"{lost} acknowledged message(s) LOST" if lost else "no acknowledged message was lost"
        ),
        "time_range": {"start": start, "end": end},
        "grace_seconds": a.grace_seconds,
        "cutoff": cutoff,
        "inputs": loaded.stats,
        "messages": {
            "total": sum(by_class.values()),
            "promised": promised,
            "by_classification": by_class,
        },
        "lost_sample": lost_sample,
        "anomalies": {
            "total": sum(v["count"] for v in by_kind.values()),
            "errors": sum(v["count"] for v in by_kind.values() if v["severity"] == "error"),
            "by_kind": by_kind,
        },
        "failover": {
            "count": len(windows),
            "total_seconds": float(sum(durations)),
            "longest_seconds": max(durations) if durations else None,
            "open_at_end": sum(1 for w in windows if w["closed_by"] == "end_of_data"),
        },
        "failover_windows": windows,
        "backlog": {
            "messages": dwell_stats["messages"],
            "syphoned": dwell_stats["syphoned"],
            "expired": dwell_stats["expired"],
            "waiting": dwell_stats["waiting"],
            "dwell_seconds": {
                "p50": pct[0],
                "p90": pct[1],
                "p99": pct[2],
                "max": dwell_stats["max"],
            },
            "max_depth": max((d["depth"] for d in depth), default=0),
        },
        "latency_ms": lat,
        "throughput": {
            "minutes": len(minutes),
            "peak_accepted_per_minute": max(
                (v["accepted_primary"] + v["accepted_backlog"] for v in per_minute.values()),
                default=0,
            ),
        },
        "billing": {
            "chunk_kib": a.billing_chunk_kib,
            "by_stage": by_stage,
            "total_operations": sum(v["operations"] for v in by_stage.values()),
            "total_cost": sum(v["cost"] for v in by_stage.values()),
            "failover_overhead_operations": sum(by_stage[s]["operations"] for s in _FEATURE_STAGES),
            "failover_overhead_cost": sum(by_stage[s]["cost"] for s in _FEATURE_STAGES),
            "by_day": billed,
        },
        "tables": list(TABLES),
        "out": out,
        "charts": chart_files,
        "elapsed_seconds": round(time.monotonic() - started, 2),
    }
    report.write_json(summary, staging / "report.json")
    report.write_markdown(summary, staging / "report.md")
    where = publish_report(spark, staging, opts.report_dir)
    for df in cached:
        df.unpersist()
    log.info("audit done in %.1f s: %s", time.monotonic() - started, summary["verdict"])
    print(f"{summary['verdict']}; report: {where}; tables: {out}", file=sys.stderr)
    return exit_code


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
