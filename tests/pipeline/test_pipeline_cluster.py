"""The audit as a Spark cluster runs it: spark-submit with --py-files, URIs for --out and
--report-dir, tables through Spark's writer, the report through Hadoop's FileSystem.

`test_spark_submit_runs_the_packaged_job` starts its own JVM (spark-submit, the launcher
pyspark ships, with --master local[2]): the one test here that does. The others use the
session's SparkSession.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.readwriter import DataFrameWriter

from pipeline.job import EXIT_LOST, TABLE_DAY, TABLES, JobOptions, publish_report, run, table_uri
from pipeline.reconcile import AuditOptions
from pipeline.synthetic import generate

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import pipeline_dist  # noqa: E402


def test_spark_submit_runs_the_packaged_job(spark: Any, tmp_path: Path) -> None:
    expected = generate(tmp_path / "in", messages=80, seed=9)
    # The job file alone, away from the checkout: `pipeline` can only come from the archive.
    job_dir = tmp_path / "submit"
    job_dir.mkdir()
    job = job_dir / "job.py"
    shutil.copy(ROOT / "pipeline" / "job.py", job)
    archive = pipeline_dist.build(tmp_path / "dist" / "sbgate-pipeline.zip")
    out = (tmp_path / "out").as_uri()  # file:///…
    report = (tmp_path / "report").as_uri()  # through Hadoop's FileSystem
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    argv = [
        str(Path(sys.executable).parent / "spark-submit"),
        "--master", "local[2]",
        "--driver-memory", "1g",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.driver.bindAddress=127.0.0.1",
        "--conf", "spark.sql.shuffle.partitions=2",
        "--py-files", str(archive),
        str(job),
        "--ledger", (tmp_path / "in" / "ledger").as_uri(),
        "--acks", (tmp_path / "in" / "acks").as_uri(),
        "--delivered", (tmp_path / "in" / "delivered").as_uri(),
        "--out", out,
        "--report-dir", report,
        "--no-charts",
    ]  # fmt: skip
    proc = subprocess.run(
        argv, env=env, cwd=job_dir, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == EXIT_LOST, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    lost = sorted(k for k, v in expected.classification.items() if v == "lost")
    assert summary["exit_code"] == EXIT_LOST
    assert summary["verdict"].startswith(f"{len(lost)} acknowledged message(s) LOST")
    assert summary["out"] == out
    assert (tmp_path / "report" / "report.md").read_text().startswith("# sbgate audit report")
    # The tables, read back: partitioned by day, classified as planted.
    for name in TABLES:
        assert (tmp_path / "out" / name / "_SUCCESS").exists(), name
    days = sorted(p.name for p in (tmp_path / "out" / "messages").glob("day=*"))
    assert days and all(d.startswith("day=20") for d in days), days
    rows = spark.read.parquet(table_uri(out, "messages")).collect()
    got = {(r["entity"], r["message_id"]): r["classification"] for r in rows}
    assert got == expected.classification
    assert {str(r["day"]) for r in rows} <= {d.removeprefix("day=") for d in days} | {"None"}


def test_a_remote_out_uri_reaches_the_writer_unchanged(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No storage account here: the Parquet writer is replaced by a recorder, so what Spark
    would be asked to write is captured, with the partition columns set on the writer."""
    generate(tmp_path / "in", messages=60, seed=5, plant=False, failovers=[])
    out = "abfss://sbgate@contosoaudit.dfs.core.windows.net/audit/run-1"
    partitions: dict[int, tuple[str, ...]] = {}
    written: list[tuple[str, tuple[str, ...]]] = []
    original_partition_by = DataFrameWriter.partitionBy

    def partition_by(self: DataFrameWriter, *cols: Any) -> DataFrameWriter:
        partitions[id(self)] = tuple(cols)
        return original_partition_by(self, *cols)

    def parquet(self: DataFrameWriter, path: str, *args: Any, **kwargs: Any) -> None:
        written.append((path, partitions.get(id(self), ())))

    monkeypatch.setattr(DataFrameWriter, "partitionBy", partition_by)
    monkeypatch.setattr(DataFrameWriter, "parquet", parquet)
    opts = JobOptions(
        ledger=(str(tmp_path / "in" / "ledger"),),
        acks=(str(tmp_path / "in" / "acks"),),
        delivered=(str(tmp_path / "in" / "delivered"),),
        out=out,
        report_dir=str(tmp_path / "report"),
        audit=AuditOptions(grace_seconds=60),
        charts=False,
    )
    assert run(spark, opts) == 0
    assert sorted(written) == sorted(
        (f"{out}/{name}", ("day",) if name in TABLE_DAY else ()) for name in TABLES
    )
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    assert summary["out"] == out and summary["exit_code"] == 0


def test_report_through_hadoop_filesystem(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # local file I/O would make a "file:" folder here
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "report.md").write_text("# report\n")
    (staging / "chart.png").write_bytes(b"\x89PNG")
    target = (tmp_path / "nested" / "report").as_uri() + "/"
    assert publish_report(spark, staging, target) == target.rstrip("/") + "/report.md"
    assert (tmp_path / "nested" / "report" / "report.md").read_text() == "# report\n"
    assert (tmp_path / "nested" / "report" / "chart.png").read_bytes() == b"\x89PNG"
    assert not (tmp_path / "file:").exists()
    local = tmp_path / "plain"
    assert publish_report(spark, staging, str(local)) == str(local / "report.md")
    assert sorted(p.name for p in local.iterdir()) == ["chart.png", "report.md"]
