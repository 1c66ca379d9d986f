"""``python -m pipeline`` / ``gateway audit``: the audit job on a local, offline-safe Spark.

Same arguments as ``spark-submit pipeline/job.py`` plus ``--master`` (default ``local[*]``)
and ``--driver-memory``. Exit codes: 0 nothing lost, 3 an acknowledged message was lost (or,
with ``--strict-sessions``, a session's order inverted), 2 bad input (or usage), 1 when Spark
cannot start (e.g. no Java 17+).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence

from pipeline.job import EXIT_BAD_INPUT, build_parser, options_from_args, run

EXIT_NO_SPARK = 1
JRE_HINT = (
    "pyspark 4 needs Java 17 or newer: install a JRE (Debian/Ubuntu: "
    "apt-get install -y openjdk-17-jre-headless) or set JAVA_HOME"
)


def java_available() -> bool:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and os.access(os.path.join(java_home, "bin", "java"), os.X_OK):
        return True
    return shutil.which("java") is not None


def main(argv: Sequence[str] | None = None, *, prog: str = "gateway audit") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines came after the verdict
    parser = build_parser(prog, local=True)
    try:
        args = parser.parse_args(argv)
        opts = options_from_args(args, parser)
    except SystemExit as exc:  # argparse: --help exits 0, usage errors exit 2
        return EXIT_BAD_INPUT if exc.code not in (0, None) else 0
    if not java_available():
        print(f"error: {JRE_HINT}", file=sys.stderr)
        return EXIT_NO_SPARK

    from pyspark.sql import SparkSession

    from pipeline.session import build_local_session

    # Inside a process that already has a session (tests, notebooks) use it and leave it up.
    existing = SparkSession.getActiveSession()
    spark = existing or build_local_session(args.master, driver_memory=args.driver_memory)
    try:
        return run(spark, opts)
    finally:
        if existing is None:
            spark.stop()


if __name__ == "__main__":
    sys.exit(main())
