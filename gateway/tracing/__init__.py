"""Trace context: on every message, and (with the `otel` extra) OpenTelemetry spans.

This module never imports OpenTelemetry: the gateway runs without the extra, and with
tracing off a request costs one header lookup more. What it does with tracing off or on:

* **On the messages.** When a request carries a W3C ``traceparent`` (or, tracing on, a span
  is active), each of its messages gets the application properties the Azure SDK itself
  stamps when it traces a send (its ``trace_message``): ``Diagnostic-Id`` and
  ``traceparent`` (the same value) and ``tracestate`` when there is one. A consumer using the
  Azure SDK continues the trace. A property the client set itself wins (the SDK, too, only
  adds these when they are missing). The properties go through the backlog unchanged, so a
  message the syphon moves home carries its original context.
* **Spans** (gateway.tracing.otel, when ``OTEL_TRACES_EXPORTER`` is set): a server span per
  request, a send span per broker batch linked to every request in it, a move span per
  syphon move linked to each message's original context.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from gateway.config import ConfigError, TracingSettings
from gateway.core.ports import Tracer

# The application property names the Azure SDK uses (TRACE_*_PROPERTY in its tracing module).
DIAGNOSTIC_ID = "Diagnostic-Id"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# version-traceid-parentid-flags, lower-case hex (W3C Trace Context, level 1). A later
# version may append fields after a dash; version ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
MAX_TRACESTATE = 512  # the W3C limit a vendor must propagate at least


def valid_traceparent(value: str) -> bool:
    m = _TRACEPARENT.match(value)
    if m is None:
        return False
    version, trace_id, span_id, _flags, rest = m.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return False
    return not (version == "00" and rest)


def context_properties(traceparent: str | None, tracestate: str | None) -> dict[str, str] | None:
    """The properties that carry a W3C context on a message; None when `traceparent` is
    missing or invalid (a bad one is ignored, as the W3C recommendation says)."""
    if not traceparent:
        return None
    traceparent = traceparent.strip()
    if not valid_traceparent(traceparent):
        return None
    props = {DIAGNOSTIC_ID: traceparent, TRACEPARENT: traceparent}
    if tracestate:
        tracestate = tracestate.strip()
        if tracestate and len(tracestate) <= MAX_TRACESTATE and tracestate.isascii():
            props[TRACESTATE] = tracestate
    return props


def request_properties(headers: Mapping[str, str], tracer: Tracer) -> dict[str, str] | None:
    """The context to stamp on a request's messages: the active span's (tracing on), else
    the request's own ``traceparent``/``tracestate`` headers. The REST parser adds them to
    each message's properties (gateway.web.rest.build_message)."""
    if tracer.enabled:
        carrier = tracer.headers()
        return context_properties(carrier.get(TRACEPARENT), carrier.get(TRACESTATE))
    traceparent = headers.get(TRACEPARENT)
    if traceparent is None:
        return None
    return context_properties(traceparent, headers.get(TRACESTATE))


def message_context(properties: Mapping[str, object]) -> tuple[str, str | None] | None:
    """The (traceparent, tracestate) a received message carries, as the Azure SDK reads it:
    ``traceparent``, else ``Diagnostic-Id``; None without a valid one."""
    value = properties.get(TRACEPARENT) or properties.get(DIAGNOSTIC_ID)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or not valid_traceparent(value):
        return None
    state = properties.get(TRACESTATE)
    if isinstance(state, bytes):
        state = state.decode("ascii", "replace")
    return value, state if isinstance(state, str) and state else None


# -- log lines -------------------------------------------------------------------------------

_ids: Callable[[], dict[str, str]] | None = None


def log_ids() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the active span, for a log line; empty with tracing
    off or no span active."""
    return _ids() if _ids is not None else {}


def use_log_ids(ids: Callable[[], dict[str, str]]) -> None:
    """Called by the OpenTelemetry tracer: log lines carry the active span's ids from now on."""
    global _ids
    _ids = ids


# -- the tracer ------------------------------------------------------------------------------


def create_tracer(settings: TracingSettings) -> Tracer:
    """The tracer `settings` ask for: the no-op one with tracing off. Raises `ConfigError`
    (one line) when tracing is on and OpenTelemetry is not installed."""
    if not settings.enabled:
        return Tracer()
    try:
        from gateway.tracing.otel import OtelTracer
    except ImportError as exc:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={settings.exporter}: tracing needs OpenTelemetry, which is "
            f"not installed (install the sbgate[otel] extra; the image has it): {exc}"
        ) from None
    return OtelTracer.from_settings(settings)


async def close_tracer(tracer: Tracer) -> None:
    """Export what is left and stop the tracer's exporter (nothing for the no-op one)."""
    close = getattr(tracer, "aclose", None)
    if close is not None:
        await close()


def links_of(origins: Sequence[Mapping[str, object]]) -> list[tuple[str, str | None]]:
    """The valid contexts among messages' properties (the syphon's move links to them)."""
    return [c for p in origins if (c := message_context(p)) is not None]


__all__ = [
    "DIAGNOSTIC_ID",
    "TRACEPARENT",
    "TRACESTATE",
    "Tracer",
    "close_tracer",
    "context_properties",
    "create_tracer",
    "links_of",
    "log_ids",
    "message_context",
    "request_properties",
    "use_log_ids",
    "valid_traceparent",
]
