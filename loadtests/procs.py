"""Process control for the stack: start, signal (SIGKILL, SIGTERM, SIGSTOP/SIGCONT), wait,
and measure the processes the harness owns. Only processes started here are ever signalled,
always by their own pid."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import aiohttp

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


class ManagedProcess:
    """One child process, its output in ``<log_dir>/<name>.log``. Blocking-free helpers for
    asyncio callers (waits poll with deadlines)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_dir: Path,
        cwd: Path = ROOT,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.env = dict(env) if env is not None else dict(os.environ)
        self.log_path = log_dir / f"{name}.log"
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0

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
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"--- start {time.strftime('%H:%M:%S')} {self.args}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.args,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1

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
        """Wait for exit up to `within` s; returns the exit code, None if still running."""
        deadline = time.monotonic() + within
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        code = self.returncode
        self._reap_log()
        return code

    async def stop(self, within: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
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

    def _reap_log(self) -> None:
        if self._log is not None and not self._log.closed:
            self._log.close()

    def rss_bytes(self) -> int | None:
        """Resident memory (VmRSS), None if not running."""
        if not self.running or self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class GatewayProcess(ManagedProcess):
    """``python -m gateway serve`` (or ``syphon``) with SBGATE_* settings."""

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        *,
        port: int | None,
        log_dir: Path,
        command: str = "serve",
    ) -> None:
        # Inherited SBGATE_* variables (a developer's shell, the test helpers') would change
        # the gateway's configuration — or fail it: unknown settings are refused.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SBGATE_")}
        full_env.update(env)
        full_env["PYTHONPATH"] = str(ROOT) + (
            os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else ""
        )
        super().__init__(
            name, [sys.executable, "-m", "gateway", command], env=full_env, log_dir=log_dir
        )
        self.port = port
        self.command = command

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, within: float = 60.0) -> None:
        """Spawn and wait until GET /readyz answers 200 (serve) or the process is up."""
        self.spawn()
        if self.port is None:
            return
        await self.wait_ready(within)

    async def wait_ready(self, within: float) -> None:
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
                await asyncio.sleep(0.1)
