"""report.json (machine-readable) and report.md (human-readable) from the collected summary."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _default(value: object) -> object:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, dt.date):
        return value.isoformat()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_json(report: Mapping[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(report, indent=2, default=_default, sort_keys=False) + "\n")
    return path


def _fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dt.datetime):
        return str(_default(value))
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 1) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v, digits) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(
    *, lost: int, pending: int, promised: int, grace_seconds: float, order: str | None = None
) -> str:
    """The one line the audit ends with. It names the pending messages and the grace window:
    a run shorter than the window is all pending, and "nothing lost" would prove nothing.
    ``order`` (with ``--strict-sessions``) is the session order's part, appended."""
    line = _loss_verdict(lost=lost, pending=pending, promised=promised, grace_seconds=grace_seconds)
    return f"{line}; {order}" if order else line


def _loss_verdict(*, lost: int, pending: int, promised: int, grace_seconds: float) -> str:
    window = f"acknowledged in the last {grace_seconds:g} s of the data, not delivered yet"
    if lost:
        more = f"; {pending} more pending ({window}: not judged)" if pending else ""
        return f"{lost} acknowledged message(s) LOST{more}"
    if pending and pending >= promised:
        return (
            f"NOTHING JUDGED: all {promised} acknowledged message(s) are pending ({window}); "
            "for a finished run use --grace-seconds 0"
        )
    line = f"no acknowledged message was lost ({promised - pending} checked)"
    return f"{line}; {pending} pending ({window}: not judged)" if pending else line


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: verdict first, then the numbers behind it."""
    out: list[str] = []
    out.append("# sbgate audit report\n")
    out.append(f"**Verdict: {report['verdict']}** (exit code {report['exit_code']})\n")
    tr = report["time_range"]
    out.append(
        f"Data from {_fmt(tr['start'])} to {_fmt(tr['end'])}; grace window "
        f"{report['grace_seconds']:g} s (promises after {_fmt(report['cutoff'])} count as "
        "pending, not lost).\n"
    )

    out += _messages_md(report)
    out += _session_order_md(report)
    out += _anomalies_md(report)
    out += _failover_md(report)
    out += _backlog_md(report)
    out += _latency_md(report)
    out += _billing_md(report)
    out += _inputs_md(report)
    if report["charts"]:
        out.append("\n## Charts\n")
        out += [f"![{Path(c).stem}]({c})\n" for c in report["charts"]]
    return "\n".join(out) + "\n"


def _messages_md(report: Mapping[str, Any]) -> list[str]:
    """Each classification's count, and the first lost messages."""
    out: list[str] = []
    m = report["messages"]
    counts: Mapping[str, int] = m["by_classification"]
    out.append("## Messages\n")
    out.append(
        _table(
            ["classification", "messages"],
            [[k, v] for k, v in counts.items() if v] or [["(none)", 0]],
        )
    )
    out.append(f"\nTotal: {_fmt(m['total'])} messages ({_fmt(m['promised'])} promised).\n")
    if report["lost_sample"]:
        out.append("Lost (first ones):\n")
        out.append(
            _table(
                ["entity", "message_id", "promised at", "by"],
                [
                    [r["entity"], r["message_id"], r["promise_ts"], r["promised_by"]]
                    for r in report["lost_sample"]
                ],
            )
        )
        out.append("")
    return out


def _session_order_md(report: Mapping[str, Any]) -> list[str]:
    """Per-session order in the strict entities, and the first inversions."""
    o = report.get("session_order")
    if not o or not o["strict_entities"]:
        return []
    out = ["## Session order\n"]
    out.append(
        f"Strict entities: {', '.join(f'`{e}`' for e in o['strict_entities'])}. "
        f"{_fmt(o['messages_checked'])} message(s) in {_fmt(o['sessions_checked'])} session(s) "
        f"compared (acknowledgement order against stored order): {_fmt(o['inversions'])} "
        "inversion(s).\n"
    )
    if o["inversion_sample"]:
        out.append("Inversions (first ones; every one is in the `session_order` table):\n")
        out.append(
            _table(
                ["entity", "session", "destination", "acknowledged first", "stored first"],
                [
                    [
                        r["entity"],
                        r["session_id"],
                        r["destination"],
                        f"{r['earlier_message_id']} (seq {r['earlier_position']})",
                        f"{r['later_message_id']} (seq {r['later_position']})",
                    ]
                    for r in o["inversion_sample"]
                ],
            )
        )
        out.append("")
    return out


def _anomalies_md(report: Mapping[str, Any]) -> list[str]:
    """The anomalies by kind."""
    out: list[str] = []
    a = report["anomalies"]
    out.append("## Anomalies\n")
    if a["total"]:
        out.append(
            _table(
                ["kind", "severity", "count"],
                [[k, v["severity"], v["count"]] for k, v in a["by_kind"].items()],
            )
        )
        out.append("")
    else:
        out.append("None.\n")
    return out


def _failover_md(report: Mapping[str, Any]) -> list[str]:
    """The failover windows."""
    out: list[str] = []
    f = report["failover"]
    out.append("## Failover windows\n")
    out.append(
        f"{f['count']} window(s), {_fmt(f['total_seconds'])} s in total, longest "
        f"{_fmt(f['longest_seconds'])} s, {f['open_at_end']} still open at the end of the data.\n"
    )
    if report["failover_windows"]:
        out.append(
            _table(
                ["entity", "start", "end", "seconds", "closed by", "pings", "to backlog"],
                [
                    [
                        w["entity"],
                        w["start_ts"],
                        w["end_ts"],
                        w["duration_s"],
                        w["closed_by"],
                        w["pings"],
                        w["sent_to_backlog"],
                    ]
                    for w in report["failover_windows"]
                ],
            )
        )
        out.append("")
    return out


def _backlog_md(report: Mapping[str, Any]) -> list[str]:
    """What went to a backlog queue, and how long it stayed."""
    out: list[str] = []
    b = report["backlog"]
    d = b["dwell_seconds"]
    out.append("## Backlog\n")
    out.append(
        f"{_fmt(b['messages'])} message(s) went to a backlog queue: {_fmt(b['syphoned'])} "
        f"syphoned, {_fmt(b['expired'])} expired, {_fmt(b['waiting'])} still waiting. Dwell "
        f"time p50 {_fmt(d['p50'], 2)} s, p90 {_fmt(d['p90'], 2)} s, p99 {_fmt(d['p99'], 2)} s, "
        f"max {_fmt(d['max'], 2)} s. Peak depth {_fmt(b['max_depth'])}.\n"
    )
    return out


def _latency_md(report: Mapping[str, Any]) -> list[str]:
    """Latencies by source and route."""
    out: list[str] = []
    out.append("## Latency (ms)\n")
    if report["latency_ms"]:
        out.append(
            _table(
                ["source", "route", "count", "mean", "p50", "p90", "p99", "p99.9", "max"],
                [
                    [
                        r["source"],
                        r["route"],
                        r["count"],
                        r["mean_ms"],
                        r["p50_ms"],
                        r["p90_ms"],
                        r["p99_ms"],
                        r["p999_ms"],
                        r["max_ms"],
                    ]
                    for r in report["latency_ms"]
                ],
                digits=2,
            )
        )
        out.append("")
    else:
        out.append("No latencies in the input.\n")
    return out


def _billing_md(report: Mapping[str, Any]) -> list[str]:
    """Billed operations by stage, and what failover cost."""
    out: list[str] = []
    bill = report["billing"]
    out.append("## Billed operations\n")
    out.append(
        f"Messages over {bill['chunk_kib']} KiB count one operation per started chunk "
        "(0 = off). Receives from the primary are estimated as one per message.\n"
    )
    out.append(
        _table(
            ["stage", "operations", "price / million", "cost"],
            [
                [s, v["operations"], v["price_per_million"], v["cost"]]
                for s, v in bill["by_stage"].items()
            ],
            digits=4,
        )
    )
    out.append(
        f"\nTotal {_fmt(bill['total_operations'])} operations, cost "
        f"{_fmt(bill['total_cost'], 4)}; of which the paired-namespace feature (backlog send + "
        f"receive, pings) {_fmt(bill['failover_overhead_operations'])} operations, cost "
        f"{_fmt(bill['failover_overhead_cost'], 4)}.\n"
    )
    return out


def _inputs_md(report: Mapping[str, Any]) -> list[str]:
    """The inputs read, and the tables written."""
    out: list[str] = []
    i = report["inputs"]
    out.append("## Inputs\n")
    out.append(
        _table(
            ["input", "files", "lines", "valid", "ignored", "duplicates dropped"],
            [
                [
                    name,
                    v["files"],
                    v["lines"],
                    v["valid"],
                    v["ignored"],
                    v.get("duplicates_dropped", 0),
                ]
                for name, v in i.items()
            ],
        )
    )
    where = f" under `{report['out']}`" if report.get("out") else ""
    out.append(
        f"\nTables (Parquet{where}, by day where they have a time): "
        + ", ".join(f"`{t}/`" for t in report["tables"])
        + "."
    )
    return out


def write_markdown(report: Mapping[str, Any], path: Path) -> Path:
    path.write_text(render_markdown(report))
    return path
