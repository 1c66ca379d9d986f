"""Build the `--py-files` archive of the audit pipeline (`make pipeline-dist`).

    python scripts/pipeline_dist.py [--out dist/sbgate-pipeline.zip]

A cluster's driver and executors import `pipeline` from this zip (spark-submit ships it):

    spark-submit --master <url> --deploy-mode cluster \\
        --py-files dist/sbgate-pipeline.zip pipeline/job.py --ledger … --out …

The archive holds the `pipeline` package's modules and nothing else (the pipeline imports
only the standard library, pyspark, and matplotlib for the charts, which the cluster's Python
must have). Entries are sorted and carry a fixed timestamp, so the same sources give the same
bytes.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "dist" / "sbgate-pipeline.zip"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry


def build(out: Path = DEFAULT_OUT, source: Path = ROOT / "pipeline") -> Path:
    """Write the archive to `out` and return its path."""
    files = sorted(p for p in source.rglob("*.py") if "__pycache__" not in p.parts)
    if not any(p.name == "job.py" for p in files):
        raise SystemExit(f"{source}: no pipeline/job.py")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            info = zipfile.ZipInfo(f"pipeline/{path.relative_to(source).as_posix()}", _EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes())
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    out = build(args.out)
    print(f"pipeline-dist: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
