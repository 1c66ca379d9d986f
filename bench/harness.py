"""Process plumbing shared by the benchmarks: CPU accounting, core pinning, child processes.

Every measured party (gateway, load generator, SDK client, broker, redis) runs in its own
process, so its CPU time can be read from ``/proc/<pid>/stat`` (all threads, user + system)
around a measurement window. On a machine with at least two CPUs the gateway (or the SDK
client it is compared with) gets the first one and everything else the second one.

Children written for the benchmarks (`bench.loadgen`, `bench.sdk_clients`,
`bench.gateway_server`) speak a line protocol on stdout:

* ``READY <json>`` — set up (connections open, senders warm), optional;
* ``START`` — the measurement window opens now;
* ``END`` — it closes now (before draining whatever is still in flight);
* ``RESULT <json>`` — the child's own figures; then it exits.

Every wait on a child has a deadline, and every child is killed if the benchmark fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import orjson

ROOT = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


# -- CPU time and cores ---------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (every thread); 0.0 if it is gone."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLK_TCK


@dataclass(frozen=True, slots=True)
class Cores:
    """Which CPUs the measured process and the rest may use (empty sets: no pinning)."""

    subject: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def split(cls) -> Cores:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return cls(frozenset(), frozenset())
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]))

    @property
    def describe(self) -> str:
        if not self.subject:
            return "not pinned (fewer than 2 CPUs)"
        return f"subject on CPU {sorted(self.subject)}, the rest on CPU {sorted(self.rest)}"


def pin(pid: int | None, cpus: frozenset[int]) -> None:
    """Pin every thread of `pid` (threads started later inherit from their creator)."""
    if pid is None or not cpus:
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def pin_self_from_env() -> None:
    """Children call this first: ``BENCH_CPUS=1`` pins them before they start any thread."""
    value = os.environ.get("BENCH_CPUS")
    if value:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, {int(c) for c in value.split(",")})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_fast(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` to completion under uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def emit(line: str) -> None:
    """One protocol line on stdout, flushed at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- child processes ------------------------------------------------------------------------


class ChildError(RuntimeError):
    """A benchmark child failed, or broke the line protocol; carries its stderr's tail."""


@dataclass
class Window:
    """CPU seconds used by watched processes between START and END, and the child's RESULT."""

    result: dict[str, Any]
    cpu: dict[str, float]
    wall: float


class Child:
    """One benchmark child process (``python -m bench.<module> ...``), owned by the caller:
    `close()` terminates it (SIGTERM, then SIGKILL) and reaps it."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        name: str,
        stderr: IO[bytes],
    ) -> None:
        self.proc = proc
        self.name = name
        self._stderr = stderr

    @classmethod
    async def start(
        cls,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        cpus: frozenset[int] = frozenset(),
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
    ) -> Child:
        child_env = dict(os.environ if env is None else env)
        extra = child_env.get("PYTHONPATH")
        child_env["PYTHONPATH"] = str(ROOT) + (os.pathsep + extra if extra else "")
        child_env["PYTHONUNBUFFERED"] = "1"
        if cpus:
            child_env["BENCH_CPUS"] = ",".join(str(c) for c in sorted(cpus))
        stderr = tempfile.TemporaryFile(prefix=f"bench-{name}-")  # closed by close()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *args,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=child_env,
            cwd=str(ROOT),
            limit=64 * 1024 * 1024,  # RESULT lines can be long (a memory bench's time series)
        )
        return cls(proc, name, stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - chars))
        return self._stderr.read().decode(errors="replace")

    async def expect(self, word: str, within: float) -> str:
        """Read lines until one starts with `word`; return the rest of that line."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(within):
                while True:
                    raw = await self.proc.stdout.readline()
                    if not raw:
                        await self.proc.wait()
                        raise ChildError(
                            f"{self.name} exited ({self.proc.returncode}) before {word}:\n"
                            f"{self.stderr_tail()}"
                        )
                    line = raw.decode().rstrip("\n")
                    head, _, rest = line.partition(" ")
                    if head == word:
                        return rest
        except TimeoutError:
            raise ChildError(
                f"{self.name}: no {word} within {within:g} s:\n{self.stderr_tail()}"
            ) from None

    async def measure(self, watch: Mapping[str, int | None], within: float) -> Window:
        """Wait for START/END/RESULT and read the CPU of `watch` (and of this child) at
        START and END."""
        pids = {**watch, self.name: self.pid}
        await self.expect("START", within)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        await self.expect("END", within)
        after = {k: cpu_seconds(p) for k, p in pids.items()}
        wall = loop.time() - t0
        result = orjson.loads(await self.expect("RESULT", within))
        cpu = {k: after[k] - before[k] for k in pids}
        if "cpu_s" in result:  # the child's own reading: exact, where /proc counts 10 ms ticks
            cpu[self.name] = float(result["cpu_s"])
        return Window(result=result, cpu=cpu, wall=wall)

    def go(self) -> None:
        """Release a child waiting on stdin (``--sync``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    async def close(self, within: float = 10.0) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(within):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        self._stderr.close()


async def run_child(
    name: str,
    module: str,
    args: Sequence[str],
    *,
    watch: Mapping[str, int | None],
    cpus: frozenset[int],
    within: float,
) -> Window:
    """Start a measuring child, collect its window, and reap it."""
    child = await Child.start(name, module, args, cpus=cpus)
    try:
        return await child.measure(watch, within)
    finally:
        await child.close()


async def run_together(
    children: Sequence[tuple[str, str, Sequence[str]]],
    *,
    watch: Mapping[str, int | None],
    cpus: frozenset[int],
    within: float,
) -> tuple[dict[str, dict[str, Any]], dict[str, float], float]:
    """Several ``--sync`` children (name, module, args) measuring one window together.

    All are started and warmed up, then released at once; the CPU of `watch` is read just
    before the release and once every child has closed its window. Returns each child's
    RESULT, the CPU seconds of `watch`, and the wall time between the two readings."""
    started: list[Child] = []
    try:
        for name, module, args in children:
            started.append(await Child.start(name, module, args, cpus=cpus, stdin=True))
        await asyncio.gather(*(c.expect("READY", within) for c in started))
        loop = asyncio.get_running_loop()
        before = {k: cpu_seconds(p) for k, p in watch.items()}
        t0 = loop.time()
        for c in started:
            c.go()
        await asyncio.gather(*(c.expect("END", within) for c in started))
        after = {k: cpu_seconds(p) for k, p in watch.items()}
        wall = loop.time() - t0
        results = await asyncio.gather(*(c.expect("RESULT", within) for c in started))
        return (
            {c.name: orjson.loads(r) for c, r in zip(started, results, strict=True)},
            {k: after[k] - before[k] for k in watch},
            wall,
        )
    finally:
        for c in started:
            await c.close()


# -- servers --------------------------------------------------------------------------------


@dataclass
class Server:
    """A `bench.gateway_server` child, listening on `url` once started."""

    label: str
    child: Child
    url: str
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def start(
        cls,
        label: str,
        mode: str,
        env: Mapping[str, str],
        *,
        cpus: frozenset[int],
        sink: str = "null",
        within: float = 60.0,
    ) -> Server:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SBGATE_")}
        full_env.update(env)
        child = await Child.start(
            label,
            "bench.gateway_server",
            ["--mode", mode, "--sink", sink],
            cpus=cpus,
            env=full_env,
        )
        try:
            info = orjson.loads(await child.expect("READY", within))
        except BaseException:
            await child.close()
            raise
        pin(child.pid, cpus)
        return cls(label, child, f"http://127.0.0.1:{info['port']}", info)

    @property
    def pid(self) -> int:
        return self.child.pid

    async def close(self) -> None:
        await self.child.close()


class RedisProcess:
    """Our own ``redis-server`` on a free port: no persistence, never the system's 6379."""

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="bench-redis-")
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self, cpus: frozenset[int], within: float = 10.0) -> RedisProcess:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self._proc = await asyncio.create_subprocess_exec(
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        pin(self._proc.pid, cpus)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:  # poll the port with a deadline: redis prints nothing we could await
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                if loop.time() > deadline or self._proc.returncode is not None:
                    await self.stop()
                    raise RuntimeError("redis-server did not start") from None
                await asyncio.sleep(0.05)
            else:
                writer.close()
                await writer.wait_closed()
                return self

    async def stop(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self._proc.wait()
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        self._dir.cleanup()
