"""Finding and reading the three inputs: path resolution, JSON-lines reading, validation.

Local paths (no URI scheme, or ``file:``) are resolved here, so that a missing input is a
clear error (exit code 2) rather than a Spark stack trace: a file is taken as it is, a
directory is searched recursively for ``*.jsonl``, ``*.jsonl.gz``, ``*.json`` and
``*.json.gz`` (the ledger's ``dt=…/hour=…`` partitions included), and a glob is expanded.
Paths with another scheme (``hdfs://``, ``abfss://``, ``s3a://``) go to Spark unchanged, with
recursive file lookup, for runs on a cluster.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from pipeline.schemas import (
    ACK_OUTCOMES,
    CORRUPT,
    DELIVERY_SOURCES,
    LEDGER_EVENTS,
    LEDGER_VERSIONS,
)

_SUFFIXES: Final = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
_SCHEME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class InputError(Exception):
    """An input path is missing or unusable (the job exits with code 2)."""


@dataclass(frozen=True, slots=True)
class ResolvedInput:
    """What one input option resolved to."""

    name: str
    paths: tuple[str, ...]  # what Spark reads
    local_files: int | None  # None for remote paths (not listed here)


def resolve(name: str, specs: Sequence[str], *, required: bool) -> ResolvedInput:
    """Resolve ``--<name>`` values to readable paths, or raise ``InputError``."""
    if not specs:
        if required:
            raise InputError(f"--{name}: at least one path is required")
        return ResolvedInput(name, (), 0)
    paths: list[str] = []
    local = 0
    remote = False
    for spec in specs:
        if _SCHEME.match(spec) and not spec.startswith("file://"):
            paths.append(spec)
            remote = True
            continue
        plain = spec.removeprefix("file://")
        matches = sorted(glob.glob(plain, recursive=True)) if glob.has_magic(plain) else [plain]
        found = False
        for match in matches:
            p = Path(match)
            if p.is_dir():
                files = sorted(
                    str(f)
                    for f in p.rglob("*")
                    if f.is_file() and f.name.endswith(_SUFFIXES) and not _hidden(f, p)
                )
                paths.extend(files)
                local += len(files)
                found = True  # an existing empty directory is a valid, empty input
            elif p.is_file():
                if not os.access(p, os.R_OK):
                    raise InputError(f"--{name}: {p} is not readable")
                paths.append(str(p))
                local += 1
                found = True
        if not found:
            raise InputError(f"--{name}: {spec} does not exist (or matches nothing)")
    return ResolvedInput(name, tuple(paths), None if remote else local)


def _hidden(path: Path, root: Path) -> bool:
    # Spark and Hadoop write _SUCCESS, .crc and _temporary files; skip hidden/underscore parts.
    return any(part.startswith((".", "_")) for part in path.relative_to(root).parts)


def read_jsonl(spark: SparkSession, resolved: ResolvedInput, schema: StructType) -> DataFrame:
    """The JSON lines of ``resolved`` with ``schema`` (PERMISSIVE: bad lines in _corrupt_record)."""
    if not resolved.paths:
        return spark.createDataFrame([], schema)
    reader = (
        spark.read.schema(schema)
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", CORRUPT)
        .option("encoding", "UTF-8")
    )
    if resolved.local_files is None:
        reader = reader.option("recursiveFileLookup", "true")
    return reader.json(list(resolved.paths))


def entity_key(col: Column) -> Column:
    """Entity paths compare case-insensitively and without leading/trailing slashes."""
    return F.lower(F.regexp_replace(F.trim(col), r"^/+|/+$", ""))


def _ts(name: str) -> Column:
    # try_: Spark 4 runs in ANSI mode, where to_timestamp raises on a malformed string.
    return F.try_to_timestamp(F.col(name))


VALID: Final = "_valid"


def parse_ledger(raw: DataFrame) -> DataFrame:
    """Ledger rows with ``ts`` as a timestamp, ``ekey``, and ``_valid``.

    A line is valid when it is ledger v1 or v2 with an event id, a known event and a
    parsable timestamp; other lines (other JSON logs sharing stdout, a newer version, junk)
    are counted by the caller and left out. A v1 line has no ``session_id`` and no ``seq``
    (null).
    """
    ts = _ts("ts")
    valid = (
        F.col(CORRUPT).isNull()
        & F.col("v").isin(*LEDGER_VERSIONS)
        & F.col("event_id").isNotNull()
        & F.col("event").isin(*LEDGER_EVENTS)
        & ts.isNotNull()
    )
    return raw.select(
        "event_id",
        ts.alias("ts"),
        "replica",
        "message_id",
        "entity",
        entity_key(F.col("entity")).alias("ekey"),
        "event",
        "route",
        "backlog",
        "size",
        "latency_ms",
        "session_id",
        "seq",
        F.coalesce(valid, F.lit(False)).alias(VALID),
    )


def parse_acks(raw: DataFrame) -> DataFrame:
    """Acknowledgement rows with ``ts`` as a timestamp, ``ekey``, and ``_valid``."""
    ts = _ts("ts")
    valid = (
        F.col(CORRUPT).isNull()
        & F.col("message_id").isNotNull()
        & F.col("entity").isNotNull()
        & F.col("outcome").isin(*ACK_OUTCOMES)
        & ts.isNotNull()
    )
    return raw.select(
        ts.alias("ts"),
        "message_id",
        "entity",
        entity_key(F.col("entity")).alias("ekey"),
        "status",
        "outcome",
        "route",
        "latency_ms",
        F.coalesce(valid, F.lit(False)).alias(VALID),
    )


def parse_delivered(raw: DataFrame, backlog_pattern: str) -> DataFrame:
    """Delivered rows with the receiving destination worked out, and ``_valid``.

    ``endpoint`` is the destination a copy counts against for duplicates: the queue or
    subscription path without its ``/$DeadLetterQueue`` suffix, lower-cased; null for a copy
    that is still in (or dead-lettered in) a backlog queue. A line without ``entity`` takes
    it from the queue path (a subscription's topic), except in a backlog queue.
    """
    queue_base = F.regexp_replace(F.col("queue"), r"(?i)/\$deadletterqueue$", "")
    in_backlog = (F.col("source") == "backlog") | (
        (F.col("source") == "dlq") & queue_base.rlike(backlog_pattern)
    )
    topic_of_subscription = F.regexp_extract(queue_base, r"^(.*)/subscriptions/[^/]+$", 1)
    fallback_entity = F.when(topic_of_subscription != "", topic_of_subscription).otherwise(
        queue_base
    )
    entity = F.coalesce(F.col("entity"), F.when(~in_backlog, fallback_entity))
    valid = (
        F.col(CORRUPT).isNull()
        & F.col("message_id").isNotNull()
        & F.col("source").isin(*DELIVERY_SOURCES)
        & entity.isNotNull()
    )
    return raw.select(
        "message_id",
        entity.alias("entity"),
        entity_key(entity).alias("ekey"),
        "source",
        "queue",
        _ts("enqueued_time").alias("enqueued_time"),
        "dead_letter_reason",
        "delivery_count",
        "sequence_number",
        "session_id",
        F.when(in_backlog, F.lit(None).cast("string"))
        .otherwise(F.lower(queue_base))
        .alias("endpoint"),
        F.coalesce(in_backlog, F.lit(False)).alias("backlog_copy"),
        F.coalesce(valid, F.lit(False)).alias(VALID),
    )
