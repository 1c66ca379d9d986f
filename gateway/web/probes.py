"""The probe port (``probe_port``): ``/healthz``, ``/readyz`` and ``/metrics`` on a second
listener that overload never closes.

Under overload the listen port stops listening (`gateway.web.listener.ShedSite`), and the
kernel refuses every new connection to it, a probe's as well: a liveness probe refused
``failureThreshold`` times in a row would have Kubernetes restart a replica that is merely
busy. The probe port is a plain `web.TCPSite` of a small application of its own, whose three
routes are the main app's own handlers (same state, same answers, readiness 503 while
draining); any other path is a JSON ``404 not_found``. The send path pays nothing for it,
and with ``probe_port`` 0 (the default) nothing listens.

It listens on ``listen_host`` and closes after the drain delay, before the main app's
cleanup (nothing reads the app's state after its cleanup).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from gateway.config import Settings
from gateway.web.handlers import EDGE, Handler, edge_middleware
from gateway.web.runner import ProbeRunner

PROBE_PATHS: Final = ("/healthz", "/readyz", "/metrics")
# A probe still in progress at exit is not worth waiting for.
PROBE_SHUTDOWN_TIMEOUT: Final = 1.0


def probe_app(app: web.Application) -> web.Application:
    """An application serving `app`'s own GET handlers for `PROBE_PATHS`, with its state and
    its middlewares: the edge middleware (errors as JSON, the drain flag), the server span
    (tracing on) and the open mode's ``Host`` check (`/metrics` names the entities)."""
    # The edge middleware answers the paths it does not serve (aiohttp's 404) as JSON; the
    # routes copied here are inside the edge's frame already (`handlers.edge`).
    middlewares = list(app.middlewares)
    if edge_middleware not in middlewares:
        middlewares.append(edge_middleware)
    probes = web.Application(middlewares=middlewares)
    probes[EDGE] = app[EDGE]
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path")
        if route.method == "GET" and path in PROBE_PATHS:
            handler: Handler = route.handler  # type: ignore[assignment]  # never a view class
            probes.router.add_get(path, handler)
    return probes


@contextlib.asynccontextmanager
async def serving_probes(
    app: web.Application, settings: Settings
) -> AsyncIterator[web.TCPSite | None]:
    """Serve `probe_app(app)` on ``settings.probe_port`` while in the block; yields the
    site, or None when the port is 0 (off). Leaving the block stops listening and waits up
    to `PROBE_SHUTDOWN_TIMEOUT` for probes in progress."""
    if not settings.probe_port:
        yield None
        return
    runner = ProbeRunner(
        probe_app(app),
        settings=settings,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=PROBE_SHUTDOWN_TIMEOUT,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.listen_host, settings.probe_port, reuse_address=True)
        await site.start()
        yield site
    finally:
        await runner.cleanup()
