"""The results table: printed, and written as Markdown and JSON (README-ready)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtests.scenarios import ScenarioResult

COLUMNS = ("scenario", "acked", "lost", "duplicated", "unexpected", "expired", "5xx", "p99 ms")


def _row(r: ScenarioResult) -> list[str]:
    v = r.verdict
    status = "pass" if r.passed else "FAIL"
    return [
        r.name,
        f"{v.acked:,}",
        str(v.lost),
        str(v.duplicated),
        str(v.unexpected + v.unexpected_violations),
        f"{v.expired:,}",
        f"{v.status_5xx:,}",
        "-" if v.p99_ms is None else f"{v.p99_ms:,.0f}",
        status,
    ]


def markdown(results: Sequence[ScenarioResult], command: str | None = None) -> str:
    head = [*COLUMNS, "result"]
    rows = [_row(r) for r in results]
    total_acked = sum(r.verdict.acked for r in results)
    total_lost = sum(r.verdict.lost for r in results)
    total_dup = sum(r.verdict.duplicated for r in results)
    lines = [
        "| " + " | ".join(head) + " |",
        "|"
        + "|".join("---:" if i and i < len(head) - 1 else "---" for i in range(len(head)))
        + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append(
        f"| **total** | **{total_acked:,}** | **{total_lost}** | **{total_dup}** | "
        f"{sum(r.verdict.unexpected + r.verdict.unexpected_violations for r in results)} | "
        f"{sum(r.verdict.expired for r in results):,} | "
        f"{sum(r.verdict.status_5xx for r in results):,} | | |"
    )
    out = "\n".join(lines) + "\n"
    if command:
        out = f"`{command}`\n\n" + out
    failed = [(r.name, c) for r in results for c in r.criteria if not c.ok]
    if failed:
        out += "\nFailed criteria:\n\n" + "".join(
            f"- {n}: {c.name} — {c.detail}\n" for n, c in failed
        )
    return out


def criteria_markdown(results: Sequence[ScenarioResult]) -> str:
    """Every criterion of every scenario, with its measured detail."""
    out = []
    for r in results:
        out.append(f"**{r.name}** — {r.title} ({r.duration_s:.0f} s)\n")
        for c in r.criteria:
            mark = "ok" if c.ok else "FAIL"
            out.append(f"- [{mark}] {c.name}: {c.detail}")
        for n in r.notes:
            out.append(f"  - note: {n}")
        out.append("")
    return "\n".join(out)


def write(
    results: Sequence[ScenarioResult], out_dir: Path, command: str | None = None
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(results, command)
    (out_dir / "results.md").write_text(md + "\n" + criteria_markdown(results))
    doc = {
        "command": command,
        "acked": sum(r.verdict.acked for r in results),
        "lost": sum(r.verdict.lost for r in results),
        "duplicated": sum(r.verdict.duplicated for r in results),
        "passed": all(r.passed for r in results),
        "scenarios": [r.as_dict() for r in results],
    }
    (out_dir / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return doc
