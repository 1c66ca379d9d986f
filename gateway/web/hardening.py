"""Deadlines and caps for slow or greedy HTTP clients, enforced in the connection protocol.

aiohttp 3.14 closes a connection that stays idle for ``keepalive_timeout`` (since 3.14 also
one that never sends a request), caps the size of each header field (``max_field_size``) and
the number of headers (``max_headers``). It has no deadline of its own for a request head
that trickles in byte by byte, nor for a body that never finishes, and nothing caps the size
of all the headers together (count x field size: megabytes per connection). This module adds
those three, in a `RequestHandler` subclass built by `HardenedAppRunner`:

* **Head deadline** (``http.header_timeout``): the complete request head must arrive within
  the deadline, counted from the connection's opening or from the first byte of the next
  request on a kept-alive connection. Otherwise the connection is closed without an answer,
  as nginx's ``client_header_timeout`` and Go's ``ReadHeaderTimeout`` do: the client has not
  yet said anything that could be answered.
* **Body deadline** (``http.body_timeout``): the whole body must arrive within the deadline
  after the head. A handler waiting for it gets `BodyTimeout` (408, JSON, through the usual
  error path); the connection is then closed, since the rest of the body is not worth reading.
* **Head size** (``limits.max_header_bytes``): a request head larger than that is answered
  431 and the connection closed: one still incomplete after that many bytes (counted per
  socket read), and a complete one (request line and header fields, measured as sent)
  before its handler runs. One header line over the limit is aiohttp's own ``max_field_size``
  and gets the same 431.

In open mode (no authorization rules, listening on loopback), `host_check` (run by the edge
middleware) also
answers 421 to a request whose ``Host`` is neither a loopback name nor one of
``public_hosts``: a web page the operator opens could otherwise reach the gateway (its admin
API included) through a name its own DNS points at 127.0.0.1 (DNS rebinding).

Idle keep-alive connections are closed after ``http.keepalive_timeout`` (aiohttp's own
timer, also covering the rare pipelined head that started while a request was in progress).
Requests aiohttp cannot parse are answered with the gateway's JSON error body and an
``X-Request-Id``, with a message chosen by the kind of error, never one that repeats what the
client sent (aiohttp's own messages quote up to 100 bytes of the offending line: a header
value, a signature), and logged at DEBUG, not at ERROR with a traceback (a log flood anyone
on the internet could cause).

The subclass uses a few of `RequestHandler`'s private attributes (``_messages``,
``_request_count``, ``_waiter``, ``_request_in_progress``, ``_lingering_time``), which can
change in any minor release: pyproject.toml therefore bounds aiohttp to the minor release they
are tested on (``>=3.14,<3.15``); widen it only after tests/security/test_slow_clients.py, which
exercises every path over real sockets, passes on the new minor release.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import http_exceptions as hx
from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest

from gateway.auth import AuthConfigError
from gateway.auth.sas import parse_host_entry
from gateway.config import Settings
from gateway.errors import RequestError
from gateway.web.overload import (
    LISTEN_BACKLOG,
    MAX_LOOP_LAG,
    PAUSE_REASONS,
    OverloadLimits,
    PauseReason,
    Shedder,
    ShedReason,
    exempt,
    overloaded_body,
)

if TYPE_CHECKING:
    from gateway.metrics import Metrics

log = logging.getLogger(__name__)


class BodyTimeout(RequestError):
    """The request body did not arrive within ``http.body_timeout`` of the request head."""

    status = 408
    code = "request_timeout"


@dataclass(frozen=True, slots=True)
class Deadlines:
    """What each connection enforces (see the module docstring)."""

    header_timeout: float
    body_timeout: float
    max_head_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Deadlines:
        return cls(
            header_timeout=settings.http.header_timeout,
            body_timeout=settings.http.body_timeout,
            max_head_bytes=settings.limits.max_header_bytes,
        )


class MisdirectedRequest(RequestError):
    """Open mode: the request's ``Host`` is neither a loopback name nor a public host (421)."""

    status = 421
    code = "misdirected_request"


def is_loopback(host: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761), or a loopback IP literal."""
    host = host.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HOST_VERDICTS = 256  # Host values whose verdict the open mode's check remembers


def host_check(public_hosts: Iterable[str]) -> Callable[[web.Request], None]:
    """The open mode's ``Host`` check (see the module docstring), run by the edge middleware
    (gateway.web.handlers), which turns its 421 into the JSON answer: one middleware fewer
    a request. A request without ``Host`` (HTTP/1.0; no browser sends one) passes. Raises
    `AuthConfigError` for a bad *public_hosts* entry."""
    hosts = frozenset(parse_host_entry(entry) for entry in public_hosts)
    # The verdict per Host value: a client sends the same one on every request, and parsing
    # it (an IP literal through `ipaddress`) cost more than the rest of the check. Bounded:
    # the header is the client's, so the cache starts over when full.
    verdicts: dict[str, bool] = {}

    def allowed(header: str) -> bool:
        try:
            host, port = parse_host_entry(header)
        except AuthConfigError:
            host, port = "", None
        ok = is_loopback(host) or (host, None) in hosts or (host, port) in hosts
        if len(verdicts) >= _HOST_VERDICTS:
            verdicts.clear()
        verdicts[header] = ok
        return ok

    def check(request: web.Request) -> None:
        header = request.headers.get("Host")
        if header is not None:
            ok = verdicts.get(header)
            if not (ok if ok is not None else allowed(header)):
                raise MisdirectedRequest(
                    "without authorization rules the gateway answers only requests for "
                    "a loopback name or one of public_hosts (the Host header)"
                )

    return check


# The request line (method, target, version) may be at most this long; the entity path is at
# most 260 characters, so this leaves room for any query a client adds.
MAX_REQUEST_LINE = 8190


def handler_kwargs(settings: Settings) -> dict[str, Any]:
    """aiohttp's own per-connection limits, as `RequestHandler` keyword arguments."""
    return {
        "keepalive_timeout": settings.http.keepalive_timeout,
        "max_headers": settings.http.max_headers,
        "max_field_size": settings.limits.max_header_bytes,
        "max_line_size": MAX_REQUEST_LINE,
    }


class HeadTooLarge(hx.BadHttpMessage):
    """The request head is larger than ``limits.max_header_bytes`` (431)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request head is larger than {limit} bytes")


def head_size(message: RawRequestMessage) -> int:
    """The size of a parsed request head as sent: request line, fields, the blank line."""
    line = len(message.method) + len(message.path) + 12  # spaces, "HTTP/1.1", CRLF
    fields = sum(len(name) + len(value) + 4 for name, value in message.raw_headers)
    return line + fields + 2


def parse_error_answer(exc: BaseException | None, max_line: int) -> tuple[int, str, str]:
    """(status, error code, message) for a request aiohttp could not parse.

    The message is chosen by the kind of error and never quotes the request."""
    if isinstance(exc, HeadTooLarge):
        return 431, "request_header_fields_too_large", exc.message
    if isinstance(exc, hx.LineTooLong):
        if exc.args[1:2] == (max_line,):
            return 414, "uri_too_long", f"the request line is longer than {max_line} bytes"
        return (
            431,
            "request_header_fields_too_large",
            (f"a header field is longer than {exc.args[1]} bytes"),
        )
    if isinstance(exc, hx.BadHttpMessage) and exc.message.startswith("Too many headers"):
        return 431, "request_header_fields_too_large", "too many header fields"
    for kind, text in _PARSE_ERRORS:
        if isinstance(exc, kind):
            return 400, "bad_request", text
    return 400, "bad_request", "the request is not valid HTTP/1.1"


# Most specific first (BadHttpMethod is a BadStatusLine, every one a BadHttpMessage).
_PARSE_ERRORS: tuple[tuple[type[BaseException], str], ...] = (
    (hx.ContentLengthError, "invalid or repeated Content-Length"),
    (hx.TransferEncodingError, "invalid chunked Transfer-Encoding"),
    (hx.PayloadEncodingError, "invalid body encoding"),
    (hx.InvalidHeader, "invalid header field"),
    (hx.BadHttpMethod, "invalid request method"),
    (hx.BadStatusLine, "invalid request line"),
    (hx.InvalidURLError, "invalid request target"),
)


class HardenedRequestHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol with a head deadline, a body deadline and a head-size cap."""

    __slots__ = (
        "_counted",
        "_deadlines",
        "_head_bytes",
        "_head_deadline",
        "_head_timer",
        "_heads",
        "_open_bodies",
        "_shedder",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        deadlines: Deadlines,
        shedder: Shedder | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._deadlines = deadlines
        self._shedder = shedder
        self._counted = False  # this connection is counted in the shedder's connections
        # When each complete head not yet handled was parsed (loop time), oldest first.
        self._heads: deque[float] = deque()
        # When the head now arriving must be complete (loop time), None between heads. One
        # timer per connection checks it: it is not re-armed per request (a kept-alive
        # connection arms it about once per header_timeout), only moved on when it fires.
        self._head_deadline: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        # Bodies still arriving, each with the timer that ends its wait.
        self._open_bodies: dict[StreamReader, asyncio.TimerHandle] = {}

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        shedder = self._shedder
        if shedder is not None:
            self._counted = shedder.connection_opened()
            if not self._counted:
                # Over the connection cap: the cheapest refusal that still tells the client.
                if isinstance(transport, asyncio.WriteTransport):
                    transport.write(shedder.raw_503())
                self.force_close()
                return
        self._head_started()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted and self._shedder is not None:
            self._shedder.connection_closed()
            self._counted = False
        self._heads.clear()
        self._head_deadline = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        for timer in self._open_bodies.values():
            timer.cancel()
        self._open_bodies.clear()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or self._upgraded:
            super().data_received(data)
            return
        # While a body is arriving, the bytes are body bytes; otherwise they start or
        # continue a request head.
        in_head = not self._open_bodies
        if data and in_head and self._head_deadline is None:
            self._head_started()
        before = self._request_count
        super().data_received(data)
        completed = self._request_count - before
        if completed:
            self._heads.extend([self._loop.time()] * completed)
            self._head_deadline = None
            self._head_bytes = 0
            # The new requests are the last ones queued; start() runs only after we return,
            # so an oversized head is replaced by its 431 before any handler sees it.
            limit = self._deadlines.max_head_bytes
            queued = len(self._messages)
            for i in range(max(0, queued - completed), queued):
                message, payload = self._messages[i]
                if isinstance(message, RawRequestMessage) and head_size(message) > limit:
                    err = HeadTooLarge(limit)
                    self._messages[i] = (_ErrInfo(431, err, err.message), EMPTY_PAYLOAD)
                elif not payload.is_eof():
                    self._watch_body(payload)
        elif in_head and data:
            self._head_bytes += len(data)
            if self._head_bytes > self._deadlines.max_head_bytes:
                self._refuse_large_head()

    # -- shedding overload (gateway.web.overload) -----------------------------------------

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        head_done = self._heads.popleft() if self._heads else None
        shedder = self._shedder
        if (
            shedder is None
            or head_done is None
            or request_handler is not self._request_handler  # aiohttp answering a bad request
            or exempt(request.path)
        ):
            return await super()._handle_request(request, start_time, request_handler)
        reason = shedder.admit(self._loop.time() - head_done)
        if reason is not None:
            self._lingering_time = 0.0  # the body is not read: close right after the answer
            return await super()._handle_request(request, start_time, _shed(reason, shedder))
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            shedder.done()

    # -- errors aiohttp answers itself --------------------------------------------------

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Requests aiohttp could not parse (400, 414, 431) and unhandled handler errors (500),
        as JSON with an ``X-Request-Id`` (the head was not parsed: always a new one).

        aiohttp logs each one at ERROR with a traceback and answers plain text; a malformed
        request is the client's problem, and the internet sends plenty: DEBUG for 4xx."""
        if status < 500:
            status, code, text = parse_error_answer(exc, MAX_REQUEST_LINE)
            log.debug("malformed request from %s: %s", request.remote, code)
            body = {"error": code, "message": text}
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            code = {504: "handler_timeout"}.get(status, "internal_error")
            body = {"error": code, "message": "the gateway could not answer this request"}
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; cannot answer with an error")
        resp = web.Response(
            status=status,
            body=orjson.dumps(body),
            content_type="application/json",
            headers={"X-Request-Id": os.urandom(16).hex()},
        )
        resp.force_close()
        return resp

    # -- the head ------------------------------------------------------------------------

    def _head_started(self) -> None:
        self._head_deadline = deadline = self._loop.time() + self._deadlines.header_timeout
        if self._head_timer is None:
            self._head_timer = self._loop.call_at(deadline, self._head_timer_fired)

    def _waiting_for_head(self) -> bool:
        """start() is idle, waiting for the next complete request head."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _head_timer_fired(self) -> None:
        self._head_timer = None
        deadline = self._head_deadline
        if deadline is None:
            return  # between heads: the next head re-arms it
        if self._loop.time() < deadline:
            # Armed for an earlier head: move it on to the current one's deadline.
            self._head_timer = self._loop.call_at(deadline, self._head_timer_fired)
            return
        self._head_deadline = None
        # A request in progress is never cut short here; a pipelined head that started
        # during it is left to the keep-alive timer, which runs once the response is out.
        if self._waiting_for_head():
            log.debug(
                "closing connection from %s: no complete request head within %.1f s",
                self.peername,
                self._deadlines.header_timeout,
            )
            self.force_close()

    def _refuse_large_head(self) -> None:
        limit = self._deadlines.max_head_bytes
        log.debug("closing connection from %s: request head over %d bytes", self.peername, limit)
        transport = self.transport
        if transport is not None and self._waiting_for_head():
            body = orjson.dumps(
                {
                    "error": "request_header_fields_too_large",
                    "message": f"the request head is larger than {limit} bytes",
                }
            )
            transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n"
                b"X-Request-Id: %s\r\n"
                b"Connection: close\r\n\r\n%s" % (len(body), os.urandom(16).hex().encode(), body)
            )
        self.force_close()

    # -- the body ------------------------------------------------------------------------

    def _watch_body(self, payload: StreamReader) -> None:
        timer = self._loop.call_later(self._deadlines.body_timeout, self._body_expired, payload)
        self._open_bodies[payload] = timer
        payload.on_eof(lambda: self._body_complete(payload))

    def _body_complete(self, payload: StreamReader) -> None:
        timer = self._open_bodies.pop(payload, None)
        if timer is not None:
            timer.cancel()

    def _body_expired(self, payload: StreamReader) -> None:
        self._open_bodies.pop(payload, None)
        if payload.is_eof():
            return
        if self._request_in_progress:
            # Wake the handler waiting for the body with a 408; then aiohttp must not linger
            # reading the rest of it (it would log the error as unhandled): close instead.
            self._lingering_time = 0.0
            payload.set_exception(
                BodyTimeout(
                    "the request body did not arrive within "
                    f"{self._deadlines.body_timeout:g} seconds"
                )
            )
        else:
            # The handler answered without reading the body, and aiohttp is discarding it.
            self.force_close()


def _shed(
    reason: ShedReason, shedder: Shedder
) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """The handler that answers a shed request: 503 before its body is read or its token
    checked, closing the connection (its body is not worth reading)."""

    async def answer(request: BaseRequest) -> web.StreamResponse:
        resp = web.Response(
            status=503,
            body=overloaded_body(reason),
            content_type="application/json",
            headers={"Retry-After": shedder.retry_after, "X-Request-Id": os.urandom(16).hex()},
        )
        resp.force_close()
        return resp

    return answer


class _HardenedServer(web.Server):
    """aiohttp's low-level server, building `HardenedRequestHandler` connections."""

    def __init__(self, base: web.Server, deadlines: Deadlines, shedder: Shedder | None) -> None:
        # Same handler, request factory and RequestHandler kwargs (the app's handler_args
        # included) as the server the app built for itself.
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **base._kwargs,
        )
        self._deadlines = deadlines
        self._shedder = shedder

    def __call__(self) -> RequestHandler:
        return HardenedRequestHandler(
            self, loop=self._loop, deadlines=self._deadlines, shedder=self._shedder, **self._kwargs
        )


class HardenedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections enforce `settings.http` and the head-size cap.

    Use it wherever the app is served (``gateway serve``, and tests over real sockets);
    extra keyword arguments go to `web.AppRunner` and win over `handler_kwargs`."""

    __slots__ = ("_deadlines", "_limits", "metrics", "shedder")

    def __init__(self, app: web.Application, *, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **{**handler_kwargs(settings), **kwargs})
        self._deadlines = Deadlines.from_settings(settings)
        self._limits = OverloadLimits(
            max_connections=settings.http.max_connections,
            max_requests_in_progress=settings.http.max_requests_in_progress,
            max_head_wait=settings.http.max_head_wait,
            retry_after=settings.timeouts.retry_after,
            max_loop_lag=MAX_LOOP_LAG,
        )
        self.shedder: Shedder | None = None
        self.metrics: Metrics | None = None  # the app's, once set up (ShedSite reports there)

    async def _make_server(self) -> web.Server:
        from gateway.app import LOOP_LAG  # the app's resources; the app imports much
        from gateway.web.handlers import EDGE  # the app's metrics; handlers import much

        edge = self.app.get(EDGE) if isinstance(self.app, web.Application) else None
        self.shedder = Shedder(self._limits, edge.metrics.shed if edge is not None else None)
        if edge is not None:
            edge.metrics.watch_http(self.shedder)
            self.metrics = edge.metrics
        base = await super()._make_server()  # the app's start-up: LOOP_LAG exists after it
        lag = self.app.get(LOOP_LAG) if isinstance(self.app, web.Application) else None
        if lag is not None:
            lag.watch(self.shedder.loop_sampled)
        return _HardenedServer(base, self._deadlines, self.shedder)


class ProbeRunner(web.AppRunner):
    """`web.AppRunner` for the probe port (`gateway.web.probes`): the same per-connection
    deadlines and head-size cap as `HardenedAppRunner`, and no shedding (nothing there is
    counted against the caps, and its listener is never paused)."""

    __slots__ = ("_deadlines",)

    def __init__(self, app: web.Application, *, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **{**handler_kwargs(settings), **kwargs})
        self._deadlines = Deadlines.from_settings(settings)

    async def _make_server(self) -> web.Server:
        return _HardenedServer(await super()._make_server(), self._deadlines, None)


# After a pause, the closed listening socket may hold its port for a loop turn.
REOPEN_RETRY = 0.01
# A listen that keeps failing is retried after a delay doubling up to this, and logged at
# most this often.
REOPEN_RETRY_MAX = 1.0
REOPEN_LOG_EVERY = 30.0


class _Retry:
    """The delays between listen attempts: `REOPEN_RETRY`, doubling up to `REOPEN_RETRY_MAX`."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = REOPEN_RETRY

    def delay(self) -> float:
        delay, self._next = self._next, min(REOPEN_RETRY_MAX, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = REOPEN_RETRY


# How often the accept queue is looked at; over `MAX_ACCEPT_QUEUE` connections waiting
# there, the listener closes for `QUEUE_PAUSE` (gateway.web.overload).
QUEUE_CHECK = 0.05
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
      accept queue at two looks in a row (every `QUEUE_CHECK`; Linux only, where
      ``TCP_INFO`` on a listening socket gives its queue): the loop accepts them slower
      than they come (measured: uvloop accepts a few per loop turn when the loop is busy),
      and each would wait there, unseen by any cap, until its client gave up.

    Listening again opens a new socket on the same address, in a task this site owns;
    `stop` cancels and awaits it, and the timers. Each pause is counted under the reason
    that began it (`pauses`, `paused_seconds`: the app's metrics read them)."""

    __slots__ = (
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
        self._retry = _Retry()
        self._bind_error: OSError | None = None  # the last listen failed (cleared on success)
        self._bind_failing_since = 0.0
        self._bind_logged_at = float("-inf")
        self._shedder_wants = True
        self._quiet_until = 0.0  # loop time: closed until then (a long accept queue)
        self._stopped = False
        self._check: asyncio.TimerHandle | None = None
        self._wake: asyncio.TimerHandle | None = None
        self._was_long = False  # the accept queue was over the bound at the last look
        self._pause_reason: PauseReason = "connections"  # the shedder's, while it pauses
        self._paused_at: float | None = None  # loop time the current pause began
        self._began: PauseReason = "connections"  # the current pause's reason
        self._runner_loop = asyncio.get_running_loop()
        self._paused_for: dict[PauseReason, float] = dict.fromkeys(PAUSE_REASONS, 0.0)
        self._pause_count: dict[PauseReason, int] = dict.fromkeys(PAUSE_REASONS, 0)

    async def start(self) -> None:
        await super().start()
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
            long = self._server is not None and self.accept_queue() > MAX_ACCEPT_QUEUE
        except OSError:  # a socket closed under us: look again next time
            long = False
        # Over the bound at two looks in a row: a burst of connects the loop is still
        # accepting (a client opening its pool) is not a backlog.
        long, self._was_long = long and self._was_long, long
        if long:
            self._quiet_until = loop.time() + QUEUE_PAUSE
            if self._wake is not None:
                self._wake.cancel()
            self._wake = loop.call_at(self._quiet_until, self._steer)
            self._steer()

    def _steer(self) -> None:
        if not self._wanted():
            if self._server is not None:
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
                    await asyncio.sleep(self._retry.delay())
                    continue
                if self._wanted():
                    self._server = listening
                    self._pause_ended()
                    self._bound_again()
                else:  # paused again meanwhile
                    listening.close()
        finally:
            self._reopening = None

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
        self._retry.reset()
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
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await super().stop()
