"""The edge's observer: what the HTTP edge reports, as hooks the metrics implement.

The edge never imports the metrics (`gateway.metrics` implements this interface, as it
implements the dispatcher's, failover's and the syphon's); the app factory hands the edge its
observer. The default does nothing, so an edge without metrics (a test's app) needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.ingest import IngestObserver

if TYPE_CHECKING:
    from gateway.web.overload import ListenerStats, Shedder, ShedReason


class EdgeObserver(IngestObserver):
    """Metric hooks of the HTTP edge (beyond what every edge reports, `IngestObserver`); the
    default does nothing."""

    def shed(self, reason: ShedReason) -> None:
        """A connection or request was shed for `reason` (`gateway.web.overload`)."""

    def watch_http(self, shedder: Shedder) -> None:
        """Read the open connections and requests in progress from the server's shedder."""

    def watch_listener(self, stats: ListenerStats) -> None:
        """Read the listen port's state and pauses from its site."""
