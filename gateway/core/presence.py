"""Whether every configured entity exists at its primary namespace, said loudly when not.

A configured entity the primary lacks (a typo in `SBGATE_ENTITIES`, a queue not created yet,
or deleted) is answered like any entity whose sends fail: with failover, its messages are
parked in the backlog (`202`) and come home once it exists — nothing is refused, nothing
lost. That must never be silent: `EntityPresence` checks the primary's entities at start-up
(a listing through the management API), logs one WARNING line per missing entity naming it
and what to do, sets `sbgate_entity_missing` (the chart alerts on it), and `GET
/admin/entities` shows the reason. It checks again every `RECHECK_INTERVAL` while an entity
is missing or the check could not run (the line and the gauge clear once it exists), and
every `CHECK_INTERVAL` otherwise (an entity deleted meanwhile, a namespace that came back),
and at once when a send finds an entity missing (`recheck`, at most every `interval`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from gateway.core.entities import EntityRef
from gateway.lifetimes import stop

log = logging.getLogger(__name__)

RECHECK_INTERVAL = 30.0
CHECK_INTERVAL = 300.0
STOP_TIMEOUT = 1.0


class CheckUnavailable(Exception):
    """The entities could not be listed (no Manage right, the endpoint unreachable): why."""

    def __init__(self, reason: str, *, retry: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry  # worth trying again (unreachable), or not (no right to list)


# Given the entities to look for, the missing ones (by path as configured) with why and what
# to do; raises `CheckUnavailable`.
Check = Callable[[Sequence[EntityRef]], Awaitable[Mapping[str, str]]]


class PresenceObserver(Protocol):
    def entity_missing(self, entity: str, missing: bool) -> None: ...


class EntityPresence:
    """The check and its loop (one owned task: `start`, `close`)."""

    def __init__(
        self,
        entities: Sequence[EntityRef],
        check: Check,
        observer: PresenceObserver | None = None,
        interval: float | None = None,
        quiet_interval: float | None = None,
    ) -> None:
        self._entities = list(entities)
        self._check = check
        self._observer = observer
        self._interval = RECHECK_INTERVAL if interval is None else interval
        self._quiet_interval = CHECK_INTERVAL if quiet_interval is None else quiet_interval
        self.missing: dict[str, str] = {}  # entity key (lower case) -> reason
        self.unchecked: str | None = None  # why the last check could not run
        self.checks = 0  # checks that ran to an answer (tests wait on it)
        self._retry = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def reason(self, entity: str) -> str | None:
        """Why `entity` is missing at its primary, or None (present, or not known)."""
        return self.missing.get(entity.lower())

    def start(self) -> None:
        for e in self._entities:
            if self._observer is not None:
                self._observer.entity_missing(e.path, False)
        self._task = asyncio.create_task(self._run(), name="entity presence check")

    def recheck(self) -> None:
        """A send found an entity missing: look now, not at the next interval (sync: the
        failover router calls it; a burst of failures makes one check)."""
        self._wake.set()

    async def close(self) -> None:
        """Cancel and await the loop: within `STOP_TIMEOUT + CANCEL_GRACE`."""
        if self._task is not None:
            await stop([self._task], STOP_TIMEOUT, "entity presence")
            self._task = None

    async def check_once(self) -> None:
        """One check; logs what changed. Never raises but on cancellation."""
        try:
            found = await self._check(self._entities)
        except CheckUnavailable as exc:
            if exc.reason != self.unchecked:
                level = logging.WARNING if exc.retry else logging.INFO
                log.log(level, "cannot check that the configured entities exist: %s", exc.reason)
            self.unchecked, self._retry = exc.reason, exc.retry
            return
        if self.unchecked is not None:
            log.info("the configured entities can be checked again")
        self.unchecked, self._retry = None, True
        self.checks += 1
        now = {path.lower(): (path, why) for path, why in found.items()}
        for key, (path, why) in now.items():
            if key not in self.missing:
                log.warning("entity %s: %s", path, why, extra={"entity": path, "missing": True})
                if self._observer is not None:
                    self._observer.entity_missing(path, True)
        for e in self._entities:
            key = e.path.lower()
            if key in self.missing and key not in now:
                log.info("entity %s now exists at the primary", e.path, extra={"entity": e.path})
                if self._observer is not None:
                    self._observer.entity_missing(e.path, False)
        self.missing = {key: why for key, (_, why) in now.items()}

    async def _run(self) -> None:
        """Check at once; then every `interval` while something is missing or unknown (and
        worth retrying), else every `quiet_interval` or, sooner, when `recheck` asks — never
        more than once per `interval`, however many sends fail; never again when the
        credentials may not list the entities."""
        while True:
            self._wake.clear()  # a failure seen from now on asks for the next check
            await self.check_once()
            if self.unchecked is not None and not self._retry:
                return
            await asyncio.sleep(self._interval)
            if self.missing or self.unchecked is not None:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(self._quiet_interval - self._interval, 0.0)):
                    await self._wake.wait()
