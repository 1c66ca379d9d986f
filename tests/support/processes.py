"""A real `gateway serve` process on a free port, for tests of what only a process shows
(signals, its own output)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import aiohttp

from sblocal.testing import BrokerProcess
from tests.support.waiting import eventually


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_gateway(
    broker: BrokerProcess, port: int, **settings: str
) -> asyncio.subprocess.Process:
    """`python -m gateway serve` on 127.0.0.1:`port` against `broker`, with `settings` as
    SBGATE_* variables; its stderr (the logs) is piped, its stdout discarded."""
    from tests.conftest import broker_env  # the one mapping of a broker to settings

    env = {**os.environ, **broker_env(broker, SBGATE_LISTEN_PORT=str(port), **settings)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "serve",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def wait_ready(http: aiohttp.ClientSession, base: str, within: float = 30) -> None:
    """Until the gateway at `base` answers `/readyz` with 200 (fails after `within` s)."""

    async def ready() -> bool:
        try:
            async with http.get(f"{base}/readyz") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(ready, within=within, every=0.1)
