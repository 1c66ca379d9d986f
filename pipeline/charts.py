"""PNG charts of the report (matplotlib, headless). Inputs are small, already-collected rows."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers and CI

import matplotlib.dates as mdates
import matplotlib.pyplot as plt

Window = tuple[dt.datetime, dt.datetime, str]  # (start, end, entity)


def _x(value: dt.datetime) -> Any:
    return value


def _steps(minutes: Sequence[dt.datetime], values: Sequence[int]) -> tuple[Any, list[int]]:
    """Per-minute buckets as a step line that also covers the last minute."""
    xs = [*minutes, minutes[-1] + dt.timedelta(minutes=1)]
    return xs, [*values, values[-1]]


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the input", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _time_axis(ax: Any) -> None:
    locator = mdates.AutoDateLocator()  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    ax.set_xlabel("time (UTC)")


def throughput_chart(
    minutes: Sequence[dt.datetime],
    series: dict[str, Sequence[int]],
    windows: Sequence[Window],
    path: Path,
) -> Path:
    """Messages per minute (one line per series) with failover windows shaded."""
    fig, ax = plt.subplots(figsize=(11, 4.5))
    try:
        if not minutes:
            _empty(ax, "throughput")
        else:
            for label, values in series.items():
                if any(values):
                    xs, ys = _steps(minutes, values)
                    ax.plot(xs, ys, label=label, linewidth=1.4, drawstyle="steps-post")
            for i, (start, end, entity) in enumerate(windows):
                ax.axvspan(
                    _x(start),
                    _x(end),
                    color="tab:red",
                    alpha=0.15,
                    label="failover window" if i == 0 else None,
                )
                ax.annotate(
                    entity,
                    xy=(start, 1.0),
                    xycoords=("data", "axes fraction"),
                    fontsize=7,
                    va="top",
                    color="tab:red",
                )
            ax.set_ylabel("messages / minute")
            ax.set_ylim(bottom=0)
            _time_axis(ax)
            ax.legend(loc="upper left", fontsize=8)
            ax.grid(alpha=0.3)
        ax.set_title("Throughput (all entities), failover windows shaded")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def backlog_depth_chart(
    minutes: Sequence[dt.datetime], depth: Sequence[int], windows: Sequence[Window], path: Path
) -> Path:
    """Messages waiting in backlog queues (sent to backlog - syphoned, cumulative)."""
    fig, ax = plt.subplots(figsize=(11, 4))
    try:
        if not minutes:
            _empty(ax, "backlog traffic")
        else:
            xs, ys = _steps(minutes, depth)
            ax.fill_between(xs, ys, step="post", alpha=0.4, color="tab:orange")
            ax.plot(xs, ys, drawstyle="steps-post", color="tab:orange", label="depth")
            for start, end, _entity in windows:
                ax.axvspan(_x(start), _x(end), color="tab:red", alpha=0.08)
            ax.set_ylabel("messages in backlog")
            ax.set_ylim(bottom=0)
            _time_axis(ax)
            ax.grid(alpha=0.3)
        ax.set_title("Backlog depth (sent to backlog minus syphoned, cumulative)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def latency_chart(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """p50 / p90 / p99 latency per (source, route), grouped bars on a log scale."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        rows = [r for r in rows if r.get("count")]
        if not rows:
            _empty(ax, "latencies")
        else:
            labels = [f"{r['source']}\n{r['route']}" for r in rows]
            width = 0.26
            for k, (key, name) in enumerate(
                [("p50_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99")]
            ):
                xs = [i + (k - 1) * width for i in range(len(rows))]
                values = [max(float(r[key] or 0.0), 1e-3) for r in rows]
                ax.bar(xs, values, width, label=name)
            ax.set_xticks(range(len(rows)), labels)
            ax.set_yscale("log")
            ax.set_ylabel("latency (ms, log scale)")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        ax.set_title("Latency by route (gateway-measured and client-observed)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
