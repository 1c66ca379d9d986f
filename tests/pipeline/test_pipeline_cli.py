"""The command line: exit codes, inputs that do not exist, a missing JRE, the live session."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline import cli
from pipeline.inputs import InputError, resolve
from pipeline.job import EXIT_BAD_INPUT, EXIT_OK, parse_args
from pipeline.synthetic import generate

pytestmark = pytest.mark.timeout(300)


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--ledger", str(tmp_path)]) == EXIT_BAD_INPUT  # no --out
    assert cli.main(["--out", str(tmp_path), "--price", "bogus=1"]) == EXIT_BAD_INPUT
    assert cli.main(["--out", str(tmp_path), "--grace-seconds", "-1"]) == EXIT_BAD_INPUT
    assert cli.main(["--help"]) == 0
    assert "--grace-seconds" in capsys.readouterr().out


def test_missing_input_exits_2_before_spark_work(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--ledger",
        str(tmp_path / "nope"),
        "--delivered",
        str(tmp_path),
        "--out",
        str(tmp_path / "o"),
    ]
    assert cli.main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--ledger" in err and "does not exist" in err
    assert not (tmp_path / "o").exists()


def test_resolve_paths(tmp_path: Path) -> None:
    (tmp_path / "l" / "dt=2025-03-04" / "hour=10").mkdir(parents=True)
    for name in ("gw-0.jsonl", "gw-1.jsonl.gz", "notes.txt", "_SUCCESS"):
        (tmp_path / "l" / "dt=2025-03-04" / "hour=10" / name).write_bytes(b"")
    r = resolve("ledger", [str(tmp_path / "l")], required=True)
    assert [Path(p).name for p in r.paths] == ["gw-0.jsonl", "gw-1.jsonl.gz"]
    assert r.local_files == 2
    g = resolve("ledger", [str(tmp_path / "l" / "*" / "*" / "*.jsonl")], required=True)
    assert [Path(p).name for p in g.paths] == ["gw-0.jsonl"]
    remote = resolve("ledger", ["abfss://c@a.dfs.core.windows.net/ledger"], required=True)
    assert remote.local_files is None and remote.paths == (
        "abfss://c@a.dfs.core.windows.net/ledger",
    )
    assert resolve("acks", [], required=False).paths == ()
    (tmp_path / "empty").mkdir()
    assert resolve("acks", [str(tmp_path / "empty")], required=False).paths == ()
    with pytest.raises(InputError, match="required"):
        resolve("delivered", [], required=True)
    with pytest.raises(InputError, match="matches nothing"):
        resolve("ledger", [str(tmp_path / "*.nothing")], required=True)


def test_missing_java_is_explained(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "java_available", lambda: False)
    args = ["--ledger", str(tmp_path), "--delivered", str(tmp_path), "--out", str(tmp_path / "o")]
    assert cli.main(args) == cli.EXIT_NO_SPARK
    assert "openjdk-17-jre-headless" in capsys.readouterr().err


def test_clean_run_through_the_cli_exits_0(spark: Any, tmp_path: Path) -> None:
    expected = generate(tmp_path / "in", messages=120, plant=False, failovers=[])
    out = tmp_path / "out"
    code = cli.main(
        [
            "--ledger",
            str(tmp_path / "in" / "ledger"),
            "--acks",
            str(tmp_path / "in" / "acks" / "acks.jsonl"),
            "--delivered",
            str(tmp_path / "in" / "delivered"),
            "--out",
            str(out),
            "--report-dir",
            str(tmp_path / "report"),
            "--no-charts",
            "--price",
            "send_primary=1.5",
        ]
    )
    assert code == EXIT_OK
    assert spark.range(1).count() == 1  # the CLI used the live session and left it up
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["messages"]["by_classification"]["delivered"] == len(expected.classification)
    assert report["anomalies"]["errors"] == 0
    assert report["verdict"].startswith("no acknowledged message was lost (")
    assert report["billing"]["by_stage"]["send_primary"]["price_per_million"] == 1.5
    assert report["charts"] == [] and not (tmp_path / "report" / "throughput.png").exists()


def test_parse_args_options() -> None:
    opts = parse_args(
        [
            "--ledger",
            "a",
            "b",
            "--ledger",
            "c",
            "--delivered",
            "d",
            "--out",
            "o",
            "--price-per-million-ops",
            "0.8",
            "--price",
            "send_backlog=2",
            "--billing-chunk-kib",
            "0",
        ]
    )
    assert opts.ledger == ("a", "b", "c") and opts.acks == () and opts.delivered == ("d",)
    assert opts.audit.price("send_backlog") == 2.0 and opts.audit.price("ping") == 0.8
    assert opts.audit.billing_chunk_kib == 0 and not opts.audit.failed_may_be_stored
    lenient = parse_args(
        ["--ledger", "a", "--delivered", "d", "--out", "o", "--failed-may-be-stored"]
    )
    assert lenient.audit.failed_may_be_stored
