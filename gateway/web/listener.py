"""The listen port's site: a `web.TCPSite` that stops listening under overload.

**aiohttp's private names used here** (guarded by tests/security/test_aiohttp_privates.py):
`BaseSite`'s ``_runner`` and `TCPSite`'s ``_server`` (the listening server, closed and
replaced by this site while it pauses), ``_host`` and ``_backlog`` (to reopen on the same
address), all created by their ``__init__`` and ``start``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from aiohttp import web

from gateway.accepting import Acceptor
from gateway.lifetimes import CANCEL_GRACE, Backoff, stop
from gateway.web.overload import (
    LISTEN_BACKLOG,
    PAUSE_REASONS,
    PauseReason,
    Shedder,
)

log = logging.getLogger(__name__)


# After a pause, the closed listening socket may hold its port for a loop turn.
REOPEN_RETRY = 0.01
# A listen that keeps failing is retried after a delay doubling up to this, and logged at
# most this often.
REOPEN_RETRY_MAX = 1.0
REOPEN_LOG_EVERY = 30.0
# The delays between listen attempts: `REOPEN_RETRY`, doubling up to `REOPEN_RETRY_MAX`.
RETRY = Backoff(REOPEN_RETRY, REOPEN_RETRY_MAX)

# How often the accept queue is looked at; over `MAX_ACCEPT_QUEUE` connections waiting
# there, the listener closes for `QUEUE_PAUSE` (gateway.web.overload). A connection the
# loop has no room for waits there at most this long (and the loop's lag) before its reset.
QUEUE_CHECK = 0.025
MAX_ACCEPT_QUEUE = 64
QUEUE_PAUSE = 0.25
_TCP_INFO_LEN = 104
_TCPI_UNACKED = 24  # offset of tcpi_unacked: for a listening socket, its accept queue


class ShedSite(web.TCPSite):
    """`web.TCPSite` that stops listening when this process cannot keep up
    (gateway.web.overload): closing the listening socket makes the kernel refuse new
    connections at once (and reset those still waiting in its accept queue), at no cost to
    the event loop; connections already accepted are untouched. It closes:

    * while the runner's shedder says so (`pause` / `resume`: the connection cap, a
      lagging loop);
    * for `QUEUE_PAUSE` when more than `MAX_ACCEPT_QUEUE` connections wait in the kernel's
      accept queue at two looks in a row, the second no shorter than the first, or at one
      look while the requests have no room (every `QUEUE_CHECK`; Linux only, where
      ``TCP_INFO`` on a listening socket gives its queue): the loop accepts them slower
      than they come (libuv, under uvloop, accepts one a turn of the loop), and each
      would wait there, unseen by any cap, until its client gave up.

    While the requests have room (under half the in-progress limit, the loop not behind), it
    also takes connections from the accept queue itself, a batch each time the listening
    socket is readable (`gateway.accepting.Acceptor`, beside the loop's own one-a-turn
    accept): a busy loop then accepts as fast as connections come. At the in-progress
    limit, or with the loop behind, the queue is left to the loop's one-a-turn accept and
    the accept-queue rule, which refuse at no cost to the process (measured: draining it
    then, at 5x and 10x, took in connections only to refuse their requests, and served
    fewer).

    Listening again opens a new socket on the same address, in a task this site owns;
    `stop` cancels and awaits it, the accepting tasks, and the timers. Each pause is counted
    under the reason that began it (`pauses`, `paused_seconds`: the app's metrics read them)."""

    __slots__ = (
        "_acceptor",
        "_began",
        "_bind_error",
        "_bind_failing_since",
        "_bind_logged_at",
        "_check",
        "_pause_count",
        "_pause_reason",
        "_paused_at",
        "_paused_for",
        "_quiet_until",
        "_reopening",
        "_retry",
        "_runner_loop",
        "_shedder_wants",
        "_stopped",
        "_wake",
        "_was_long",
    )

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, backlog: int = LISTEN_BACKLOG
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_address=True)
        self._reopening: asyncio.Task[None] | None = None
        self._retry: float | None = None  # the last wait between listen attempts
        self._bind_error: OSError | None = None  # the last listen failed (cleared on success)
        self._bind_failing_since = 0.0
        self._bind_logged_at = float("-inf")
        self._shedder_wants = True
        self._quiet_until = 0.0  # loop time: closed until then (a long accept queue)
        self._stopped = False
        self._check: asyncio.TimerHandle | None = None
        self._wake: asyncio.TimerHandle | None = None
        self._was_long = 0  # the accept queue at the last look, when over the bound (else 0)
        self._pause_reason: PauseReason = "connections"  # the shedder's, while it pauses
        self._paused_at: float | None = None  # loop time the current pause began
        self._began: PauseReason = "connections"  # the current pause's reason
        self._runner_loop = asyncio.get_running_loop()
        self._paused_for: dict[PauseReason, float] = dict.fromkeys(PAUSE_REASONS, 0.0)
        self._pause_count: dict[PauseReason, int] = dict.fromkeys(PAUSE_REASONS, 0)
        self._acceptor = Acceptor(f"listener {self.name}", room=self._has_room)

    async def start(self) -> None:
        await super().start()
        self._take_accepts()
        shedder = getattr(self._runner, "shedder", None)
        if isinstance(shedder, Shedder):
            shedder.attach(self)
        metrics = getattr(self._runner, "metrics", None)
        if metrics is not None:
            metrics.watch_listener(self)
        if hasattr(socket, "TCP_INFO"):  # Linux: the accept queue can be read
            self._check = asyncio.get_running_loop().call_later(QUEUE_CHECK, self._look)

    @property
    def listening(self) -> bool:
        return self._server is not None

    def pauses(self, reason: PauseReason) -> int:
        return self._pause_count[reason]

    def paused_seconds(self, reason: PauseReason) -> float:
        seconds = self._paused_for[reason]
        if self._paused_at is not None and self._began == reason:
            # Read from /metrics' worker thread too: the loop's clock, not the running loop.
            seconds += self._runner_loop.time() - self._paused_at
        return seconds

    def pause(self, reason: PauseReason = "connections") -> None:
        self._shedder_wants = False
        self._pause_reason = reason
        self._steer()

    def resume(self) -> None:
        self._shedder_wants = True
        self._steer()

    def accept_queue(self) -> int:
        """Connections the kernel completed that this process has not accepted yet."""
        sockets = getattr(self._server, "sockets", None) or ()
        total = 0
        for sock in sockets:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            total += int.from_bytes(info[_TCPI_UNACKED : _TCPI_UNACKED + 4], sys.byteorder)
        return total

    def _why(self) -> PauseReason:
        if asyncio.get_running_loop().time() < self._quiet_until:
            return "accept_queue"
        return self._pause_reason

    def _pause_ended(self) -> None:
        if self._paused_at is not None:
            elapsed = asyncio.get_running_loop().time() - self._paused_at
            self._paused_for[self._began] += elapsed
            self._paused_at = None

    def _wanted(self) -> bool:
        return (
            not self._stopped
            and self._shedder_wants
            and asyncio.get_running_loop().time() >= self._quiet_until
        )

    def _look(self) -> None:
        loop = asyncio.get_running_loop()
        self._check = loop.call_later(QUEUE_CHECK, self._look)
        try:
            queue = self.accept_queue() if self._server is not None else 0
        except OSError:  # a socket closed under us: look again next time
            queue = 0
        # Over the bound at two looks in a row, and no shorter at the second: a burst of
        # connects the loop is still accepting (a client opening its pool, a load
        # generator opening thousands at once) drains between looks, and is not a backlog.
        # Over the bound while the requests have no room, one look is enough: the batch
        # accept has stopped and the loop's own takes one a turn, so the queue is not being
        # drained and its connections would only wait for the second look to be reset then
        # (their requests already sent: refused at once is the point).
        before, self._was_long = self._was_long, queue if queue > MAX_ACCEPT_QUEUE else 0
        if (before and queue >= before) or (queue > MAX_ACCEPT_QUEUE and not self._has_room()):
            self._quiet_until = loop.time() + QUEUE_PAUSE
            if self._wake is not None:
                self._wake.cancel()
            self._wake = loop.call_at(self._quiet_until, self._steer)
            self._steer()

    def _steer(self) -> None:
        if not self._wanted():
            if self._server is not None:
                self._leave_accepts()
                self._server.close()
                self._server = None
                if not self._stopped and self._paused_at is None:
                    self._paused_at = asyncio.get_running_loop().time()
                    self._began = self._why()
                    self._pause_count[self._began] += 1
        elif self._server is None and self._reopening is None:
            self._reopening = asyncio.get_running_loop().create_task(
                self._reopen(), name=f"listen {self.name}"
            )

    async def _reopen(self) -> None:
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        try:
            while self._wanted() and self._server is None:
                try:
                    listening = await loop.create_server(
                        server, self._host, self.port, backlog=self._backlog, reuse_address=True
                    )
                except OSError as exc:
                    self._bind_failed(exc)
                    self._retry = RETRY.next(self._retry)
                    await asyncio.sleep(self._retry)
                    continue
                if self._wanted():
                    self._server = listening
                    self._take_accepts()
                    self._pause_ended()
                    self._bound_again()
                else:  # paused again meanwhile
                    listening.close()
        finally:
            self._reopening = None

    def _take_accepts(self) -> None:
        server = self._runner.server
        if server is not None:
            self._acceptor.watch(getattr(self._server, "sockets", None) or (), server)

    def _leave_accepts(self) -> None:
        self._acceptor.unwatch()

    def _has_room(self) -> bool:
        shedder = getattr(self._runner, "shedder", None)
        return not isinstance(shedder, Shedder) or shedder.has_room()

    def not_listening_reason(self) -> str | None:
        """A readiness check: why this site cannot listen again when it wants to (another
        process took the port while it was paused, say), or None."""
        if self._bind_error is None:
            return None
        return f"cannot listen on {self.name}: {self._bind_error}"

    def _bind_failed(self, exc: OSError) -> None:
        """Logged at the first failure, then at most every `REOPEN_LOG_EVERY` seconds; the
        readiness check reports it until a listen succeeds."""
        now = asyncio.get_running_loop().time()
        if self._bind_error is None:
            self._bind_failing_since = now
        self._bind_error = exc
        if now >= self._bind_logged_at + REOPEN_LOG_EVERY:
            self._bind_logged_at = now
            log.warning(
                "cannot listen again on %s (for %.0f s): %s; retrying, not ready meanwhile",
                self.name,
                now - self._bind_failing_since,
                exc,
            )

    def _bound_again(self) -> None:
        self._retry = None
        if self._bind_error is not None:
            failed_for = asyncio.get_running_loop().time() - self._bind_failing_since
            log.warning("listening again on %s after %.1f s", self.name, failed_for)
            self._bind_error = None
            self._bind_logged_at = float("-inf")

    async def stop(self) -> None:
        self._stopped = True
        self._pause_ended()
        for timer in (self._check, self._wake):
            if timer is not None:
                timer.cancel()
        task = self._reopening
        if task is not None:
            await stop([task], CANCEL_GRACE, "listener")
        await self._acceptor.stop(CANCEL_GRACE)
        await super().stop()
