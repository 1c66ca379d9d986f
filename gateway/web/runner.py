"""The runners that serve the gateway's apps with `gateway.web.protocol`'s connections.

`HardenedAppRunner` serves the main app (with the shedder: `gateway.web.overload`),
`ProbeRunner` the probe port's (no shedding). Both replace the server aiohttp builds for the
app by one whose connections are `HardenedRequestHandler`s.

**aiohttp's private names used here** (guarded by tests/security/test_aiohttp_privates.py):
`AppRunner._make_server`, overridden (called by `BaseRunner.setup`, after the app's start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.config import Settings
from gateway.web.overload import (
    MAX_LOOP_LAG,
    OverloadLimits,
    Shedder,
)
from gateway.web.protocol import Deadlines, HardenedServer, handler_kwargs

if TYPE_CHECKING:
    from gateway.core.looplag import LoopLag
    from gateway.web.observer import EdgeObserver


class HardenedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections enforce `settings.http` and the head-size cap.

    Use it wherever the app is served (``gateway serve``, and tests over real sockets;
    `gateway.app.edge_runner` builds it for the gateway's app). `observer` hears the
    shedder's and the listener's figures (the app's metrics); `loop_lag` is the app key of
    the event loop's measured delay, which exists once the app has started: the shedder
    samples it. Extra keyword arguments go to `web.AppRunner` and win over
    `handler_kwargs`."""

    __slots__ = ("_deadlines", "_limits", "_loop_lag", "metrics", "shedder")

    def __init__(
        self,
        app: web.Application,
        *,
        settings: Settings,
        observer: EdgeObserver | None = None,
        loop_lag: web.AppKey[LoopLag] | None = None,
        **kwargs: Any,
    ) -> None:
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
        self.metrics = observer  # ShedSite reports there
        self._loop_lag = loop_lag

    async def _make_server(self) -> web.Server:
        observer = self.metrics
        self.shedder = Shedder(self._limits, observer.shed if observer is not None else None)
        if observer is not None:
            observer.watch_http(self.shedder)
        base = await super()._make_server()  # the app's start-up: the loop lag exists after it
        lag = None
        if self._loop_lag is not None and isinstance(self.app, web.Application):
            lag = self.app.get(self._loop_lag)
        if lag is not None:
            lag.watch(self.shedder.loop_sampled)
        return HardenedServer(base, self._deadlines, self.shedder)


class ProbeRunner(web.AppRunner):
    """`web.AppRunner` for the probe port (`gateway.web.probes`): the same per-connection
    deadlines and head-size cap as `HardenedAppRunner`, and no shedding (nothing there is
    counted against the caps, and its listener is never paused)."""

    __slots__ = ("_deadlines",)

    def __init__(self, app: web.Application, *, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **{**handler_kwargs(settings), **kwargs})
        self._deadlines = Deadlines.from_settings(settings)

    async def _make_server(self) -> web.Server:
        return HardenedServer(await super()._make_server(), self._deadlines, None)
