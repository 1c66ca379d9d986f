"""Helpers for tests that need a broker: a real broker process and a control API client.

    with BrokerProcess() as broker:              # or: async with BrokerProcess() as broker
        conn_str = broker.connection_string("primary")
        fault_id = await broker.control.add_fault("primary", "com.microsoft:server-busy", count=1)

`LocalBroker` (in-process, `sblocal.server`) is faster to start; `BrokerProcess` is the real
CLI in a subprocess, for tests that kill or restart the broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

import aiohttp

_T = TypeVar("_T")


class ControlError(Exception):
    """The control API answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"control API error {status}: {body}")
        self.status = status
        self.body = body


class ControlClient:
    """Async client of the control API; every call has a deadline (``timeout`` seconds).

    Each call uses its own short-lived HTTP session, so one client can be shared by tests
    that run on different event loops; there is nothing to close.
    """

    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        async with asyncio.timeout(self.timeout), aiohttp.ClientSession() as session:
            async with session.request(method, self.base_url + path, json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise ControlError(resp.status, text)
                return json.loads(text) if text else None

    async def namespaces(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/namespaces")
        return result

    async def add_fault(
        self,
        ns: str,
        condition: str,
        *,
        operation: str = "any",
        entity: str | None = None,
        count: int | None = None,
        mode: str = "reject",
        description: str | None = None,
    ) -> int:
        """Add a fault rule; returns its id."""
        body: dict[str, Any] = {
            "condition": condition,
            "operation": operation,
            "entity": entity,
            "count": count,
            "mode": mode,
        }
        if description is not None:
            body["description"] = description
        result = await self.request("POST", f"/namespaces/{ns}/faults", body)
        return int(result["id"])

    async def faults(self, ns: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self.request("GET", f"/namespaces/{ns}/faults")
        return result

    async def clear_faults(self, ns: str) -> None:
        await self.request("DELETE", f"/namespaces/{ns}/faults")

    async def remove_fault(self, ns: str, fault_id: int) -> None:
        await self.request("DELETE", f"/namespaces/{ns}/faults/{fault_id}")

    async def set_latency(self, ns: str, round_trip_ms: float = 0, store_ms: float = 0) -> None:
        body = {"round_trip_ms": round_trip_ms, "store_ms": store_ms}
        await self.request("PUT", f"/namespaces/{ns}/latency", body)

    async def drop_connections(self, ns: str) -> int:
        result = await self.request("POST", f"/namespaces/{ns}/drop-connections")
        return int(result["dropped"])

    async def down(self, ns: str) -> None:
        await self.request("POST", f"/namespaces/{ns}/down")

    async def up(self, ns: str) -> None:
        await self.request("POST", f"/namespaces/{ns}/up")

    async def entities(self, ns: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self.request("GET", f"/namespaces/{ns}/entities")
        return result

    async def entity(self, ns: str, path: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/namespaces/{ns}/entities/{path}")
        return result

    async def messages(self, ns: str, path: str, limit: int = 100) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self.request(
            "GET", f"/namespaces/{ns}/entities/{path}/messages?limit={limit}"
        )
        return result

    async def create_entity(
        self, ns: str, path: str, kind: str = "queue", properties: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = {"path": path, "kind": kind, "properties": properties or {}}
        result: dict[str, Any] = await self.request("POST", f"/namespaces/{ns}/entities", body)
        return result

    async def counters(self, ns: str) -> dict[str, int]:
        result: dict[str, int] = await self.request("GET", f"/namespaces/{ns}/counters")
        return result

    async def connections(self, ns: str) -> dict[str, int]:
        """What clients hold open now: ``connections``, ``sessions``, ``links`` (every
        kind), ``send_links``."""
        result: dict[str, int] = await self.request("GET", f"/namespaces/{ns}/connections")
        return result

    async def reset(self, ns: str | None = None) -> None:
        """Clear messages, faults, latency and counters (one namespace or all)."""
        await self.request("POST", f"/namespaces/{ns}/reset" if ns else "/reset")


async def eventually(
    check: Callable[[], Awaitable[_T]],
    *,
    timeout: float = 5.0,  # noqa: ASYNC109 - a polling helper: the deadline is its job
    interval: float = 0.02,
    message: str = "condition not met",
) -> _T:
    """Poll ``check()`` until it returns a truthy value (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{message} within {timeout} s (last: {result!r})")
        await asyncio.sleep(interval)


class BrokerProcess:
    """``python -m sblocal --json`` in a subprocess.

    Sync: ``with BrokerProcess() as b`` or ``start()``/``stop()``. Async: ``async with`` or
    ``await astart()``/``await astop()`` (the blocking parts run in a worker thread).
    ``start`` waits for the JSON line up to ``startup_timeout`` seconds, then raises
    RuntimeError with the process's stderr.
    """

    def __init__(
        self,
        *,
        config: str | Path | None = None,
        host: str = "127.0.0.1",
        data_dir: str | Path | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self._args = [python, "-m", "sblocal", "--json", "--host", host]
        if config is not None:
            self._args += ["--config", str(config)]
        if data_dir is not None:
            self._args += ["--data-dir", str(data_dir)]
        self._args += list(extra_args)
        self._startup_timeout = startup_timeout
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self.info: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> BrokerProcess:
        if self._proc is not None:
            raise RuntimeError("already started")
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ if self._env is None else self._env)
        # Make `-m sblocal` importable from this checkout even without an install.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            self._args, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        try:
            line = self._read_line(self._startup_timeout)
            self.info = json.loads(line)
        except BaseException:
            self.kill()
            raise
        return self

    def _read_line(self, timeout: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(
                        f"sblocal did not start within {timeout} s: {self.stderr_text()}"
                    )
                if not sel.select(remaining):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._proc.wait(5)
                    raise RuntimeError(
                        f"sblocal exited with {self._proc.returncode}: {self.stderr_text()}"
                    )
                buf += chunk
        return buf.split(b"\n", 1)[0].decode()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` (then SIGKILL); returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._close()
        return proc.returncode

    def terminate(self) -> None:
        """Send SIGTERM without waiting."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is flushed) and reap the process."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        self._close()

    def _close(self) -> None:
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None

    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    async def astart(self) -> BrokerProcess:
        return await asyncio.to_thread(self.start)

    async def astop(self, timeout: float = 10.0) -> int | None:  # noqa: ASYNC109
        return await asyncio.to_thread(self.stop, timeout)

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> BrokerProcess:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    # -- accessors -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def connection_string(self, ns: str) -> str:
        return str(self.info["namespaces"][ns]["connection_string"])

    def management_connection_string(self, ns: str) -> str | None:
        value = self.info["namespaces"][ns]["management_connection_string"]
        return str(value) if value is not None else None

    def amqp_port(self, ns: str) -> int:
        return int(self.info["namespaces"][ns]["amqp_port"])

    @property
    def ca_cert(self) -> str | None:
        value = self.info.get("ca_cert")
        return str(value) if value is not None else None

    @property
    def control_url(self) -> str:
        return str(self.info["control"])

    @property
    def control(self) -> ControlClient:
        return ControlClient(self.control_url)
