"""The launcher kit: the one place that starts the processes our tests, benchmarks and load
tests run against.

* `free_port` — a TCP port on 127.0.0.1 that was free a moment ago;
* `BrokerProcess` — the local broker (``python -m sblocal --json``); it is the broker
  package's own launcher (`sblocal.testing`), named here so that there is one kit to read;
  `broker_wiring` / `broker_env` map it to the gateway's ``SBGATE_*`` settings;
* `RedisServer` — our own ``redis-server`` on a free port (no persistence, never a system
  Redis), with real faults: kill, pause (SIGSTOP), stop, restart;
* `GatewayProcess` — ``python -m gateway serve`` (or ``syphon``) with ``SBGATE_*`` settings,
  its output in a log file, ready when ``/readyz`` answers 200, with real signals.

`bench/`, `loadtests/` and `tests/` import these and start no such process of their own
(cluster and sentinel groups, built from `RedisServer`, are in `tests.support.redis`). The kit
lives in the test suite, not in an installed package, because none of it is for production:
the wheel holds `gateway`, `sblocal` and `pipeline` only, while `bench/` and `loadtests/` run
from a checkout (``python -m bench``, ``python -m loadtests`` from the repository root, which
puts `tests` on the path) — as aiohttp's benchmarks run through its tests' own fixtures.
Nothing here imports pytest, so a benchmark can use it as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import aiohttp

from sblocal.testing import BrokerProcess

__all__ = [
    "REDIS_SERVER",
    "BrokerProcess",
    "GatewayProcess",
    "RedisServer",
    "broker_env",
    "broker_wiring",
    "free_port",
    "rss_bytes",
]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory (``VmRSS``) of `pid` in bytes; None once the process is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the broker ------------------------------------------------------------------------------


def broker_wiring(broker: BrokerProcess) -> dict[str, str]:
    """The ``SBGATE_*`` settings that point a gateway at the local broker's ``primary`` and
    ``secondary`` namespaces (each with its admin endpoint and CA: the backlog's on the
    secondary, the entity check's on the primary), and nothing else: every other setting at
    its default."""
    env = {
        "SBGATE_PRIMARY_CONNECTION_STRING": broker.connection_string("primary"),
        "SBGATE_PRIMARY_NAME": "primary",
        "SBGATE_PRIMARY_ADMIN_CONNECTION_STRING": broker.management_connection_string("primary")
        or "",
        "SBGATE_PRIMARY_ADMIN_CA_CERT": broker.ca_cert or "",
        "SBGATE_SECONDARY_CONNECTION_STRING": broker.connection_string("secondary"),
        "SBGATE_SECONDARY_NAME": "secondary",
        "SBGATE_SECONDARY_ADMIN_CONNECTION_STRING": broker.management_connection_string("secondary")
        or "",
        "SBGATE_SECONDARY_ADMIN_CA_CERT": broker.ca_cert or "",
    }
    return {k: v for k, v in env.items() if v != ""}


# The tests' defaults over the wiring: short deadlines, text logs, failover and syphon off
# unless a test turns them on.
_TEST_DEFAULTS = {
    "SBGATE_ENTITIES": "queue:orders,topic:events",
    "SBGATE_LOG_FORMAT": "text",
    "SBGATE_SEND_TIMEOUT": "3",
    "SBGATE_CONNECT_TIMEOUT": "5",
    "SBGATE_ENABLE_FAILOVER": "false",
    "SBGATE_ENABLE_SYPHON": "false",
}


def broker_env(broker: BrokerProcess, **overrides: str) -> dict[str, str]:
    """Gateway settings (as ``SBGATE_*`` variables) for the local broker pair, with the
    tests' defaults, then `overrides` (an empty value removes a setting)."""
    env = {**broker_wiring(broker), **_TEST_DEFAULTS, **overrides}
    return {k: v for k, v in env.items() if v != ""}


# -- the gateway -----------------------------------------------------------------------------


class GatewayProcess:
    """``python -m gateway <command> [args]`` (``serve`` by default) that we own; its logs
    (stderr) go to ``<log_dir>/<name>.log``, what it prints (stdout: the banner) to
    ``<log_dir>/<name>.out``.

    Only the ``SBGATE_*`` settings in `env` apply: inherited ones (a developer's shell) would
    change the configuration, or fail it (unknown settings are refused). Signals go to this
    process only, by its pid. Waits poll with deadlines; `stop()` ends in SIGKILL if SIGTERM
    is not enough. ``async with`` starts it (ready) and stops it.
    """

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        *,
        port: int | None,
        log_dir: Path,
        command: str = "serve",
        args: Sequence[str] = (),
    ) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SBGATE_")}
        full_env.update(env)
        if port is not None:
            full_env["SBGATE_LISTEN_PORT"] = str(port)
        if "--dev" in args:
            # The development profile listens for AMQP on 5672 too: a free port instead, so
            # that tests (and a developer's own `make run`) share the machine.
            full_env.setdefault("SBGATE_AMQP_PLAIN_PORT", str(free_port()))
        full_env["PYTHONPATH"] = str(ROOT) + (
            os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else ""
        )
        self.name = name
        self.env = full_env
        self.args = [sys.executable, "-m", "gateway", command, *args]
        self.port = port
        self.command = command
        self.log_path = log_dir / f"{name}.log"
        self.out_path = log_dir / f"{name}.out"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def spawn(self) -> None:
        """Start the process without waiting for it to be ready."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended to (a restart adds to them); the child has its own descriptors.
        with open(self.log_path, "ab") as log, open(self.out_path, "ab") as out:
            log.write(f"--- start {time.strftime('%H:%M:%S')} {self.args}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
            )

    async def start(self, within: float = 60.0) -> Self:
        """Spawn, and wait until ``GET /readyz`` answers 200 (when it has a port)."""
        self.spawn()
        if self.port is not None:
            try:
                await self.wait_ready(within)
            except BaseException:
                await self.stop()
                raise
        return self

    async def wait_ready(self, within: float) -> None:
        """Until ``/readyz`` answers 200; RuntimeError if the process exits first,
        TimeoutError after `within` seconds (with the log's tail)."""
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as session:
            while True:
                if not self.running:
                    raise RuntimeError(f"{self.name} exited with {self.returncode}:\n{self.tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with asyncio.timeout(2.0):
                        async with session.get(self.url + "/readyz") as resp:
                            if resp.status == 200:
                                return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready within {within} s:\n{self.tail()}")
                await asyncio.sleep(0.1)  # polling a process we started, with a deadline

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to this process only (never to a group or by name)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process must be able to die cleanly
        self.signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    async def wait(self, within: float) -> int | None:
        """Wait for exit up to `within` s; the exit code, None if it is still running."""
        deadline = time.monotonic() + within
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        return self.returncode

    async def stop(self, within: float = 15.0) -> int | None:
        """SIGTERM, wait up to `within` s, then SIGKILL; the exit code."""
        if self.proc is None:
            return None
        self.resume()
        self.terminate()
        code = await self.wait(within)
        if code is None:
            log.warning("%s did not stop within %s s: SIGKILL", self.name, within)
            self.kill()
            code = await self.wait(10)
        return code

    def rss_bytes(self) -> int | None:
        """Resident memory, None if not running."""
        return rss_bytes(self.pid) if self.running else None

    def output(self) -> bytes:
        """Its logs so far (stderr, after a ``--- start`` line per start)."""
        try:
            return self.log_path.read_bytes()
        except OSError:
            return b""

    def printed(self) -> str:
        """What it printed so far (stdout: the banner)."""
        try:
            return self.out_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().decode(errors="replace").splitlines()[-lines:])

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# -- Redis -----------------------------------------------------------------------------------


REDIS_SERVER = os.environ.get("SBGATE_TEST_REDIS_SERVER") or shutil.which("redis-server")


class RedisServer:
    """One redis-server process we own. Blocking methods; each bounded by `timeout`."""

    def __init__(
        self,
        port: int | None = None,
        *,
        timeout: float = 10.0,
        args: Sequence[str] = (),
        tls: bool = False,
        sentinel: str | None = None,
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        self.port = port if port is not None else free_port()
        self.timeout = timeout
        self._dir = Path(tempfile.mkdtemp(prefix="sbgate-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._args = tuple(args)  # more redis-server options (cluster, TLS, ACL...)
        # A sentinel: its configuration (Sentinel rewrites the file, so it is ours, here).
        self._sentinel = sentinel
        self.mode = "standalone"  # how a client must talk to it (`RedisTarget.mode`)
        self.client_url = self.url  # what a client is given (a cluster: another node's)
        # TLS on a second port (the plain one stays for `command`), with a self-signed
        # certificate for 127.0.0.1 that is its own CA: clients trust it with `ca_file`.
        self.tls_port: int | None = None
        self.ca_file: Path | None = None
        if tls:
            from sblocal.certs import ensure_dev_cert

            cert, key = ensure_dev_cert(self._dir / "tls")
            self.tls_port, self.ca_file = free_port(), cert
            self._args += (
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(cert),
                "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(cert),
                "--tls-auth-clients", "no",
            )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """`rediss://` on the TLS port, as Azure Cache for Redis is reached on 6380."""
        assert self.tls_port is not None, "started without tls=True"
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING."""
        if self.running:
            return self
        first: list[str] = []
        if self._sentinel is not None:
            conf = self._dir / "sentinel.conf"
            if not conf.exists():
                conf.write_text(self._sentinel)
            first = [str(conf), "--sentinel"]
        args = [
            str(REDIS_SERVER),
            *first,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--dbfilename", "dump.rdb",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self._dir / "redis.log"),
            *self._args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self._paused = False
        deadline = time.monotonic() + self.timeout
        while True:
            if self._proc.poll() is not None:
                log = (self._dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited {self._proc.returncode}: {log}")
            if self.command("PING", check=False) == b"+PONG":
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on {self.port} did not answer PING")
            time.sleep(0.01)  # polling a process we just started, with a deadline

    def command(self, *parts: str, check: bool = True) -> bytes | None:
        """Send one command over a fresh socket; the first reply line (RESP), or None if
        the server is unreachable and `check` is False."""
        payload = f"*{len(parts)}\r\n".encode()
        for p in parts:
            b = p.encode()
            payload += b"$%d\r\n%s\r\n" % (len(b), b)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(payload)
                buf = b""
                while b"\r\n" not in buf:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                return buf.split(b"\r\n", 1)[0]
        except OSError:
            if check:
                raise
            return None

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def _wait(self) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(self.timeout)
        self._proc = None
        self._paused = False

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL if it does not go)."""
        if self._paused:
            self.resume()
        self._signal(signal.SIGTERM)
        self._wait()

    def kill(self) -> None:
        """SIGKILL: the server vanishes, its sockets are reset."""
        self._signal(signal.SIGKILL)
        self._wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing is answered."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self._paused = False

    def restart(self, empty: bool = True) -> RedisServer:
        """Stop and start again on the same port. `empty=False` keeps the data (SAVE first,
        then it is loaded back from the dump file)."""
        if empty:
            self.kill()
            with contextlib.suppress(FileNotFoundError):
                (self._dir / "dump.rdb").unlink()
        else:
            if self._paused:
                self.resume()
            self.command("SAVE")
            self.stop()
        return self.start()

    def close(self) -> None:
        """Kill it (if running) and remove its directory."""
        if self._paused:
            self.resume()
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
