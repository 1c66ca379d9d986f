"""Run one of fuzz/'s atheris targets for a bounded time, as `make test` does (20 s, or
``SBGATE_FUZZ_SECONDS``): its seed corpus copied (new inputs land in the test's temporary
folder, not in the repository), and a crash or a timeout fails the test with its input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
ATHERIS_SECONDS = int(os.environ.get("SBGATE_FUZZ_SECONDS", "20"))


def run_target(target: str, corpus_name: str, dictionary: str, tmp_path: Path) -> str:
    """Run ``fuzz/<target>`` over a copy of ``fuzz/corpus/<corpus_name>``; the number of
    inputs it ran (atheris' final stats line)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(FUZZ / "corpus" / corpus_name, corpus)
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ / target),
            f"-max_total_time={ATHERIS_SECONDS}",
            f"-dict={FUZZ / dictionary}",
            f"-artifact_prefix={tmp_path}/",
            "-print_final_stats=1",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=ATHERIS_SECONDS + 60,
        check=False,
    )
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*"))
    assert proc.returncode == 0 and not crashes, (
        f"atheris found a bug; inputs: {[c.read_bytes() for c in crashes]}\n{proc.stderr[-4000:]}"
    )
    return next(
        (
            line
            for line in proc.stderr.splitlines()
            if line.startswith("stat::number_of_executed_units")
        ),
        "",
    )
