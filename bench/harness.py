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

What the benchmarks run against — the local broker, redis-server, ``gateway serve`` — comes
from the launcher kit the tests use (`tests.support.processes`); `Server` here starts
`bench.gateway_server`, the benchmarks' own instrumented server, under this protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import orjson

if TYPE_CHECKING:
    from aiohttp import web

    from sblocal.testing import ControlClient
    from tests.support.processes import BrokerProcess, RedisServer

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


def cpu_ticks(cpus: frozenset[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cpus` so far, from /proc/stat (every process on them):
    two readings give the share of the time those CPUs were busy in between."""
    busy = total = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        busy += sum(ticks) - idle
        total += sum(ticks)
    return busy, total


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


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Mapping[str, Any]
) -> argparse.Namespace:
    """`parser`'s arguments plus ``--quick`` (what ``python -m bench --quick`` passes to every
    benchmark): with it, the values in `quick` replace the defaults; an option given on the
    command line still wins."""
    shown = " ".join(
        f"--{k.replace('_', '-')}"
        + ("" if v is True else " " + " ".join(map(str, v if isinstance(v, list) else [v])))
        for k, v in quick.items()
    )
    parser.add_argument("--quick", action="store_true", help=f"a short run ({shown})")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args


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


def child_output(
    module: str, args: Sequence[str], *, timeout: float, wrapper: Sequence[str] = ()
) -> str:
    """Run ``python -m <module> <args>`` to its end in a fresh interpreter (this checkout on
    its path, at most `timeout` s; under `wrapper`, e.g. valgrind, when given) and return its
    stdout; ChildError with its stderr's tail if it fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*wrapper, sys.executable, "-m", module, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise ChildError(
            f"{module} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return done.stdout


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


# -- in-memory connections (bench.gateway_profile, bench.tracing_bench) ----------------------


# Settings for an in-memory gateway: namespaces that are never reached (the null sink).
IN_MEMORY_ENV = {
    "SBGATE_PRIMARY_CONNECTION_STRING": (
        "Endpoint=sb://primary.invalid/;SharedAccessKeyName=b;SharedAccessKey=b"
    ),
    "SBGATE_PRIMARY_NAME": "primary",
    "SBGATE_SECONDARY_CONNECTION_STRING": (
        "Endpoint=sb://secondary.invalid/;SharedAccessKeyName=b;SharedAccessKey=b"
    ),
    "SBGATE_SECONDARY_NAME": "secondary",
    "SBGATE_ENTITIES": "queue:orders,topic:events",
    "SBGATE_REPLICA_ID": "profile",
    "SBGATE_LOG_LEVEL": "WARNING",
}


class MemoryTransport(asyncio.Transport):
    """A transport with no socket under it, for an aiohttp protocol driven in process: what
    the protocol calls beyond `write`, `close` and `is_closing` (the subclass's), as no-ops."""

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None


class _FakeTransport(MemoryTransport):
    """Collects one connection's answers; each complete answer sends the next request."""

    def __init__(self, driver: InMemoryDriver, index: int) -> None:
        super().__init__()
        self._driver = driver
        self._index = index
        self._buf = bytearray()
        self._closing = False
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        extra = {"peername": ("127.0.0.1", 40000 + self._index), "sockname": ("127.0.0.1", 1)}
        return extra.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data
        while (end := self._buf.find(b"\r\n\r\n")) >= 0:
            head = bytes(self._buf[:end]).lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j > 0 else len(head)]) if i >= 0 else 0
            if len(self._buf) < end + 4 + length:
                return
            del self._buf[: end + 4 + length]
            self._driver.answered(self)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True


class InMemoryDriver:
    """`connections` fake connections to `server` (an aiohttp protocol factory), one request
    in flight on each, each answer sending the next, until `total` are answered
    (`finished`). No sockets: what is measured is the Python work per request."""

    def __init__(self, server: web.Server, connections: int, total: int, request: bytes) -> None:
        self._loop = asyncio.get_running_loop()
        self._request = request
        self._left = total
        self._total = total
        self._answered = 0
        self.finished: asyncio.Future[None] = self._loop.create_future()
        self.transports = [_FakeTransport(self, i) for i in range(connections)]
        for t in self.transports:
            t.protocol = server()
            t.protocol.connection_made(t)

    def start(self) -> None:
        for t in self.transports:
            self._send(t)

    def _send(self, t: _FakeTransport) -> None:
        if self._left > 0:
            self._left -= 1
            self._loop.call_soon(t.protocol.data_received, self._request)

    def answered(self, t: _FakeTransport) -> None:
        self._answered += 1
        if self._answered >= self._total:
            if not self.finished.done():
                self.finished.set_result(None)
        else:
            self._send(t)

    def close(self) -> None:
        for t in self.transports:
            t.protocol.connection_lost(None)


async def cpu_per_request(
    server: web.Server, requests: int, request: bytes, connections: int = 64
) -> float:
    """CPU µs per request (`time.process_time`: every thread of this process) of `requests`
    answers from `server` on `connections` in-memory connections (at most 120 s)."""
    driver = InMemoryDriver(server, connections, requests, request)
    try:
        started = time.process_time()
        driver.start()
        async with asyncio.timeout(120):
            await driver.finished
        return (time.process_time() - started) / requests * 1e6
    finally:
        driver.close()


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

    @property
    def metrics_url(self) -> str:
        """Where /metrics is read: the gateway's probe port, which overload never closes
        (the listen port refuses a scrape while it is paused), else the server's own."""
        port = self.info.get("probe_port")
        return f"http://127.0.0.1:{port}" if port else self.url

    async def close(self) -> None:
        await self.child.close()


async def start_redis(cpus: frozenset[int]) -> RedisServer:
    """The launcher kit's `RedisServer` (our own, on a free port, no persistence), started
    off the event loop and pinned to `cpus`. The caller closes it (``close()``, blocking)."""
    from tests.support.processes import RedisServer  # not in the children's imports

    server = RedisServer()
    await asyncio.to_thread(server.start)
    pin(server.pid, cpus)
    return server


# -- the gateway against the local broker ----------------------------------------------


@dataclass
class GatewayOnBroker:
    """The local broker and a `bench.gateway_server` (SDK sink) in front of it."""

    broker: BrokerProcess
    gateway: Server
    settings: dict[str, str]

    @property
    def control(self) -> ControlClient:
        return self.broker.control

    @property
    def conn(self) -> str:
        """The primary namespace's connection string (for SDK clients compared with it)."""
        return self.broker.connection_string("primary")


def bench_env(broker: BrokerProcess, extra: Mapping[str, str]) -> dict[str, str]:
    """Gateway settings (`SBGATE_*`) for the local broker's `primary` and `secondary`
    namespaces (the kit's `broker_wiring`; failover on, warnings only), then `extra`."""
    from tests.support.processes import broker_wiring

    return {
        "SBGATE_REPLICA_ID": "bench",
        "SBGATE_LOG_LEVEL": "WARNING",
        "SBGATE_ENABLE_FAILOVER": "true",
        **broker_wiring(broker),
        **extra,
    }


@contextlib.asynccontextmanager
async def gateway_on_broker(
    cores: Cores, extra: Mapping[str, str]
) -> AsyncIterator[GatewayOnBroker]:
    """The local broker on the second CPU, the gateway (SDK sink, failover on, `extra`
    settings) on the first; both stopped on the way out."""
    from tests.support.processes import BrokerProcess

    broker = BrokerProcess()
    await broker.astart()
    try:
        pin(broker.pid, cores.rest)
        env = bench_env(broker, {"SBGATE_ENTITIES": "queue:orders,topic:events", **extra})
        gateway = await Server.start("gateway", "gateway", env, cpus=cores.subject, sink="sdk")
        try:
            await broker.control.reset()
            yield GatewayOnBroker(broker, gateway, env)
        finally:
            await gateway.close()
    finally:
        await broker.astop()


def write_many_queues(broker_config: Path, gateway_config: Path, n: int) -> None:
    """A broker config (`primary` with queues q0..q<n-1>, and `secondary`, the backlog
    queues' namespace) and a gateway config (`SBGATE_CONFIG`) declaring the n queues."""
    lines = ['[[namespaces]]\nname = "primary"\n']
    lines += [f'[[namespaces.queues]]\npath = "q{i}"\n' for i in range(n)]
    lines.append('[[namespaces]]\nname = "secondary"\n')
    broker_config.write_text("\n".join(lines))
    gateway_config.write_text("".join(f'[[entities]]\npath = "q{i}"\n' for i in range(n)))
