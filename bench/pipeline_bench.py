"""Reconciliation time of the audit job for generated data of growing size (Spark local[2]).

A size N is N input events (JSON lines) in all: ``pipeline.synthetic.generate`` writes the
ledger, client acknowledgements and delivered ids of about N / 3.4 messages (each message
has ~1.14 ledger events, 1 acknowledgement and 1.28 deliveries: topic fan-out, failover
windows, backlog traffic, syphoning, planted anomalies). ``--unit ledger`` counts ledger
events only (3.4 times more input). The whole job (read, classify, every table, report,
charts) runs on one warm SparkSession; a small warm-up run comes first so that JVM warm-up
is not charged to the first size.

    .venv/bin/python -m bench.pipeline_bench [--sizes 100000 1000000] [--unit lines|ledger]

Goal: 1M events in < 90 s on local[2], growing no worse than linearly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness import parse_args
from pipeline.job import EXIT_LOST, JobOptions, run
from pipeline.session import build_local_session
from pipeline.synthetic import generate

LINES_PER_MESSAGE = 3.42  # ledger + acks + delivered lines per generated message
LEDGER_PER_MESSAGE = 1.14


def dataset(root: Path, messages: int) -> tuple[Path, dict[str, int]]:
    """Generated inputs for ``messages`` (reused when already there)."""
    path = root / f"n{messages}"
    marker = path / "lines.json"
    if marker.exists():
        return path, json.loads(marker.read_text())
    if path.exists():
        shutil.rmtree(path)
    started = time.perf_counter()
    exp = generate(path, messages=messages, seed=3, track=False)
    lines = {
        "ledger": exp.ledger_lines,
        "acks": exp.ack_lines,
        "delivered": exp.delivered_lines,
    }
    marker.write_text(json.dumps(lines))
    print(f"  generated {messages:,} messages in {time.perf_counter() - started:.1f} s: {lines}")
    return path, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Audit job time vs input size.")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument(
        "--unit",
        choices=("lines", "ledger"),
        default="lines",
        help="what a size counts: all input lines (default) or ledger events only",
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="3g")
    parser.add_argument("--workdir", type=Path, help="keep generated data here (reused)")
    args = parse_args(parser, argv, {"sizes": [100_000]})

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="pipeline-bench-")
    root = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    try:
        print(f"generating inputs under {root}")
        per_message = LINES_PER_MESSAGE if args.unit == "lines" else LEDGER_PER_MESSAGE
        sets = {n: dataset(root, max(1, round(n / per_message))) for n in [10_000, *args.sizes]}
        started = time.perf_counter()
        spark = build_local_session(args.master, driver_memory=args.driver_memory)
        print(f"SparkSession {args.master} started in {time.perf_counter() - started:.1f} s")
        times: dict[int, float] = {}
        try:
            for n in [10_000, *args.sizes]:
                path, lines = sets[n]
                opts = JobOptions(
                    ledger=(str(path / "ledger"),),
                    acks=(str(path / "acks"),),
                    delivered=(str(path / "delivered"),),
                    out=str(path / "out"),
                    report_dir=str(path / "report"),
                )
                t0 = time.perf_counter()
                rc = run(spark, opts)
                elapsed = time.perf_counter() - t0
                assert rc == EXIT_LOST, f"planted losses must be found (exit {rc})"
                total = sum(lines.values())
                label = "warm-up" if n == 10_000 else f"{n:,} {args.unit}"
                print(
                    f"{label:>18}: {elapsed:6.1f} s  ({total:,} input lines: {lines}; "
                    f"{total / elapsed:,.0f} lines/s)"
                )
                if n != 10_000:
                    times[n] = elapsed
        finally:
            spark.stop()
        sizes = sorted(times)
        if len(sizes) >= 2:
            small, big = sizes[0], sizes[-1]
            ratio = times[big] / times[small]
            print(
                f"time ratio {big:,}/{small:,} = {ratio:.2f} (size ratio {big / small:.0f}; "
                f"<= size ratio means no worse than linear)"
            )
        if 1_000_000 in times:
            verdict = "OK" if times[1_000_000] < 90 else "over the goal"
            print(f"1M ({args.unit}): {times[1_000_000]:.1f} s (goal < 90 s: {verdict})")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
