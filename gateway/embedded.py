"""The embedded default: with no namespace configured, `gateway serve` starts the local
broker pair (`python -m sblocal`) as a child process and points itself at it.

This module and the tests are the only places that know about `sblocal`; it talks to the
broker only through its CLI's one-line JSON contract, never by importing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import Any

import orjson

from gateway.config import (
    EntitySettings,
    NamespaceSettings,
    PairSettings,
    Secret,
    Settings,
)

log = logging.getLogger(__name__)

# What the embedded broker declares in `primary` (sblocal's default configuration).
DEFAULT_ENTITIES = (
    EntitySettings(path="orders", kind="queue"),
    EntitySettings(path="events", kind="topic"),
)


class EmbeddedBroker:
    """A `python -m sblocal --json` child process. Owned: `stop()` terminates and awaits it."""

    def __init__(self, proc: asyncio.subprocess.Process, info: dict[str, Any]) -> None:
        self._proc = proc
        self.info = info

    @classmethod
    async def start(
        cls, start_within: float = 30.0, extra_args: tuple[str, ...] = ()
    ) -> EmbeddedBroker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sblocal",
            "--json",
            *extra_args,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(start_within):
                line = await proc.stdout.readline()
            info = orjson.loads(line)
        except (TimeoutError, orjson.JSONDecodeError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(f"the local broker did not start: {exc!r}") from None
        return cls(proc, info)

    def namespace(self, name: str) -> NamespaceSettings:
        ns = self.info["namespaces"][name]
        admin = ns.get("management_connection_string")
        return NamespaceSettings(
            name=name,
            connection_string=Secret(ns["connection_string"]),
            admin_connection_string=Secret(admin) if admin else None,
            admin_ca_cert=self.info.get("ca_cert"),
        )

    def apply(self, settings: Settings) -> Settings:
        """`settings` with the broker's `primary`/`secondary` pair and its demo entities."""
        pair = PairSettings(
            name="default",
            primary=self.namespace("primary"),
            secondary=self.namespace("secondary"),
        )
        return replace(settings, pairs=(pair,), entities=settings.entities or DEFAULT_ENTITIES)

    async def stop(self) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await self._proc.wait()
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        if self._proc.stdout is not None:
            with contextlib.suppress(Exception):
                await self._proc.stdout.read()
