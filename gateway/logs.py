"""Logging set-up: JSON lines in production, plain text for development."""

from __future__ import annotations

import datetime as dt
import logging
import sys
from typing import Any

import orjson

from gateway.tracing import log_ids

# Attributes every LogRecord has; anything else passed with `extra=` is a structured field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


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
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The SDK and the AMQP stack are chatty at INFO; their errors still come through us.
    for noisy in ("azure", "uamqp", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
