"""Logging set-up: JSON lines in production, plain text for development.

Every line goes to stderr: the `logging` lines and the per-request access line alike (stdout
is left to the event ledger's ``stdout`` sink). The access line — one per request, the
hottest line there is — does not go through `logging`'s records, formatters and handlers:
`AccessLog` serialises it once with orjson and writes it through a buffer flushed once per
event-loop turn (or at 64 KiB), and at shutdown by its owner, the app.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

import orjson

from gateway.tracing import log_ids

# Attributes every LogRecord has; anything else passed with `extra=` is a structured field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
# The text format, for development: no structured fields.
_TEXT = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus every `extra=` field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if "trace_id" not in out:
            out.update(log_ids())  # the active span's, with tracing on
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(fmt: str, level: str) -> None:
    """Configure the root logger once (idempotent).

    Neither format prints the caller's file/line/function, the thread or the process, so
    `logging` is told not to collect them (the Logging HOWTO's "Optimization" switches): a
    record then costs a few microseconds less, which matters for one line per request."""
    logging._srcfile = None  # type: ignore[attr-defined]  # no findCaller() stack walk
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TEXT)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    quiet_sdk_loggers()


def quiet_sdk_loggers() -> None:
    """The SDK and the AMQP stack are chatty at INFO (dozens of lines per connection); their
    errors still come through us. Every `gateway` command calls this first."""
    for noisy in ("azure", "uamqp", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


ACCESS_LOGGER = "gateway.requests"
_FLUSH_BYTES = 64 * 1024
# How long a buffered access line may wait for the write that carries it (as nginx's
# ``access_log ... flush=``; SIGTERM and shutdown flush at once).
FLUSH_DELAY = 0.05
_MILLIS = tuple(f".{ms:03d}+00:00" for ms in range(1000))
_LEVEL_NAMES = {logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR"}


class AccessLog:
    """The one line per request: the fields `JsonFormatter` would print for a record of the
    ``gateway.requests`` logger (``ts``, ``level``, ``logger``, ``msg``, then the fields in
    the order given), at a fraction of the cost.

    Level control is the logger's (`enabled`): `setup_logging`'s level, or whatever a test
    sets. `write` serialises the line at once and buffers it; the buffer goes to the stream
    `flush_delay` after it became non-empty (a ``call_later``), when it holds 64 KiB, or on
    `flush`: under load one write carries the lines of many loop turns, not a system call
    every few requests. Its owner (the app's cleanup context) calls `close` last, so no
    line is lost at shutdown. *stream* defaults to ``sys.stderr`` as it is at each
    flush (where `logging` writes too; tests capturing stderr see the lines)."""

    __slots__ = (
        "_delay",
        "_fmt",
        "_logger",
        "_loop",
        "_ms",
        "_parts",
        "_scheduled",
        "_size",
        "_stream",
        "_ts",
        "client_errors",
    )

    def __init__(
        self, fmt: str = "json", stream: IO[str] | None = None, flush_delay: float = FLUSH_DELAY
    ) -> None:
        # The level of a client error's line (4xx): INFO, or WARNING in the development
        # profile, whose access lines are failures only — a developer's 401 is one of them.
        self.client_errors = logging.INFO
        self._fmt = fmt
        self._stream = stream
        self._delay = flush_delay
        self._logger = logging.getLogger(ACCESS_LOGGER)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._scheduled = False
        self._ts: tuple[int, str] = (-1, "")  # (unix second, its ISO prefix): one per second
        self._ms: tuple[int, str] = (-1, "")  # (unix millisecond, the whole ``ts``)

    def enabled(self, level: int) -> bool:
        """Whether a line at *level* is written (the ``gateway.requests`` logger's level)."""
        return self._logger.isEnabledFor(level)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush on *loop*'s turns from now on (until then every line is written at once)."""
        self._loop = loop

    def write(
        self,
        level: int,
        msg: str,
        fields: dict[str, Any],
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        """Buffer one line; *extras* (trace ids, ...) are merged after *fields*. Call only
        when `enabled` (the caller skips building *fields* otherwise)."""
        line = self.head(level, msg)
        line.update(fields)
        if extras:
            line.update(extras)
        self.write_line(line)

    def head(self, level: int, msg: str) -> dict[str, Any]:
        """A new line's first fields (``ts``, ``level``, ``logger``, ``msg``), for the caller
        to add its own to and hand to `write_line`: the request path's line built in one
        dict, not copied from another."""
        return {
            "ts": self._iso(time.time()),
            "level": _LEVEL_NAMES.get(level) or logging.getLevelName(level),
            "logger": ACCESS_LOGGER,
            "msg": msg,
        }

    def write_line(self, line: dict[str, Any]) -> None:
        """Serialise and buffer a line begun by `head` (only its ``level`` and ``msg`` in
        the text format)."""
        if self._fmt == "json":
            try:
                data = orjson.dumps(line, default=str, option=orjson.OPT_APPEND_NEWLINE)
            except TypeError:  # a lone surrogate, an int beyond 64 bits: still one line
                data = _dumps_loosely(line)
        else:
            level = logging.getLevelName(line["level"])
            record = logging.LogRecord(ACCESS_LOGGER, level, "", 0, line["msg"], None, None)
            data = (_TEXT.format(record) + "\n").encode("utf-8", "backslashreplace")
        self._parts.append(data)
        self._size += len(data)
        if self._size >= _FLUSH_BYTES or self._loop is None:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_later(self._delay, self.flush)

    def _iso(self, now: float) -> str:
        """`JsonFormatter`'s ``ts`` (ISO 8601, UTC, milliseconds): formatted once per
        millisecond (lines written in the same one share it), its date and time of day once
        per second."""
        ms = int(now * 1000)
        if ms == self._ms[0]:
            return self._ms[1]
        second, frac = divmod(ms, 1000)
        cached_second, prefix = self._ts
        if second != cached_second:
            prefix = dt.datetime.fromtimestamp(second, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._ts = (second, prefix)
        text = prefix + _MILLIS[frac]
        self._ms = (ms, text)
        return text

    def flush(self) -> None:
        """Write out what is buffered (one write). A stream that fails loses the buffered
        lines, as a failing `logging` handler would, and never fails the request."""
        self._scheduled = False
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts.clear()
        self._size = 0
        stream = self._stream or sys.stderr
        try:
            binary = getattr(stream, "buffer", None)
            if binary is not None:
                stream.flush()  # whatever the text layer holds goes first
                binary.write(data)
                binary.flush()
            else:
                stream.write(data.decode("utf-8"))
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream
            pass

    def close(self) -> None:
        """Flush, and write every later line at once (nothing left to flush it)."""
        self._loop = None
        self.flush()


def _dumps_loosely(line: dict[str, Any]) -> bytes:
    """The access line when orjson refuses a value: that value as its `repr`. The line is
    written after the request's outcome is settled, so it must never raise (a stored message
    answered 500 would be sent again by its client)."""
    safe: dict[str, Any] = {}
    for key, value in line.items():
        try:
            orjson.dumps(value, default=str)
            safe[key] = value
        except TypeError:
            safe[key] = ascii(value)
    return orjson.dumps(safe, default=str, option=orjson.OPT_APPEND_NEWLINE)
