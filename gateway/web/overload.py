"""Shedding overload at the cheapest point that still tells the client.

A gateway in front of a broker must refuse a burst quickly and clearly, so that clients back
off (``Retry-After``) and the autoscaler sees it, instead of every client timing out. In
CPython an HTTP-level 503 still costs a good part of a 201 (parsing is shared), so the caps
act before any of the request's own work:

* **Connections** (``http.max_connections``): a connection accepted over the cap is
  answered ``503 overloaded`` at once (pre-encoded bytes, before its request is read) and
  closed. That is the cheapest refusal: no parsing at all.
* **Requests in progress** (``http.max_requests_in_progress``): a request whose head
  completes while that many handlers run is answered ``503 overloaded`` before its body is
  read or its token checked, and its connection is closed (the unread body is not worth
  reading). This is uvicorn's ``limit_concurrency``.
* **Head wait** (``http.max_head_wait``): a request whose complete head waited longer than
  that for its handler (the event loop is behind) gets the same answer: by the time it
  would be served its client is likely to have given up, and serving it delays the rest.

Probes, metrics and the admin API are never shed (nor counted): a liveness probe answered
503 under load would have Kubernetes restart a replica that is merely busy, and an operator
must be able to act during an overload.

The caps count this process; each replica sheds for itself. Shed requests are counted in
``sbgate_http_shed_total{reason}`` and nowhere else (no access line: a flood must not cost
a log line per request).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

import orjson

from gateway.errors import Overloaded

ShedReason = Literal["connections", "in_progress", "head_wait"]
SHED_REASONS: Final[tuple[ShedReason, ...]] = ("connections", "in_progress", "head_wait")
OVERLOADED: Final = Overloaded.code
EXEMPT_PREFIXES: Final = ("/healthz", "/readyz", "/metrics", "/admin/")


@dataclass(frozen=True, slots=True)
class OverloadLimits:
    """The caps (0 turns one off) and the Retry-After the 503s carry."""

    max_connections: int
    max_requests_in_progress: int
    max_head_wait: float
    retry_after: float


class Shedder:
    """The process's counts of connections and requests in progress, and the decisions.

    Not thread-safe: the event loop's thread alone calls it (from the protocol)."""

    __slots__ = ("_limits", "_on_shed", "_raw_body", "_raw_head", "connections", "in_progress")

    def __init__(
        self, limits: OverloadLimits, on_shed: Callable[[ShedReason], None] | None = None
    ) -> None:
        self._limits = limits
        self._on_shed = on_shed or (lambda _reason: None)
        self.connections = 0
        self.in_progress = 0
        self._raw_body = overloaded_body("connections")
        self._raw_head = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Retry-After: %s\r\n"
            b"Connection: close\r\n" % (len(self._raw_body), self.retry_after.encode())
        )

    @property
    def retry_after(self) -> str:
        return str(max(1, round(self._limits.retry_after)))

    def connection_opened(self) -> bool:
        """Count a new connection; False (and counted as shed) when it is over the cap."""
        cap = self._limits.max_connections
        if cap and self.connections >= cap:
            self._on_shed("connections")
            return False
        self.connections += 1
        return True

    def connection_closed(self) -> None:
        self.connections -= 1

    def admit(self, waited: float) -> ShedReason | None:
        """Whether a request whose head waited `waited` seconds may run now; when it may,
        it is counted in progress until `done()`."""
        cap = self._limits.max_requests_in_progress
        reason: ShedReason | None = None
        if cap and self.in_progress >= cap:
            reason = "in_progress"
        elif self._limits.max_head_wait and waited > self._limits.max_head_wait:
            reason = "head_wait"
        if reason is not None:
            self._on_shed(reason)
            return reason
        self.in_progress += 1
        return None

    def done(self) -> None:
        self.in_progress -= 1

    def raw_503(self) -> bytes:
        """A complete ``503 overloaded`` response that closes the connection, as bytes."""
        request_id = os.urandom(16).hex().encode()
        return self._raw_head + b"X-Request-Id: " + request_id + b"\r\n\r\n" + self._raw_body


def overloaded_body(reason: ShedReason) -> bytes:
    return orjson.dumps({"error": OVERLOADED, "message": _MESSAGES[reason]})


_MESSAGES: Final[dict[ShedReason, str]] = {
    "connections": "this replica has too many open connections; retry later",
    "in_progress": "this replica has too many requests in progress; retry later",
    "head_wait": "this replica is behind: the request waited too long to be served; retry later",
}
