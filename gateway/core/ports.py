"""The ports the core talks through. Adapters implement them; tests may fake them here only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from gateway.core.message import OutboundMessage


class Sender(Protocol):
    """One open link to one entity. The dispatcher uses each sender for one send at a time."""

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        """Send `messages` as one settled operation (a batch when more than one).

        Returns only when the broker has stored every message; raises `SendFailure`
        otherwise. May hang: the caller owns the deadline.
        """
        ...

    async def close(self) -> None:
        """Close the link; never raises."""
        ...


class NamespaceClient(Protocol):
    """One Service Bus namespace: opens senders, closes everything at shutdown."""

    @property
    def name(self) -> str: ...

    async def open_sender(self, path: str) -> Sender:
        """Open a sender on `path`; raises `SendFailure`. The caller owns the deadline."""
        ...

    async def close(self) -> None:
        """Close the client and every sender it opened; never raises."""
        ...


class Tracer:
    """Tracing hooks the core calls (gateway.tracing has the OpenTelemetry one). This default
    traces nothing and costs nothing: `enabled` is false, so the core skips its clock reads.

    A *context* is opaque to the core: whatever `current` returns, handed back in `links`."""

    enabled: bool = False

    def current(self) -> object | None:
        """The active span's context (the request's, or the syphon's move), to link to."""
        return None

    def headers(self) -> dict[str, str]:
        """The active span's context as W3C headers (``traceparent``, ``tracestate``)."""
        return {}

    def admission_waited(self, seconds: float) -> None:
        """The current request waited `seconds` for room (only called beyond a threshold)."""

    def batch_sent(
        self,
        namespace: str,
        path: str,
        links: Sequence[object | None],
        messages: int,
        seconds: float,
        error: str | None,
    ) -> None:
        """One broker operation to `path` ended `seconds` after it started; `links` are the
        contexts of the requests (or moves) whose messages it carried; `error` the failure
        kind, None when stored."""

    def moving(
        self, entity: str, backlog: str, origins: Sequence[Mapping[str, object]]
    ) -> AbstractContextManager[None]:
        """The syphon moves messages from `backlog` to `entity`, inside this context;
        `origins` are their application properties, which carry their original context."""
        return nullcontext()
