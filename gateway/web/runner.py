"""The runners that serve the gateway's apps with `gateway.web.protocol`'s connections.

`HardenedAppRunner` serves the main app (with the shedder: `gateway.web.overload`, its
connections `gateway.web.shedding`'s, which admit each request at its head), `ProbeRunner`
the probe port's (no shedding, `HardenedRequestHandler`s). Both replace the server aiohttp
builds for the app.

**aiohttp's private names used here** (guarded by tests/security/test_aiohttp_privates.py):
`AppRunner._make_server`, overridden (called by `BaseRunner.setup`, after the app's start-up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.config import Settings
from gateway.web.handlers import request_handler
from gateway.web.overload import (
    MAX_LOOP_LAG,
    LimitSource,
    OverloadLimits,
    Shedder,
)
from gateway.web.protocol import Deadlines, HardenedServer, handler_kwargs
from gateway.web.shedding import ShedServer

if TYPE_CHECKING:
    from gateway.core.dispatcher import Dispatcher
    from gateway.core.looplag import LoopLag
    from gateway.web.observer import EdgeObserver


class HardenedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections enforce `settings.http` and the head-size cap.

    Use it wherever the app is served (``gateway serve``, and tests over real sockets;
    `gateway.app.edge_runner` builds it for the gateway's app). `observer` hears the
    shedder's and the listener's figures (the app's metrics); `loop_lag` is the app key of
    the event loop's measured delay, which exists once the app has started: the shedder
    samples it. `dispatcher` and `clients` are the app keys of the dispatcher and of the
    namespaces' clients: with adaptive admission on, the shedder's in-progress limit follows
    the namespaces' adaptive limits (docs/admission.md). Extra keyword arguments go to
    `web.AppRunner` and win over `handler_kwargs`."""

    __slots__ = (
        "_adaptive",
        "_clients",
        "_deadlines",
        "_dispatcher",
        "_limits",
        "_loop_lag",
        "metrics",
        "shedder",
    )

    def __init__(
        self,
        app: web.Application,
        *,
        settings: Settings,
        observer: EdgeObserver | None = None,
        loop_lag: web.AppKey[LoopLag] | None = None,
        dispatcher: web.AppKey[Dispatcher] | None = None,
        clients: web.AppKey[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **{**handler_kwargs(settings), **kwargs})
        self._deadlines = Deadlines.from_settings(settings)
        self._adaptive = settings.limits.adaptive_admission
        self._dispatcher = dispatcher
        self._clients = clients
        self._limits = OverloadLimits(
            max_connections=settings.http.max_connections,
            max_requests_in_progress=settings.http.max_requests_in_progress,
            max_head_wait=settings.http.max_head_wait,
            retry_after=settings.timeouts.retry_after,
            max_loop_lag=MAX_LOOP_LAG,
            tolerance=settings.limits.adaptive_tolerance,
            latency_goal=settings.limits.adaptive_latency_goal,
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
        if isinstance(self.app, web.Application):  # the message route's short cut
            base.request_handler = request_handler(self.app, base.request_handler)
        lag = None
        if self._loop_lag is not None and isinstance(self.app, web.Application):
            lag = self.app.get(self._loop_lag)
        if lag is not None:
            lag.watch(self.shedder.loop_sampled)
        source = self._adaptive_limit()
        if source is not None:
            self.shedder.attach_limit(source)
        return ShedServer(base, self._deadlines, self.shedder)

    def _adaptive_limit(self) -> Callable[[], LimitSource | None] | None:
        """The sum of the namespaces' adaptive limits, the highest of their learned
        latencies and of their broker floors (None before any limiter exists), when adaptive
        admission is on and the app has a dispatcher."""
        app = self.app
        if not self._adaptive or self._dispatcher is None or not isinstance(app, web.Application):
            return None
        dispatcher = app.get(self._dispatcher)
        clients = app.get(self._clients) if self._clients is not None else None
        names = tuple(clients) if clients is not None else ()
        if dispatcher is None or not names:
            return None

        def total() -> LimitSource | None:
            limiters = [dispatcher.limiter(name) for name in names]
            present = [limiter for limiter in limiters if limiter is not None]
            if not present:
                return None
            baselines = [lim.baseline for lim in present if lim.baseline is not None]
            return (
                sum(lim.limit for lim in present),
                max(baselines, default=None),
                max(lim.broker_floor for lim in present),
            )

        return total


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
