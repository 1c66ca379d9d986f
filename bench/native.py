"""Native load generators: Debian's `h2load` (nghttp2-client) and `wrk`, run as children.

A Python load generator on the second CPU spent as much CPU per request as the gateway did
on the first, so an overload run measured the generator: at 2x the gateway's sustainable
rate the other CPU was 97-99 % busy. `h2load` (HTTP/1.1 with ``--h1``) and `wrk` are event
loops in C that cost a fraction of that; `make bench-tools` installs them with apt.

* `H2Load`: what one run does. Without ``rate`` it is **closed loop** (``connections``
  clients, each sending its next request on its answer: what the server sustains). With
  ``rate`` it is **open loop at a fixed rate**: every client paces ``rate / connections``
  requests a second (``--rps``); a client whose last request is still unanswered sends the
  arrivals it owes as soon as it can, so an arrival that could not go out on time shows as
  the difference between the requests due (``rate * duration``) and those started
  ("client-shed" in the tables: never sent within the run). One h2load run for a duration
  connects every client at once and fires all their timers together, a train of bursts;
  with ``ramp`` the clients connect evenly over that many seconds, so their timers are out
  of phase and the arrivals are a rate, and the run is counted in requests, each client
  running ``duration`` once connected (`H2Load.steady`: when the offered rate is steady).
  A load can also be ``spread`` over several h2load processes started a fraction of a
  client's interval apart (their figures summed), each run, with ``slice``, as successive
  h2load runs of that many seconds: h2load never retries a refused connect, so without
  slices a client the gateway's paused listener refused is lost for the run. The connects
  refused meanwhile are counted (`refused_connects`, machine-wide), and the connections
  reset while they waited in the listener's queue (`reset_connections`). With
  ``generator="sbload"`` an open loop with a ramp runs `bench/sbload.c` instead (built by
  `make bench-tools`): the same summary and log, but its clients reconnect one by one after
  a refused connect, a reset or a close, never pipeline (h2load's ``--rps`` does after a
  server's close: `bench.h2load_reconnect`), and shed an arrival not sent before their
  schedule's end.
* `run_h2load`: the child pinned to the given CPUs (`taskset`), bounded in time (killed
  after its ramp, duration, client deadline and a grace), its per-request log
  (``--log-file``: start, status, microseconds) read into the figures the benchmarks print:
  answers by status, latency percentiles per status, the ``503`` answers and connection
  failures within ``fast`` seconds, answers per bucket of time, and its own CPU seconds
  beside those of the processes it watched. With ``BENCH_H2LOAD_LOGS=<dir>`` each run's
  per-request log (all its processes') is also kept there, one file a run.
* `parse_h2load`, `parse_h2load_log`, `parse_wrk`: the parsers (tested against the real
  tools' output, ``tests/test_bench_native.py``).

Latency here is measured from when a request was **sent**, not from when it was due: a
request held back by a busy connection does not count its wait (coordinated omission); the
client-shed count says how many were held back past the end of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.harness import Window, cpu_seconds

INSTALL_HINT = "make bench-tools (apt-get install nghttp2-client wrk)"
# A child gets this long beyond its duration to connect, finish and write its log.
GRACE = 30.0


class ToolMissing(RuntimeError):
    """h2load or wrk is not installed: run `make bench-tools`."""


def tool(name: str) -> str:
    """The path of `name` (h2load, wrk; sbload, which `make bench-tools` builds into the
    venv's bin); ToolMissing with the install command if absent."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        raise ToolMissing(f"{name} is not installed: {INSTALL_HINT}")
    return path


# -- h2load --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class H2Load:
    """One h2load run: HTTP/1.1 POSTs of `body` to `urls` (each client cycles through them)."""

    urls: Sequence[str]
    duration: float
    connections: int = 64
    rate: float | None = None  # requests a second over all clients; None: closed loop
    body: bytes = b"{}"
    headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    timeout: float = 30.0  # a connection silent this long is dropped (h2load's -N)
    fast: float = 0.05  # a 503 or a connection failure this soon "failed fast"
    bucket: float = 0.5  # seconds per step of the answers-over-time series
    # Open loop: the seconds over which the clients connect, evenly (h2load's ``-r`` a
    # ``--rate-period``), each then running `duration`. A client's request timer starts when
    # it connects, so the clients' requests are spread over their interval: h2load run for a
    # duration (``-D``) connects every client at once and fires all their timers in the same
    # millisecond, once an interval, a train of bursts and not a rate (measured: 1,600
    # clients at 2.5 req/s each sent in 16 of 281 10-ms slots), and a listener meeting the
    # connects all at once pauses for its accept queue, refusing clients h2load never brings
    # back. With a ramp the run is counted in requests (``-n``: rate x duration) and ends
    # when every one is answered, so none is left in flight at its end; the offered rate is
    # steady from `ramp` to `duration` after the start (`steady`).
    ramp: float = 0.0
    # Open loop: the clients split among this many h2load processes, started a fraction of a
    # client's interval apart (without a ramp, the only way to put their timers out of phase).
    spread: int = 1
    # Open loop: each process runs as successive h2load runs of this many seconds (0: one
    # run), so a client whose connect was refused (the gateway's listener paused) is back at
    # the next slice, as a real client reconnects, instead of lost for the run.
    slice: float = 0.0
    # Open loop with a ramp: "sbload" (bench/sbload.c) instead of h2load, whose clients each
    # reconnect on their own after a refused connect, a reset or a close (a jittered backoff,
    # 50 ms doubling to 1 s) and never pipeline; the same summary and log. One URL.
    generator: str = "h2load"

    @property
    def ramped(self) -> bool:
        return self.rate is not None and self.ramp > 0

    @property
    def steady(self) -> tuple[float, float] | None:
        """Seconds after the start between which every client is sending (a ramped open
        loop whose duration exceeds its ramp), else None."""
        if not self.ramped or self.slice or self.duration <= self.ramp:
            return None
        return (self.ramp, self.duration)

    @property
    def requests(self) -> int:
        """An open loop's arrivals: rate x duration (a ramped run's ``-n``, which is at
        least one a client)."""
        assert self.rate is not None
        due = round(self.rate * self.duration)
        return max(self.connections, due) if self.ramped else due

    @property
    def bound(self) -> float:
        """Seconds one process may run before it is killed: its ramp, its duration and a
        silent connection's deadline."""
        return (self.ramp if self.ramped else 0.0) + self.duration + self.timeout + GRACE

    def parts(self) -> list[tuple[float, H2Load]]:
        """The h2load runs this load is made of, each with its start delay in seconds."""
        k = min(self.spread, self.connections) if self.rate is not None else 1
        if k <= 1 or self.rate is None:
            return [(0.0, self)]
        interval = self.connections / self.rate  # seconds between one client's requests
        out = []
        for i in range(k):
            n = self.connections // k + (i < self.connections % k)
            part = replace(self, connections=n, rate=self.rate * n / self.connections, spread=1)
            out.append((interval * i / k, part))
        return out

    def slices(self) -> list[H2Load]:
        """The successive runs one process of this load is made of (see `slice`)."""
        if not self.slice or self.rate is None or self.slice >= self.duration or self.sbload:
            return [self]
        whole = int(self.duration // self.slice)
        runs = [replace(self, duration=self.slice, slice=0.0)] * whole
        rest = self.duration - whole * self.slice
        if rest > 0.1:
            runs.append(replace(self, duration=rest, slice=0.0))
        return runs

    @property
    def sbload(self) -> bool:
        return self.generator == "sbload"

    def command(self, body_path: Path, log_path: Path, urls_path: Path | None) -> list[str]:
        if self.sbload:
            return self._sbload(body_path, log_path)
        cmd = [
            tool("h2load"),
            "--h1",
            "-t",
            "1",
            "-c",
            str(self.connections),
            *self._length(),
            "-N",
            f"{max(1, round(self.timeout))}",
            # No connection outlives the run and its deadline, whatever happens to it: twice
            # on a saturated machine h2load ran past duration + -N (the cause is not known).
            "-T",
            f"{max(1, round(self.bound - GRACE))}",
            "-d",
            str(body_path),
            "--log-file",
            str(log_path),
        ]
        for name, value in self.headers.items():
            cmd += ["-H", f"{name}: {value}"]
        if self.rate is not None:
            cmd += ["--rps", f"{self.rate / self.connections:.3f}"]
        if urls_path is not None:
            cmd += ["-i", str(urls_path)]
        else:
            cmd.append(self.urls[0])
        return cmd

    def _sbload(self, body_path: Path, log_path: Path) -> list[str]:
        """sbload's arguments (bench/sbload.c): an open loop over a ramp, to one URL."""
        if not self.ramped or len(self.urls) != 1:
            raise ValueError("sbload runs an open loop with a ramp, to one URL")
        assert self.rate is not None
        url = urlsplit(self.urls[0])
        return [
            tool("sbload"),
            url.hostname or "127.0.0.1",
            str(url.port or 80),
            url.path or "/",
            str(body_path),
            str(self.connections),
            str(self.requests),
            f"{self.rate / self.connections:.6f}",
            f"{self.ramp:g}",
            f"{self.timeout:g}",
            f"{self.bound - GRACE:g}",
            str(log_path),
            *(f"{name}: {value}" for name, value in self.headers.items()),
        ]

    def _length(self) -> list[str]:
        """How long the run is: a duration (``-D``), or with a ramp its requests (``-n``)
        and the pace its clients connect at (``-r`` a ``--rate-period``, at most one
        period a millisecond)."""
        if not self.ramped:
            return ["-D", f"{max(1, round(self.duration * 1000))}ms"]
        assert self.rate is not None
        every = max(1, math.ceil(self.connections / (self.ramp * 1000.0)))
        period_ms = max(1, round(self.ramp * 1000.0 * every / self.connections))
        return ["-n", str(self.requests), "-r", str(every), "--rate-period", f"{period_ms}ms"]


_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
_CODES = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")
_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")


def parse_h2load(stdout: str) -> dict[str, Any]:
    """h2load's summary: wall seconds, req/s, request counts, answers by status class."""
    done = _REQUESTS.search(stdout)
    codes = _CODES.search(stdout)
    finished = _FINISHED.search(stdout)
    if done is None or codes is None or finished is None:
        raise ValueError(f"not h2load's summary:\n{stdout[-2000:]}")
    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    wall = float(finished.group(1)) / (1000.0 if finished.group(2) == "ms" else 1.0)
    return {
        "wall": wall,
        "rate": float(finished.group(3)),
        **{k: int(v) for k, v in zip(keys, done.groups(), strict=True)},
        "classes": {f"{i + 2}xx": int(v) for i, v in enumerate(codes.groups())},
    }


def percentiles(values: array[float]) -> dict[str, float]:
    """p50/p90/p99/max of `values` (seconds) in milliseconds."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000.0

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1] * 1000.0}


def parse_h2load_log(
    text: str, *, fast: float, bucket: float, steady: tuple[float, float] | None = None
) -> dict[str, Any]:
    """h2load's ``--log-file`` (one line a request: start µs since the epoch, status or -1
    for a failed stream, µs until its end): answers by status, latency percentiles by
    status, the 503s and failures within `fast` seconds, answers per `bucket` seconds; with
    `steady` (seconds after the first request), the 2xx latency percentiles of the requests
    sent within it too (``latency_steady_ms``: the ramp's connection storm left out)."""
    rows = [parts for line in text.splitlines() if len(parts := line.split("\t")) >= 3]
    first_start = min((int(parts[0]) for parts in rows), default=0) / 1e6
    steady_ok: array[float] = array("d")
    latency: dict[int, array[float]] = {}
    series: dict[int, Counter[str]] = {}
    statuses: Counter[int] = Counter()
    fast_503 = fast_failed = failed = 0
    for parts in rows:
        start, status, took = int(parts[0]) / 1e6, int(parts[1]), int(parts[2]) / 1e6
        if steady is not None and 200 <= status < 300:
            if steady[0] <= start - first_start < steady[1]:
                steady_ok.append(took)
        if status < 0:
            failed += 1
            fast_failed += took <= fast
            kind = "failed"
        else:
            statuses[status] += 1
            lat = latency.get(status)
            if lat is None:
                lat = latency[status] = array("d")
            lat.append(took)
            fast_503 += status == 503 and took <= fast
            kind = str(status)
        slot = int((start + took - first_start) / bucket)
        series.setdefault(slot, Counter())[kind] += 1
    return {
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "latency_ms": {str(k): percentiles(v) for k, v in sorted(latency.items())},
        "latency_steady_ms": percentiles(steady_ok) if steady_ok else {},
        "unavailable_fast": fast_503,
        "failed": failed,
        "failed_fast": {"connection": fast_failed} if fast_failed else {},
        "series": {str(k): dict(v) for k, v in sorted(series.items())},
        "bucket": bucket,
    }


def _tcp_counter(name: str) -> int:
    """The machine's ``Tcp:`` counter `name` in /proc/net/snmp; 0 where it is not to be read."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    except OSError:
        return 0
    tcp = [line for line in lines if line and line[0] == "Tcp:"]
    if len(tcp) < 2 or name not in tcp[0]:
        return 0
    return int(tcp[1][tcp[0].index(name)])


def refused_connects() -> int:
    """The machine's TCP connects that failed so far (``Tcp: AttemptFails``: a connect
    answered by a reset, as at a closed listener). Machine-wide: another process's count too."""
    return _tcp_counter("AttemptFails")


def reset_connections() -> int:
    """The machine's established TCP connections reset so far (``Tcp: EstabResets``). When
    the gateway's listener closes for its accept queue, the connections waiting in that queue
    are reset: their clients had connected and sent a request, which h2load counts as started
    and never done (no line in its log). Over loopback both ends of each count, so such
    connections are half the difference. Machine-wide, as `refused_connects`."""
    return _tcp_counter("EstabResets")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def run_h2load(
    load: H2Load, *, cpus: frozenset[int], watch: Mapping[str, int | None]
) -> Window:
    """Run `load` pinned to `cpus` and return its figures, with the CPU seconds `watch`'s
    processes and h2load itself used during the run. Bounded: h2load is killed after
    `H2Load.bound` seconds (a RuntimeError, with what it printed).
    A load `spread` over several h2load processes is summed (their logs read as one)."""
    with tempfile.TemporaryDirectory(prefix="bench-h2load-") as tmp:
        work = Path(tmp)
        body = work / "body"
        body.write_bytes(load.body)
        urls = None
        if len(load.urls) > 1:
            urls = work / "urls"
            urls.write_text("".join(u + "\n" for u in load.urls))
        parts = load.parts()
        before = {k: cpu_seconds(p) for k, p in watch.items()}
        own0 = _children_cpu()
        refused0, resets0 = refused_connects(), reset_connections()
        started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as group:  # one failing stops (kills) the others
                runs = [
                    group.create_task(_sliced(part, work / f"p{i}", body, urls, cpus, delay))
                    for i, (delay, part) in enumerate(parts)
                ]
        except* RuntimeError as failed:
            raise failed.exceptions[0] from None
        outs = [run.result() for run in runs]
        wall = time.monotonic() - started
        after = {k: cpu_seconds(p) for k, p in watch.items()}
        own = _children_cpu() - own0
        refused = refused_connects() - refused0
        resets = reset_connections() - resets0
        # Each process's slices in turn (their walls added), the processes side by side.
        per_part = [[parse_h2load(out) for out in part_outs] for part_outs in outs]
        summaries = [s for part in per_part for s in part]
        summary = summaries[0]
        if len(summaries) > 1:
            counts = [k for k in summary if k not in ("wall", "classes")]
            summary = {
                **{k: sum(s[k] for s in summaries) for k in counts},
                "wall": max(sum(s["wall"] for s in part) for part in per_part),
                "classes": {c: sum(s["classes"][c] for s in summaries) for c in summary["classes"]},
            }
        summary["refused_connects"] = refused
        summary["reset_connections"] = resets // 2  # both ends of each, over loopback
        logs = [
            work / f"p{i}-{j}.tsv" for i, (_, p) in enumerate(parts) for j in range(len(p.slices()))
        ]
        text = "".join(log.read_text() for log in logs if log.exists())
        _keep_log(text)
        detail = parse_h2load_log(text, fast=load.fast, bucket=load.bucket, steady=load.steady)
    return Window(
        result=_result(load, summary, detail, own),
        cpu={**_delta(before, after), "h2load": own},
        wall=wall,
    )


def _keep_log(text: str) -> None:
    """With ``BENCH_H2LOAD_LOGS=<dir>``, a run's per-request log kept there, one file a run."""
    if keep := os.environ.get("BENCH_H2LOAD_LOGS"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"h2load-{time.time():.0f}.tsv").write_text(text)


async def _sliced(
    load: H2Load, stem: Path, body: Path, urls: Path | None, cpus: frozenset[int], delay: float
) -> list[str]:
    """One process of a load, started after `delay` seconds, as its successive slices (each
    run after the last, its log beside the others): what each printed."""
    await asyncio.sleep(delay)  # the bench's pacing: this part's clients' phase
    outs = []
    for j, run in enumerate(load.slices()):
        log = stem.with_name(f"{stem.name}-{j}.tsv")
        outs.append(await _h2load(run, run.command(body, log, urls), cpus))
    return outs


async def _h2load(load: H2Load, cmd: list[str], cpus: frozenset[int]) -> str:
    """One h2load process: what it printed (bounded as `run_h2load` says; RuntimeError if it
    ran past that or failed)."""
    if cpus:
        cmd = ["taskset", "-c", ",".join(str(c) for c in sorted(cpus)), *cmd]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        # h2load drops a request unanswered for `timeout` (-N) and only then ends.
        async with asyncio.timeout(load.bound):
            out, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        out, _ = await proc.communicate()
        raise RuntimeError(
            f"h2load ran past {load.bound:g} s (killed):\n{out.decode(errors='replace')[-2000:]}"
        ) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    stdout = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"h2load exited {proc.returncode}:\n{stdout[-2000:]}")
    return stdout


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _result(
    load: H2Load, summary: dict[str, Any], detail: dict[str, Any], own_cpu: float
) -> dict[str, Any]:
    """The figures under the names `bench.loadgen` and `bench.openloop` use, so a benchmark
    reads either."""
    statuses: dict[str, int] = detail["statuses"]
    ok = sum(v for k, v in statuses.items() if k.startswith("2"))
    wall = float(summary["wall"]) or load.duration
    due = load.requests if load.rate is not None else int(summary["started"])
    answered = sum(statuses.values())
    lat = detail["latency_ms"]
    all_p99 = max((v.get("p99", 0.0) for v in lat.values()), default=float("nan"))
    errors: dict[str, int] = {}
    if detail["failed"]:
        errors["connection"] = int(detail["failed"])
    if summary["timeout"]:
        errors["timeout"] = int(summary["timeout"])
    return {
        "generator": load.generator,
        "rate": answered / wall if wall > 0 else 0.0,
        "offered": load.rate,
        "wall": wall,
        "due": due,
        "sent": int(summary["started"]),
        "shed": max(0, due - int(summary["started"])),
        # Connects refused (by a paused listener) during the run, machine-wide: each is a
        # refusal at once, of a client h2load brings back only at its next slice.
        "refused_connects": int(summary.get("refused_connects", 0)),
        # Connections reset in the listener's queue during the run (machine-wide, halved).
        "reset_connections": int(summary.get("reset_connections", 0)),
        # Requests in flight when the run ended (h2load stops then): each client's last one
        # in a closed loop; not failures, but their outcome is unknown.
        "unanswered_at_end": max(0, int(summary["started"]) - int(summary["done"])),
        "requests": answered,
        "total_ok": ok,
        "p99_ms": all_p99,
        "cpu_s": own_cpu,
        "summary": summary,
        "errors": errors,
        **detail,
    }


# -- wrk ------------------------------------------------------------------------------------

_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}
_WRK_PCT = re.compile(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s|m)\s*$", re.M)
_WRK_TOTAL = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m),")
_WRK_NON2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_WRK_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_WRK_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def parse_wrk(stdout: str) -> dict[str, Any]:
    """wrk's summary (run with ``--latency``): requests, seconds, req/s, non-2xx answers,
    socket errors, and the latency percentiles in milliseconds."""
    total, rate = _WRK_TOTAL.search(stdout), _WRK_RATE.search(stdout)
    if total is None or rate is None:
        raise ValueError(f"not wrk's summary:\n{stdout[-2000:]}")
    non2xx = _WRK_NON2XX.search(stdout)
    errors = _WRK_ERRORS.search(stdout)
    names = ("connect", "read", "write", "timeout")
    return {
        "requests": int(total.group(1)),
        "wall": float(total.group(2)) * _WRK_UNITS[total.group(3)] / 1000.0,
        "rate": float(rate.group(1)),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": dict(zip(names, map(int, errors.groups()), strict=True)) if errors else {},
        "latency_ms": {
            f"p{m.group(1)}": float(m.group(2)) * _WRK_UNITS[m.group(3)]
            for m in _WRK_PCT.finditer(stdout)
        },
    }


def wrk_command(url: str, *, connections: int, duration: float, script: Path) -> list[str]:
    """wrk posting with `script` (a Lua file setting method, body and headers)."""
    return [
        tool("wrk"),
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--latency",
        "-s",
        str(script),
        url,
    ]


def post_script(body: bytes, content_type: str = "application/json") -> str:
    """The Lua that makes wrk POST `body` (ASCII) with `content_type`."""
    text = body.decode("ascii").replace("\\", "\\\\").replace('"', '\\"')
    return (
        'wrk.method = "POST"\n'
        f'wrk.body = "{text}"\n'
        f'wrk.headers["Content-Type"] = "{content_type}"\n'
    )


def loadavg() -> str:
    """The 1, 5 and 15-minute load averages: the figures beside it mean little when they
    exceed the CPU count."""
    try:
        one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    except (OSError, ValueError):
        return "load average unknown"
    return f"load average {one} {five} {fifteen} on {os.cpu_count()} CPUs"
