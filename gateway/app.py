"""The app factory, shared by `gateway serve`, `gateway syphon`, the tests and the benchmarks.

`create_app` builds the application and stores what its resources need under typed app keys.
The resources are the cleanup contexts below, in start order: async generators with exactly
one `yield`, started in order and cleaned up in reverse, each writing what it starts under
its own key. Once started, an app holds:

* `SETTINGS`, `PLAN` (what runs), `ADAPTERS` (the ports' adapters), `METRICS`, `EDGE`
  (catalog, limits, the metrics as the edge's observer, lifecycle, ledger, access log: what
  the handlers read) and, with rules, `AUTHORIZER`;
* the access log (in `EDGE`), flushed once per loop turn and, at shutdown, last;
* `LOOP_LAG` — the event loop's measured delay;
* `CREDENTIAL` — the process's one Entra ID credential, closed last but the access log;
* `CLIENTS` — one `NamespaceClient` per namespace name;
* `STORE` — the failover state store, when failover or the syphon runs;
* `DISPATCHER`, `PAIRS` (each pair's clients and usable backlog queues), `ROUTER`, and
  `FAILOVER` when failover runs;
* `AMQP_SERVER` — the AMQP edge (gateway.amqp), when a listener is configured: drained
  before the router closes;
* `SYPHONS` — the syphon workers (none unless the syphon runs).
* `PRESENCE` — whether the configured entities exist at their primaries (`gateway serve`,
  with the real clients or a given `entity_check`).

Only this module (and the CLI) knows the concrete adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from aiohttp import web, web_response

from gateway.amqp.server import CLOSE_GRACE as AMQP_CLOSE_GRACE
from gateway.amqp.server import AmqpServer
from gateway.amqp.server import drain_bound as amqp_drain_bound
from gateway.config import ConfigError, NamespaceSettings, Settings
from gateway.core import failover as failover_module
from gateway.core import presence as presence_module
from gateway.core.backlog import backlog_path
from gateway.core.dispatcher import SENDER_CLOSE_TIMEOUT, Dispatcher
from gateway.core.entities import EntityCatalog, EntityRef
from gateway.core.failover import Failover, PairClients
from gateway.core.looplag import LoopLag
from gateway.core.ports import BacklogPort, NamespaceClient, Tracer
from gateway.core.presence import Check, EntityPresence
from gateway.core.router import PrimaryRouter
from gateway.ingest import EdgeState, Lifecycle
from gateway.ledger import LedgerSettings, create_ledger
from gateway.lifetimes import CANCEL_GRACE, Closer, TaskObserver, stop_after
from gateway.logs import AccessLog
from gateway.metrics import Metrics
from gateway.servicebus.identity import SharedCredential
from gateway.state.base import StateStore
from gateway.state.fence import FenceStore
from gateway.state.memory import LocalState
from gateway.syphon.syphon import Syphon
from gateway.tracing import close_tracer, create_tracer
from gateway.web import handlers
from gateway.web.admin import ENTITY_CHECK, FAILOVER, PRESENCE, add_admin_routes
from gateway.web.auth import AUTHORIZER, build_authorizer
from gateway.web.handlers import EDGE, ROUTER
from gateway.web.hosts import host_check, is_loopback
from gateway.web.openapi import add_openapi_route
from gateway.web.runner import HardenedAppRunner

if TYPE_CHECKING:
    from gateway.servicebus.schedule import SdkScheduler
    from gateway.state.connect import RedisTarget

log = logging.getLogger(__name__)

Mode = Literal["serve", "syphon"]
ClientFactory = Callable[[NamespaceSettings], NamespaceClient]
StoreFactory = Callable[[Settings], StateStore]
BacklogFactory = Callable[[NamespaceSettings, NamespaceClient], BacklogPort | None]
Provisioner = Callable[[NamespaceSettings, list[str]], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class Plan:
    """What an app runs, decided once from the settings and the mode."""

    mode: Mode
    failover: bool  # the failover router: serving, enabled, and some pair has a secondary
    syphon: bool  # the syphon pool: some pair has a secondary, and `gateway syphon` or enabled

    @classmethod
    def of(cls, settings: Settings, mode: Mode) -> Plan:
        paired = any(p.secondary for p in settings.pairs)
        return cls(
            mode=mode,
            failover=mode == "serve" and settings.failover.enabled and paired,
            syphon=paired and (mode == "syphon" or settings.syphon.enabled),
        )

    @property
    def shared_state(self) -> bool:
        """Failover and the syphon keep state in a store that replicas share."""
        return self.failover or self.syphon


@dataclass(frozen=True, slots=True)
class Adapters:
    """The adapters at the app's ports: the real ones by default, fakes in tests and benches."""

    client: ClientFactory
    store: StoreFactory
    provision: Provisioner
    backlog: BacklogFactory


SETTINGS = web.AppKey("settings", Settings)
PLAN = web.AppKey("plan", Plan)
ADAPTERS = web.AppKey("adapters", Adapters)
CREDENTIAL = web.AppKey("credential", SharedCredential)
CLIENTS = web.AppKey[Mapping[str, NamespaceClient]]("clients")
STORE = web.AppKey[StateStore]("store")
# Session fences (docs/failover.md#sessions-keep-their-order), kept by the state store.
FENCES = web.AppKey[FenceStore]("fences")
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
PAIRS = web.AppKey[Mapping[str, PairClients]]("pairs")
SYPHONS = web.AppKey[list[Syphon]]("syphons")
LOOP_LAG = web.AppKey("loop_lag", LoopLag)
METRICS = web.AppKey("metrics", Metrics)

# The dispatcher's grace for pending sends at shutdown, and our deadline on closing one
# namespace client or the credential (the SDK's closes can hang on a namespace that went away).
DISPATCHER_GRACE = 5.0
CLOSE_TIMEOUT = 5.0


def cleanup_bounds(settings: Settings) -> dict[str, float]:
    """The longest each cleanup context takes at shutdown, in seconds, whatever the broker,
    Redis or the SDK do (docs/design.md#the-app-factory). The contexts run one after the
    other, so a shutdown's cleanup takes at most their sum (`tracer_ctx`: the exporter's
    own deadline, `otlp_timeout` + 1 s, when tracing is on)."""
    from gateway.servicebus.client import POOL_CLOSE_TIMEOUT

    syphon_grace = min(settings.shutdown.shutdown_timeout, settings.timeouts.send_timeout)
    return {
        "lifecycle_ctx": 0.0,
        # the syphon's own grace, then (backstop) one more send timeout and a close
        "syphon_ctx": syphon_grace + settings.timeouts.send_timeout + CLOSE_TIMEOUT,
        # the deliveries in flight, then the clients' closes
        "amqp_ctx": amqp_drain_bound(settings) + AMQP_CLOSE_GRACE + 3 * CANCEL_GRACE,
        "presence_ctx": presence_module.STOP_TIMEOUT + CANCEL_GRACE,
        "router_ctx": failover_module.STOP_TIMEOUT + CANCEL_GRACE,
        "dispatcher_ctx": DISPATCHER_GRACE + 2 * SENDER_CLOSE_TIMEOUT + 2 * CANCEL_GRACE,
        "ledger_ctx": ledger_settings(settings).close_timeout,
        # RedisStateStore.close: a flush, then its tasks (op_timeout = 1 s)
        "state_ctx": 4.0,
        # in parallel: the SDK client, then its pooled connections (SdkNamespaceClient.close)
        "clients_ctx": CLOSE_TIMEOUT + POOL_CLOSE_TIMEOUT + 2 * CANCEL_GRACE,
        "credential_ctx": CLOSE_TIMEOUT + CANCEL_GRACE,
        "tracer_ctx": settings.tracing.otlp_timeout / 1000 + 1.0,
        "loop_lag_ctx": 0.0,
        "access_log_ctx": 0.0,
    }


def create_app(
    settings: Settings,
    *,
    mode: Mode = "serve",
    client_factory: ClientFactory | None = None,
    store_factory: StoreFactory | None = None,
    provisioner: Provisioner | None = None,
    backlog_factory: BacklogFactory | None = None,
    metrics: Metrics | None = None,
    credential: SharedCredential | None = None,
    tracer: Tracer | None = None,
    entity_check: Check | None = None,
) -> web.Application:
    """Build the gateway's aiohttp application from validated `settings`.

    `mode="syphon"` serves only /healthz, /readyz and /metrics and runs the syphon pool
    (`gateway syphon`). The keyword arguments replace adapters at their ports (tests,
    benchmarks). The app owns `credential` (default: one from the settings; one for every
    SDK client and the admin client of this process) and closes it at shutdown, after the
    clients. It owns `tracer` too (default: from the settings' ``OTEL_*`` variables; the
    no-op one with tracing off) and closes it last. Raises `AuthConfigError` (a ValueError)
    on bad authorization rules, `ConfigError` when tracing is on without OpenTelemetry."""
    credential = credential or shared_credential(settings)
    tracer = tracer or create_tracer(settings.tracing)
    _name_the_server()
    metrics = metrics or Metrics()
    # The server span's middleware (tracing on) goes first: it sees every answer. Every route
    # is registered inside the edge's frame (`handlers.edge`); the edge middleware is for what
    # aiohttp answers itself, which only an app without the catch-all route (the syphon's)
    # lets it do. With tracing off the serving app has no middleware, and aiohttp skips its
    # middleware chain.
    tracing_middleware = getattr(tracer, "middleware", None)
    app = web.Application(
        middlewares=[
            *([tracing_middleware] if tracing_middleware else []),
            *([handlers.edge_middleware] if mode != "serve" else []),
        ],
        client_max_size=settings.limits.max_body_bytes,
        handler_args={"max_field_size": settings.limits.max_header_bytes},
    )
    app[SETTINGS] = settings
    app[PLAN] = Plan.of(settings, mode)
    app[CREDENTIAL] = credential
    app[ADAPTERS] = Adapters(
        client=client_factory or default_client_factory(settings, credential, observer=metrics),
        store=store_factory or default_store_factory,
        provision=provisioner or default_provisioner(settings, credential),
        backlog=backlog_factory or default_backlog_factory,
    )
    _set_entity_check(app, entity_check, default=client_factory is None, credential=credential)
    authorizer = build_authorizer(settings)
    if authorizer is not None:
        app[AUTHORIZER] = authorizer
    app[METRICS] = metrics
    app[EDGE] = _edge_state(settings, metrics, tracer, open_mode=authorizer is None)
    _add_routes(app, mode)
    app.cleanup_ctx.extend(RESOURCES)
    return app


def _edge_state(settings: Settings, metrics: Metrics, tracer: Tracer, open_mode: bool) -> EdgeState:
    """What the handlers read: the catalog, limits, the metrics as the edge's observer, the
    lifecycle, ledger, access log, tracer and (open mode) the Host check."""
    return EdgeState(
        catalog=EntityCatalog(settings.entities),
        limits=settings.limits,
        observer=metrics,
        lifecycle=Lifecycle(),
        ledger=create_ledger(ledger_settings(settings), replica=settings.replica_id),
        access_log=AccessLog(settings.log_format),
        tracer=tracer,
        # Open mode: only requests for a loopback name or a public host (DNS rebinding).
        host_check=(
            host_check(settings.public_hosts)
            if open_mode and is_loopback(settings.listen_host)
            else None
        ),
    )


def _set_entity_check(
    app: web.Application, check: Check | None, *, default: bool, credential: SharedCredential
) -> None:
    """`ENTITY_CHECK` for `gateway serve`: `check`, or with the real clients (`default`) the
    management API's listing; a test's or benchmark's fake namespaces have none to ask."""
    settings, plan = app[SETTINGS], app[PLAN]
    if check is None and default:
        check = default_entity_check(settings, credential, plan)
    if check is not None and plan.mode == "serve":
        app[ENTITY_CHECK] = check


def _name_the_server() -> None:
    """Every answer's ``Server`` header says ``sbgate``, not the Python and aiohttp versions
    (aiohttp's default, ``Python/3.11 aiohttp/3.x``: of use to nobody but a scanner). aiohttp
    reads the value from this module global when it prepares each answer's headers, so
    setting it costs nothing per request."""
    web_response.SERVER_SOFTWARE = "sbgate"  # type: ignore[attr-defined]


def _add_routes(app: web.Application, mode: Mode) -> None:
    if mode == "serve":
        handlers.add_routes(app)
        add_admin_routes(app)
    else:
        handlers.add_health_routes(app)
    app.router.add_get("/metrics", handlers.edge(_metrics_handler(app[METRICS])))
    add_openapi_route(app, serving=mode == "serve")
    if mode == "serve":
        handlers.add_not_ingestion_routes(app)  # last: it answers every other path


def edge_runner(app: web.Application, settings: Settings, **kwargs: Any) -> HardenedAppRunner:
    """The runner that serves `app` (one of `create_app`'s) on the listen port: the app's
    metrics observe its shedder and listener, and the shedder samples the app's loop lag.
    Keyword arguments go to `HardenedAppRunner` (and on to `web.AppRunner`)."""
    return HardenedAppRunner(
        app,
        settings=settings,
        observer=app.get(METRICS),
        loop_lag=LOOP_LAG,
        dispatcher=DISPATCHER,
        clients=CLIENTS,
        **kwargs,
    )


def _metrics_handler(metrics: Metrics) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``/metrics``, bound to `metrics` (the probe port's app serves the same handler)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def scrape(request: web.Request) -> web.StreamResponse:
        # In a worker thread: with thousands of entities a scrape renders tens of thousands
        # of series (seconds of CPU at 10,000 entities, docs/deploy.md#sizing), which on the
        # event loop would stall every send meanwhile. prometheus_client's values are
        # thread-safe.
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return scrape


# -- the resources, in start order ---------------------------------------------------------


async def access_log_ctx(app: web.Application) -> AsyncIterator[None]:
    """The access log's buffer, flushed once per loop turn; flushed last at shutdown."""
    access_log = app[EDGE].access_log
    access_log.bind(asyncio.get_running_loop())
    try:
        yield
    finally:
        access_log.close()


async def loop_lag_ctx(app: web.Application) -> AsyncIterator[None]:
    """The event loop's delay (`LOOP_LAG`), sampled for failover (a timeout of ours does not
    count) and the `sbgate_event_loop_lag_seconds` gauge."""
    lag = LoopLag(on_sample=app[METRICS].event_loop_lag.set)
    app[LOOP_LAG] = lag
    lag.start()
    try:
        yield
    finally:
        await lag.close()


async def tracer_ctx(app: web.Application) -> AsyncIterator[None]:
    """Nothing to start; closed last, so the spans of everything else's shutdown export."""
    try:
        yield
    finally:
        await close_tracer(app[EDGE].tracer)


async def credential_ctx(app: web.Application) -> AsyncIterator[None]:
    """Nothing to start (the credential is created on first use); closed after the clients."""
    try:
        yield
    finally:
        closer = Closer("credential")
        await closer.run("closing the credential", app[CREDENTIAL].aclose(), CLOSE_TIMEOUT)


async def clients_ctx(app: web.Application) -> AsyncIterator[None]:
    """One client per namespace (pairs may share one), closed after everything using them,
    in parallel (each bounds its own close)."""
    make = app[ADAPTERS].client
    clients: dict[str, NamespaceClient] = {}
    for pair in app[SETTINGS].pairs:
        for ns in (pair.primary, pair.secondary):
            if ns is not None and ns.name not in clients:
                clients[ns.name] = make(ns)
    app[CLIENTS] = clients
    try:
        yield
    finally:
        await asyncio.gather(*(client.close() for client in clients.values()))


async def state_ctx(app: web.Application) -> AsyncIterator[None]:
    """The state store replicas share, when failover or the syphon runs (`STORE`)."""
    metrics = app[METRICS]
    store = app[ADAPTERS].store(app[SETTINGS]) if app[PLAN].shared_state else None
    if store is None:
        metrics.redis_connected.set(1)  # nothing to be disconnected from
    else:
        if hasattr(store, "task_observer"):  # a store with loops of its own (Redis)
            store.task_observer = metrics
        fences = getattr(store, "fences", None)
        if fences is not None:  # before start: a resync tells of the fences it finds
            fences.subscribe_fences(metrics.fence_changed)
        await store.start()
        app[STORE] = store
        if fences is not None:
            app[FENCES] = fences
        metrics.redis_connected.set_function(lambda: 1.0 if store.connected else 0.0)
        if isinstance(store, LocalState):
            metrics.bind_state(store.stats)
    try:
        yield
    finally:
        if store is not None:
            await store.close()


async def ledger_ctx(app: web.Application) -> AsyncIterator[None]:
    """The event ledger: flushed and closed after everything that emits."""
    edge = app[EDGE]
    app[METRICS].bind_ledger(edge.ledger)
    edge.ledger.task_observer = app[METRICS]  # its writer is supervised
    async with edge.ledger:
        yield


async def dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
    """The dispatcher (`DISPATCHER`), and each pair's clients and usable backlog queues
    (`PAIRS`, checked or created now). No sender is opened here: an entity's senders open on
    its first sends (docs/deploy.md#sizing), so start-up costs nothing per declared entity."""
    settings, edge, clients = app[SETTINGS], app[EDGE], app[CLIENTS]
    dispatcher = Dispatcher(
        settings.limits,
        settings.timeouts,
        observer=app[METRICS],
        tracer=edge.tracer,
        loop_lag=app[LOOP_LAG],  # started before (loop_lag_ctx)
    )
    app[DISPATCHER] = dispatcher
    app[METRICS].bind_admission(lambda: dispatcher.gate.waiting, lambda: dispatcher.gate.used)
    app[METRICS].bind_links(
        lambda: dispatcher.open_senders, lambda: _open_connections(clients.values())
    )
    pairs: dict[str, PairClients] = {}
    if app[PLAN].shared_state:
        pairs = await _pair_clients(settings, clients, app[ADAPTERS].provision)
    app[PAIRS] = pairs
    try:
        yield
    finally:
        await dispatcher.close(grace=DISPATCHER_GRACE)


async def router_ctx(app: web.Application) -> AsyncIterator[None]:
    """Where requests go (`ROUTER`): the failover router, started (`FAILOVER`), or always
    the primary."""
    settings, edge, dispatcher = app[SETTINGS], app[EDGE], app[DISPATCHER]
    failover = None
    if app[PLAN].failover:
        failover = Failover(
            dispatcher,
            app[PAIRS],
            app[STORE],
            settings.failover,
            settings.limits,
            observer=app[METRICS],
            ledger=edge.ledger,
            loop_lag=app[LOOP_LAG],
            timeouts=settings.timeouts,
            fences=app.get(FENCES),
        )
        app[ROUTER] = app[FAILOVER] = failover
        failover.start(edge.catalog.all())
    else:
        app[ROUTER] = PrimaryRouter(dispatcher, _primaries(settings, app[CLIENTS]))
    try:
        yield
    finally:
        if failover is not None:
            await failover.close()


async def syphon_ctx(app: web.Application) -> AsyncIterator[None]:
    """The syphon workers (`SYPHONS`), one per pair with usable backlog queues; `gateway
    syphon` is not ready for a while after a namespace fault."""
    settings = app[SETTINGS]
    syphons = _start_syphons(app) if app[PLAN].syphon else []
    app[SYPHONS] = syphons
    if app[PLAN].mode == "syphon":
        app[EDGE].lifecycle.checks.append(_syphon_health(syphons, settings))
    try:
        yield
    finally:
        grace = min(settings.shutdown.shutdown_timeout, settings.timeouts.send_timeout)
        # A syphon's close waits for its tasks and its receivers' closes (SDK closes, which
        # can hang): bounded here too, and cancelled past the bound.
        closes = [
            asyncio.create_task(s.close(grace), name=f"closing syphon {i}")
            for i, s in enumerate(syphons)
        ]
        bound = grace + settings.timeouts.send_timeout + CLOSE_TIMEOUT - CANCEL_GRACE
        await stop_after(closes, bound, "syphon")


async def presence_ctx(app: web.Application) -> AsyncIterator[None]:
    """The check that every configured entity exists at its primary (`PRESENCE`), when the
    app has one: started now (its first look runs in the background: start-up does not wait
    on the management API), closed before the clients."""
    check = app.get(ENTITY_CHECK)
    if check is None:
        yield
        return
    presence = EntityPresence(app[EDGE].catalog.all(), check, observer=app[METRICS])
    app[PRESENCE] = presence
    failover = app.get(FAILOVER)
    if failover is not None:  # a send that finds an entity missing asks for a check now
        failover.on_entity_not_found = presence.recheck
    presence.start()
    try:
        yield
    finally:
        await presence.close()


async def lifecycle_ctx(app: web.Application) -> AsyncIterator[None]:
    """Last: ready once everything above started; draining as soon as cleanup begins."""
    edge = app[EDGE]
    lifecycle = edge.lifecycle
    lifecycle.started = True
    app[METRICS].ready.set_function(lambda: 1.0 if lifecycle.ready else 0.0)
    # `gateway ready` is the CLI's line, once its sockets listen; this is the app's.
    log.debug("app started", extra={"entities": [e.path for e in edge.catalog.all()]})
    yield
    lifecycle.draining = True


AMQP_SERVER = web.AppKey("amqp_server", AmqpServer)


async def amqp_ctx(app: web.Application) -> AsyncIterator[None]:
    """The AMQP edge (`AMQP_SERVER`), when a listener is configured; drained before the
    router closes (registered after it)."""
    settings = app[SETTINGS]
    if not settings.amqp.enabled or app[PLAN].mode != "serve":
        yield
        return
    scheduler = amqp_scheduler(app)
    server = AmqpServer(
        settings,
        app[EDGE],
        app[ROUTER],
        authorizer=app.get(AUTHORIZER),
        gate=app[DISPATCHER].gate,
        scheduler=scheduler,
    )
    await server.start()
    app[AMQP_SERVER] = server
    app[EDGE].observer.bind_amqp(lambda: server.connections)
    try:
        yield
    finally:
        await server.close()
        if scheduler is not None:
            await scheduler.close()  # what outlived its close bound (2 * CANCEL_GRACE)


# Start order; aiohttp cleans up in reverse, so each resource outlives its users: the
# credential its clients, the clients the dispatcher, the ledger everything that emits, the
# access log every request.
RESOURCES: Final = (
    access_log_ctx,
    loop_lag_ctx,
    tracer_ctx,
    credential_ctx,
    clients_ctx,
    state_ctx,
    ledger_ctx,
    dispatcher_ctx,
    router_ctx,
    amqp_ctx,
    syphon_ctx,
    presence_ctx,
    lifecycle_ctx,
)


# -- helpers -------------------------------------------------------------------------------


def _primaries(
    settings: Settings, clients: Mapping[str, NamespaceClient]
) -> dict[str, NamespaceClient]:
    """Each pair's primary client, by pair name."""
    return {p.name: clients[p.primary.name] for p in settings.pairs}


def _open_connections(clients: Iterable[NamespaceClient]) -> int:
    """AMQP connections the namespace clients' pools hold open (adapters without a pool,
    such as the null client, count none)."""
    total = 0
    for client in clients:
        pool = getattr(client, "pool", None)
        if pool is not None:
            total += pool.open_connections()
    return total


def amqp_scheduler(app: web.Application) -> SdkScheduler | None:
    """The AMQP edge's scheduling at the primaries (gateway.servicebus.schedule): only with
    the SDK's clients, and only for an entity that failover has on its primary."""
    from gateway.servicebus.client import SdkNamespaceClient
    from gateway.servicebus.schedule import SdkScheduler

    settings, clients = app[SETTINGS], app[CLIENTS]
    primaries = {p.name: clients[p.primary.name] for p in settings.pairs}
    sdk = {name: c for name, c in primaries.items() if isinstance(c, SdkNamespaceClient)}
    if len(sdk) != len(primaries):
        return None
    store = app.get(STORE) if app[PLAN].failover else None

    def healthy(entity: EntityRef) -> bool:
        return store is None or store.get(entity.path.lower()).status == "healthy"

    return SdkScheduler(sdk, settings.timeouts, healthy)


def _start_syphons(app: web.Application) -> list[Syphon]:
    settings, edge, clients = app[SETTINGS], app[EDGE], app[CLIENTS]
    syphons: list[Syphon] = []
    for p in settings.pairs:
        pc = app[PAIRS].get(p.name)
        if p.secondary is None or pc is None or not pc.backlog_queues:
            continue
        port = app[ADAPTERS].backlog(p.secondary, clients[p.secondary.name])
        if port is None:
            log.warning("pair %s: no backlog receiver available; syphon off", p.name)
            continue
        syphon = Syphon(
            backlog=port,
            queues=pc.backlog_queues,
            dispatcher=app[DISPATCHER],
            primary=pc.primary,
            entities=[e.path for e in settings.entities if e.pair == p.name],
            store=app.get(STORE),
            settings=settings.syphon,
            timeouts=settings.timeouts,
            observer=app[METRICS],
            ledger=edge.ledger,
            tracer=edge.tracer,
            fences=app.get(FENCES),
        )
        syphon.start()
        syphons.append(syphon)
    return syphons


async def _pair_clients(
    settings: Settings, clients: Mapping[str, NamespaceClient], provision: Provisioner
) -> dict[str, PairClients]:
    """Each pair's clients and its usable backlog queues (checked/created now)."""
    out: dict[str, PairClients] = {}
    for p in settings.pairs:
        queues: list[str] = []
        if p.secondary is not None:
            wanted = [
                backlog_path(p.primary.name, i)
                for i in range(settings.failover.backlog_queue_count)
            ]
            queues = await provision(p.secondary, wanted)
            if not queues:
                log.error(
                    "pair %s: no usable backlog queue; failover cannot engage for its entities",
                    p.name,
                )
        out[p.name] = PairClients(
            primary=clients[p.primary.name],
            secondary=clients[p.secondary.name] if p.secondary is not None else None,
            backlog_queues=tuple(queues),
        )
    return out


def _syphon_health(syphons: list[Syphon], settings: Settings) -> Callable[[], str | None]:
    """`gateway syphon` readiness: not ready for a while after a namespace fault."""

    def check() -> str | None:
        now = time.time()
        for s in syphons:
            if (
                s.last_fault is not None
                and now - s.last_fault < settings.syphon.fault_unready_seconds
            ):
                return "namespace fault"
        return None

    return check


def ledger_settings(settings: Settings) -> LedgerSettings:
    """``ledger = off | stdout | <directory>`` as the ledger's own settings."""
    if settings.ledger == "off":
        return LedgerSettings()
    if settings.ledger == "stdout":
        return LedgerSettings(sink="stdout")
    return LedgerSettings(
        sink="dir", directory=Path(settings.ledger), compress=settings.ledger_compress
    )


# -- the default adapters ---------------------------------------------------------------------


def default_client_factory(
    settings: Settings,
    credential: SharedCredential,
    observer: TaskObserver | None = None,
    **sdk_kwargs: Any,
) -> ClientFactory:
    """SDK clients; namespaces given by name share `credential` (created on first use; its
    owner closes it); `observer` counts their connection readers' restarts. `sdk_kwargs` go
    to each `ServiceBusClient` (tests: ``use_tls=False``).

    Installs the SDK seam's process-wide pyamqp patches (`gateway.servicebus.internals`)
    first, before any client exists: the pool shares connections only with them, and the
    syphon's receivers, on these clients' connections, run on them too. A no-op on an SDK
    other than the pinned one."""
    from gateway.servicebus import internals as sdk_internals
    from gateway.servicebus.client import SdkNamespaceClient

    sdk_internals.install()

    def make(ns: NamespaceSettings) -> NamespaceClient:
        token = credential.get() if ns.connection_string is None else None
        client = SdkNamespaceClient(
            ns,
            settings.timeouts,
            credential=token,
            connections=settings.limits.connections_per_namespace,
            observer=observer,
            **sdk_kwargs,
        )
        for e in settings.entities:
            if e.kind == "topic" and settings.pair(e.pair).primary.name == ns.name:
                client.mark_topic(e.path)
        return client

    return make


def default_store_factory(settings: Settings) -> StateStore:
    """Redis when ``redis_url`` is set, else the in-process store (single replica)."""
    if settings.redis_url is not None:
        from gateway.state.redis import RedisStateStore

        return RedisStateStore(redis_target(settings), settings.replica_id)
    from gateway.state.memory import MemoryStateStore

    return MemoryStateStore(settings.replica_id)


def redis_target(settings: Settings) -> RedisTarget:
    """How the state store reaches Redis (`redis_url` must be set). With `redis_credential`
    the store owns an Entra ID credential of that kind, apart from Service Bus's (its
    tokens are for another scope, and it is closed with the store)."""
    from gateway.servicebus.identity import create_credential
    from gateway.state.connect import RedisTarget
    from gateway.state.entra import EntraIdCredentials

    assert settings.redis_url is not None
    provider = None
    if settings.redis_credential != "none":
        try:
            credential = create_credential(settings.redis_credential, settings.azure_client_id)
        except ValueError as exc:
            raise ConfigError(f"redis_credential={settings.redis_credential}: {exc}") from None
        provider = EntraIdCredentials(credential)
    try:
        return RedisTarget(
            settings.redis_url.get(),
            mode=settings.redis_mode,
            ca_file=settings.redis_ca_file,
            credential_provider=provider,
        )
    except ValueError as exc:
        raise ConfigError(f"redis_url / redis_mode: {exc}") from None


def shared_credential(settings: Settings) -> SharedCredential:
    return SharedCredential(settings.azure_credential, settings.azure_client_id)


def default_provisioner(settings: Settings, credential: SharedCredential) -> Provisioner:
    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        from gateway.servicebus.admin import ensure_backlog_queues

        result = await ensure_backlog_queues(
            ns,
            paths,
            create=settings.failover.create_backlog_queues,
            deadline=settings.timeouts.connect_timeout,
            credential=credential.get() if ns.connection_string is None else None,
        )
        return result.usable

    return provision


def default_entity_check(settings: Settings, credential: SharedCredential, plan: Plan) -> Check:
    """Lists each pair's primary namespace (management API) for its configured entities."""

    async def check(entities: Sequence[EntityRef]) -> dict[str, str]:
        from gateway.servicebus.admin import missing_entities

        out: dict[str, str] = {}
        for pair in settings.pairs:
            ns = pair.primary
            mine = [(e.path, e.kind) for e in entities if e.pair == pair.name]
            if not mine:
                continue
            token = credential.get() if ns.connection_string is None else None
            missing = await missing_entities(
                ns, mine, deadline=settings.timeouts.connect_timeout, credential=token
            )
            kinds = dict(mine)
            for path in missing:
                out[path] = _missing_reason(ns, path, kinds[path], plan.failover)
        return out

    return check


def _missing_reason(ns: NamespaceSettings, path: str, kind: str, parked: bool) -> str:
    """What the missing-entity line and `GET /admin/entities` say: what, where, what to do,
    and what a send gets meanwhile (docs/failover.md#an-entity-the-primary-lacks)."""
    local = ns.connection_string is not None and (
        "usedevelopmentemulator=true" in ns.connection_string.get().lower()
    )
    create = "create it there, or correct SBGATE_ENTITIES"
    if local:  # the local broker (make run): its control API creates entities
        body = f'{{"path": "{path}", "kind": "{kind}"}}'
        create = (
            f"create it (local broker: curl -X POST $CTRL/namespaces/{ns.name}/entities "
            f"-d '{body}'), or correct SBGATE_ENTITIES"
        )
    meanwhile = (
        "until then its messages are parked in the backlog queues (202) and move home once "
        "it exists"
        if parked
        else "until then sends to it are refused (503 upstream_entity_not_found)"
    )
    return f"the {kind} does not exist at the primary namespace {ns.name}: {create}; {meanwhile}"


def default_backlog_factory(ns: NamespaceSettings, client: NamespaceClient) -> BacklogPort | None:
    from gateway.servicebus.client import SdkNamespaceClient
    from gateway.servicebus.receiver import SdkBacklogPort

    if isinstance(client, SdkNamespaceClient):
        return SdkBacklogPort(client.sdk_client, ns, client.credential)
    return None
