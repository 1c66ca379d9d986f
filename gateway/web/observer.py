"""The edge's observer: what the HTTP edge reports, as hooks the metrics implement.

The edge never imports the metrics (`gateway.metrics` implements this interface, as it
implements the dispatcher's, failover's and the syphon's); the app factory hands the edge its
observer. The default does nothing, so an edge without metrics (a test's app) needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.web.overload import ListenerStats, Shedder, ShedReason


class EdgeObserver:
    """Metric hooks of the HTTP edge; the default does nothing."""

    def admission_refused(self) -> None:
        """A request was answered 503: no room freed up within ``admission_timeout``."""

    def messages_accepted(self, entity: str, route: str, n: int) -> None:
        """`n` messages of one request were accepted (202/201) by `route`."""

    def request_answered(self, entity: str, status: int, route: str, seconds: float) -> None:
        """A send request was answered `status` after `seconds`."""

    def shed(self, reason: ShedReason) -> None:
        """A connection or request was shed for `reason` (`gateway.web.overload`)."""

    def watch_http(self, shedder: Shedder) -> None:
        """Read the open connections and requests in progress from the server's shedder."""

    def watch_listener(self, stats: ListenerStats) -> None:
        """Read the listen port's state and pauses from its site."""
