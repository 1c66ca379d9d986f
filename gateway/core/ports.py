"""The ports the core and the syphon talk through. Adapters implement them; tests may fake them
here only.

The sending side: `Sender`, `NamespaceClient`, `Tracer`. The syphon's side: `BacklogPort` (the
backlog queues it drains, in peek-lock) and `Clock` (the time it waits on)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

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

    def delivery(
        self, entity: str, request_id: str, origins: Sequence[Mapping[str, object]]
    ) -> AbstractContextManager[Callable[[int], None]]:
        """An AMQP delivery to `entity` (its access line's `request_id`) is handled inside
        this context: the edge's server span, as an HTTP request has one. `origins` are its
        messages' application properties, whose trace context it continues; what it yields
        is told the delivery's outcome as the HTTP status the same outcome has."""
        return nullcontext(_no_status)


def _no_status(_status: int) -> None:
    """The outcome of a delivery that no span records."""


# -- the syphon's ports ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    """One message received in peek-lock from a backlog queue."""

    message: OutboundMessage  # as it is stored in the backlog (rewritten properties)
    handle: Any  # the adapter's own message object, for settling
    locked_until: float | None  # unix time the lock expires
    delivery_count: int
    # Why the adapter could not read it as a message (a property of a type no REST client can
    # send, say): the syphon dead-letters it. `message` then holds only its MessageId.
    unreadable: str | None = None
    # The queue's sequence number: its stored order (a receive after an abandon may hand
    # messages back in another order). None if the adapter cannot say.
    sequence: int | None = None


class BacklogPort(Protocol):
    """Peek-lock access to the backlog queues of one secondary namespace.

    Every method is one broker operation (the syphon counts them) and may hang: the caller
    owns the deadline. Failures raise `BrokerFailure` (translated by the adapter).
    """

    async def receive(self, path: str, max_count: int, wait: float) -> list[Received]: ...

    async def complete(self, path: str, message: Received) -> None: ...

    async def abandon(self, path: str, message: Received) -> None: ...

    async def dead_letter(
        self, path: str, message: Received, reason: str, description: str
    ) -> None: ...

    async def renew(self, path: str, message: Received) -> float | None:
        """Renew the lock; returns the new locked-until (unix time)."""
        ...

    async def peek(
        self, path: str, from_sequence: int, max_count: int
    ) -> list[tuple[int, OutboundMessage | None]]:
        """Up to `max_count` messages of `path` from sequence number `from_sequence` (>= 1)
        on, locked or not, without locking them: (sequence number, message as stored; None
        for one that cannot be read)."""
        ...

    async def depths(self, paths: Sequence[str]) -> dict[str, int] | None:
        """Active message counts of `paths` in one management call (None if unavailable)."""
        ...

    async def reset(self) -> None:
        """Close every open receiver (they are reopened on next use); never raises."""
        ...

    async def close(self) -> None: ...


class Clock(Protocol):
    """Time as the syphon sees it: real in production, driven by the test for the idle-cost
    test (a simulated hour without a real hour)."""

    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait until `event` is set (True) or `seconds` pass (False)."""
        ...


class RealClock:
    def now(self) -> float:
        return time.time()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
                return True
        return event.is_set()
