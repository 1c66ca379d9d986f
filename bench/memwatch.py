"""What the memory benchmarks (`bench.overload_bench`, `bench.outage_bench`) share.

* `RssSampler`: the resident set size of one process, read from ``/proc/<pid>/status``
  (``VmRSS``) every `interval` seconds by a task it owns;
* `open_loop`: one `bench.openloop` child, with the moments of its window;
* `stored_vs_ok`: the broker's stored messages against the 2xx answers;
* `plot`: the RSS curve (and answers per second by status) as a PNG (matplotlib, Agg).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness import Child, Cores
from tests.support.processes import rss_bytes

OUT_DIR = Path(__file__).resolve().parent / "out"
MiB = 1024 * 1024


@dataclass
class RssSampler:
    """Samples (monotonic seconds, RSS bytes) of `pid` every `interval` seconds until closed."""

    pid: int
    interval: float = 0.5
    samples: list[tuple[float, int]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def sample(self) -> int | None:
        value = rss_bytes(self.pid)
        if value is not None:
            self.samples.append((time.monotonic(), value))
        return value

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def start(self) -> RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def between(self, start: float, end: float) -> list[int]:
        return [v for t, v in self.samples if start <= t <= end]

    def at(self, moment: float) -> int:
        """The last sample at or before `moment` (the first one if none is)."""
        before = [v for t, v in self.samples if t <= moment]
        return before[-1] if before else self.samples[0][1]


@dataclass
class OpenLoopRun:
    """A running `bench.openloop` child: `started`/`ended` are its START/END moments."""

    child: Child
    started: float = 0.0
    ended: float = 0.0

    async def end(self, within: float) -> dict[str, Any]:
        await self.child.expect("END", within)
        self.ended = time.monotonic()
        result: dict[str, Any] = orjson.loads(await self.child.expect("RESULT", within))
        return result


@contextlib.asynccontextmanager
async def open_loop(
    url: str, cores: Cores, args: Sequence[str], within: float = 30.0
) -> AsyncIterator[OpenLoopRun]:
    child = await Child.start("openloop", "bench.openloop", ["--url", url, *args], cpus=cores.rest)
    try:
        await child.expect("START", within)
        yield OpenLoopRun(child, started=time.monotonic())
    finally:
        await child.close()


async def stored_vs_ok(
    control: Any, total_ok: int, namespaces: Sequence[str], abandoned: int = 0
) -> str:
    """The broker's stored messages against the 2xx answers, as one line of text.

    `abandoned`: requests the client gave up on (its deadline, a lost connection); the
    gateway may still have stored them, so a surplus up to that many is explained."""
    stored = 0
    for ns in namespaces:
        stored += int((await control.counters(ns))["messages_received"])
    if stored == total_ok:
        verdict = "exact"
    elif total_ok < stored <= total_ok + abandoned:
        verdict = (
            f"every 2xx stored; the {stored - total_ok:,} more are among the {abandoned:,} "
            "requests the client abandoned before their answer"
        )
    else:
        verdict = "MISMATCH"
    return f"broker stored {stored:,} / answered 2xx {total_ok:,} ({verdict})"


def compare_dumps(prefix: Path, before: int, after: int, top: int = 12) -> list[str]:
    """What grew in the gateway between its dumps `before` and `after` (see
    `bench.gateway_server`): object counts by type, and with tracing, the allocation sites
    (by traceback) that grew most, as text lines."""
    import tracemalloc

    lines = []
    old_types = orjson.loads(Path(f"{prefix}.{before}.types.json").read_bytes())
    new_types = orjson.loads(Path(f"{prefix}.{after}.types.json").read_bytes())
    lanes = new_types.pop("_lanes", {})
    cycles = new_types.pop("_cycles", {})
    old_types.pop("_lanes", None)
    old_types.pop("_cycles", None)
    memory = new_types.pop("_memory", {})
    old_memory = old_types.pop("_memory", {})
    if memory:
        lines.append(
            "memory (dump 1 -> dump 2, MiB): "
            + ", ".join(
                f"{k} {old_memory.get(k, 0) / MiB:.1f} -> {v / MiB:.1f}"
                if k not in ("python_blocks", "threads", "os_threads")
                else f"{k} {old_memory.get(k, 0):,} -> {v:,}"
                for k, v in memory.items()
            )
        )
    if cycles:
        lines.append(
            "freed only by the cycle collector: "
            + ", ".join(f"{t} {n:,}" for t, n in cycles.items() if n)
        )
    grown = sorted(((n - old_types.get(t, 0), t) for t, n in new_types.items()), reverse=True)[:top]
    lines.append("objects by type: " + ", ".join(f"{t} {d:+,}" for d, t in grown if d))
    for dest, lane in sorted(lanes.items()):
        lines.append(f"lane {dest}: " + ", ".join(f"{k} {v}" for k, v in lane.items()))
    old_snap, new_snap = Path(f"{prefix}.{before}.snap"), Path(f"{prefix}.{after}.snap")
    if old_snap.exists() and new_snap.exists():
        old = tracemalloc.Snapshot.load(str(old_snap))
        new = tracemalloc.Snapshot.load(str(new_snap))
        for stat in new.compare_to(old, "traceback")[:top]:
            frames = [f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback]
            lines.append(
                f"{stat.size_diff / MiB:+8.1f} MiB {stat.count_diff:+9,d} blocks  "
                + " <- ".join(frames[-1:-7:-1])
            )
    return lines


def run_bench(
    title: str, bench: Callable[[Cores, Callable[[str], None]], Coroutine[Any, Any, Any]]
) -> int:
    """Run `bench(cores, log)` as the memory benchmarks' ``main`` does: the orchestrator on
    the second CPU, a header line, SIGTERM unwinding like Ctrl-C (every child stopped)."""
    cores = Cores.split()
    if cores.rest:
        os.sched_setaffinity(0, cores.rest)  # the orchestrator stays off the gateway's CPU
    print(
        f"{title}: {cores.describe}; python {sys.version.split()[0]}; load average "
        f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}",
        flush=True,
    )

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        asyncio.run(bench(cores, log))
    except KeyboardInterrupt:
        print("\ninterrupted: every child process was stopped", file=sys.stderr)
        return 130
    return 0


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def series_by_kind(result: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """The child's answer series as per-second rates: kind -> [(seconds from t0, rate)],
    with every step from the first to the last (zero where a kind had nothing)."""
    bucket = float(result["bucket"])
    series: Mapping[str, Mapping[str, int]] = result["series"]
    if not series:
        return {}
    slots = range(min(map(int, series)), max(map(int, series)) + 1)
    kinds = {k for counts in series.values() for k in counts}
    return {
        kind: [((i + 0.5) * bucket, series.get(str(i), {}).get(kind, 0) / bucket) for i in slots]
        for kind in kinds
    }


def plot(
    path: Path,
    title: str,
    rss: Sequence[tuple[float, int]],
    origin: float,
    spans: Sequence[tuple[float, float, str]],
    answers: Mapping[str, Sequence[tuple[float, float]]],
    answers_origin: float,
) -> Path:
    """RSS (MB) over time on top, answers per second by kind below; `spans` are shaded
    phases (start, end, label) in seconds from `origin`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, dpi=80)
    xs = [t - origin for t, _ in rss]
    top.plot(xs, [v / MiB for _, v in rss], color="tab:blue", linewidth=1.2)
    top.set_ylabel("gateway RSS (MiB)")
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    shift = answers_origin - origin
    for kind, points in sorted(answers.items()):
        bottom.plot([t + shift for t, _ in points], [r for _, r in points], label=kind, lw=1)
    bottom.set_ylabel("per second")
    bottom.set_xlabel("seconds")
    bottom.grid(alpha=0.3)
    if answers:
        bottom.legend(fontsize=7, loc="upper right", ncol=3)
    for ax in (top, bottom):
        for start, end, label in spans:
            ax.axvspan(start, end, color="tab:red", alpha=0.08)
            if ax is top:
                ax.text(start, 0.02, f" {label}", transform=ax.get_xaxis_transform(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
