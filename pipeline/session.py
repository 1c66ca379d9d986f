"""An offline-safe local SparkSession (no UI, loopback only, UTC, no package downloads)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from pyspark.sql import SparkSession

# Applied to every session we build. Never spark.jars.packages: there is no Maven access here,
# and the job needs nothing beyond Spark's built-in JSON and Parquet sources.
OFFLINE_CONF: Final[Mapping[str, str]] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "true",
    "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


def build_local_session(
    master: str = "local[*]",
    *,
    app_name: str = "sbgate-audit",
    driver_memory: str = "2g",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A local SparkSession bound to 127.0.0.1 with the UI off and UTC everywhere.

    Sets ``SPARK_LOCAL_IP`` for the JVM it launches (the env var is read by Spark's launcher
    scripts, before any configuration). Needs Java 17+ on PATH or in JAVA_HOME.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", _python())
    builder = SparkSession.builder.master(master).appName(app_name)
    builder = builder.config("spark.driver.memory", driver_memory)
    for key, value in {**OFFLINE_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def apply_runtime_conf(spark: SparkSession) -> None:
    """The SQL settings the job relies on, for a session someone else built (spark-submit)."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")


def _python() -> str:
    import sys

    return sys.executable
