"""The app factory, shared by `gateway serve` and the tests.

Resources are `cleanup_ctx` generators with exactly one `yield`: started in order, cleaned
up in reverse. Only this module (and the CLI) knows the concrete adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from gateway.config import NamespaceSettings, Settings
from gateway.core.backlog import backlog_path
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.entities import EntityCatalog
from gateway.core.failover import Failover, PairClients
from gateway.core.ports import NamespaceClient
from gateway.core.router import PrimaryRouter
from gateway.ledger import EventLedger, LedgerSettings, NullLedger, create_ledger
from gateway.metrics import Metrics
from gateway.servicebus.identity import SharedCredential
from gateway.state.base import StateStore
from gateway.syphon.ports import BacklogPort
from gateway.syphon.syphon import Syphon
from gateway.web import handlers
from gateway.web.admin import FAILOVER, add_admin_routes
from gateway.web.auth import AUTHORIZER, build_authorizer
from gateway.web.handlers import EDGE, ROUTER, EdgeState, Lifecycle
from gateway.web.openapi import add_openapi_route

log = logging.getLogger(__name__)

ClientFactory = Callable[[NamespaceSettings], NamespaceClient]
StoreFactory = Callable[[Settings], StateStore]
BacklogFactory = Callable[[NamespaceSettings, NamespaceClient], BacklogPort | None]
Provisioner = Callable[[NamespaceSettings, list[str]], Awaitable[list[str]]]


@dataclass
class Runtime:
    """The live objects of one app, for the CLI, the admin API and tests."""

    settings: Settings
    metrics: Metrics
    lifecycle: Lifecycle
    catalog: EntityCatalog
    clients: dict[str, NamespaceClient] = field(default_factory=dict)
    dispatcher: Dispatcher | None = None
    store: StateStore | None = None
    failover: Failover | None = None
    pair_clients: dict[str, PairClients] = field(default_factory=dict)
    syphons: list[Syphon] = field(default_factory=list)
    ledger: EventLedger = field(default_factory=NullLedger)
    credential: SharedCredential | None = None  # the process's one Entra ID credential


RUNTIME = web.AppKey("runtime", Runtime)


def default_client_factory(
    settings: Settings, credential: SharedCredential, **sdk_kwargs: Any
) -> ClientFactory:
    """SDK clients; namespaces given by name share `credential` (created on first use; its
    owner closes it). `sdk_kwargs` go to each `ServiceBusClient` (tests: ``use_tls=False``)."""
    from gateway.servicebus.client import SdkNamespaceClient

    def make(ns: NamespaceSettings) -> NamespaceClient:
        token = credential.get() if ns.connection_string is None else None
        client = SdkNamespaceClient(ns, settings.timeouts, credential=token, **sdk_kwargs)
        for e in settings.entities:
            if e.kind == "topic" and settings.pair(e.pair).primary.name == ns.name:
                client.mark_topic(e.path)
        return client

    return make


def default_store_factory(settings: Settings) -> StateStore:
    """Redis when ``redis_url`` is set, else the in-process store (single replica)."""
    if settings.redis_url is not None:
        from gateway.state.redis import RedisStateStore

        return RedisStateStore(settings.redis_url.get(), settings.replica_id)
    from gateway.state.memory import MemoryStateStore

    return MemoryStateStore(settings.replica_id)


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


def default_backlog_factory(ns: NamespaceSettings, client: NamespaceClient) -> BacklogPort | None:
    from gateway.servicebus.client import SdkNamespaceClient
    from gateway.servicebus.receiver import SdkBacklogPort

    if isinstance(client, SdkNamespaceClient):
        return SdkBacklogPort(client.sdk_client, ns, client.credential)
    return None


def create_app(
    settings: Settings,
    *,
    mode: Literal["serve", "syphon"] = "serve",
    client_factory: ClientFactory | None = None,
    store_factory: StoreFactory | None = None,
    provisioner: Provisioner | None = None,
    backlog_factory: BacklogFactory | None = None,
    metrics: Metrics | None = None,
    credential: SharedCredential | None = None,
) -> web.Application:
    """Build the gateway's aiohttp application from validated `settings`.

    `mode="syphon"` serves only /healthz, /readyz and /metrics and runs the syphon pool
    (`gateway syphon`). The keyword arguments replace adapters at their ports (tests,
    benchmarks). The app owns `credential` (default: one from the settings) and closes it at
    shutdown, after the clients."""
    metrics = metrics or Metrics()
    lifecycle = Lifecycle()
    catalog = EntityCatalog(settings.entities)
    rt = Runtime(settings=settings, metrics=metrics, lifecycle=lifecycle, catalog=catalog)
    rt.ledger = create_ledger(ledger_settings(settings), replica=settings.replica_id)
    # One credential for every SDK client and the admin client of this process.
    rt.credential = credential or shared_credential(settings)
    make_client = client_factory or default_client_factory(settings, rt.credential)
    make_store = store_factory or default_store_factory
    provision = provisioner or default_provisioner(settings, rt.credential)
    make_backlog = backlog_factory or default_backlog_factory
    paired = any(p.secondary for p in settings.pairs)
    failover_on = mode == "serve" and settings.failover.enabled and paired
    syphon_on = paired and (mode == "syphon" or settings.syphon.enabled)

    app = web.Application(
        middlewares=[handlers.edge_middleware],
        client_max_size=settings.limits.max_body_bytes,
        handler_args={"max_field_size": settings.limits.max_header_bytes},
    )
    app[RUNTIME] = rt
    authorizer = build_authorizer(settings)
    if authorizer is not None:
        app[AUTHORIZER] = authorizer
    app[EDGE] = EdgeState(
        catalog=catalog,
        limits=settings.limits,
        metrics=metrics,
        lifecycle=lifecycle,
        ledger=rt.ledger,
    )
    if mode == "serve":
        handlers.add_routes(app)
        add_admin_routes(app)
    else:
        handlers.add_health_routes(app)
    app.router.add_get("/metrics", _metrics_handler)
    add_openapi_route(app, serving=mode == "serve")
    if mode == "serve":
        handlers.add_not_ingestion_routes(app)  # last: it answers every other path

    async def credential_ctx(app: web.Application) -> AsyncIterator[None]:
        # Before the clients, so it is closed after them (cleanup runs in reverse).
        assert rt.credential is not None
        try:
            yield
        finally:
            await rt.credential.aclose()

    async def clients_ctx(app: web.Application) -> AsyncIterator[None]:
        for pair in settings.pairs:
            for ns in (pair.primary, pair.secondary):
                if ns is not None and ns.name not in rt.clients:
                    rt.clients[ns.name] = make_client(ns)
        try:
            yield
        finally:
            for client in rt.clients.values():
                await client.close()

    async def state_ctx(app: web.Application) -> AsyncIterator[None]:
        if not (failover_on or syphon_on):
            metrics.redis_connected.set(1)
            yield
            return
        store = make_store(settings)
        rt.store = store
        await store.start()
        metrics.redis_connected.set_function(lambda: 1.0 if store.connected else 0.0)
        try:
            yield
        finally:
            await store.close()

    async def ledger_ctx(app: web.Application) -> AsyncIterator[None]:
        metrics.bind_ledger(rt.ledger)
        async with rt.ledger:  # flushed and closed after everything that emits
            yield

    async def dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
        dispatcher = Dispatcher(settings.limits, settings.timeouts, observer=metrics)
        rt.dispatcher = dispatcher
        metrics.bind_admission(lambda: dispatcher.gate.waiting, lambda: dispatcher.gate.used)
        primaries = {p.name: rt.clients[p.primary.name] for p in settings.pairs}
        warm = dispatcher.warm(Destination(primaries[e.pair], e.path) for e in catalog.all())
        if failover_on or syphon_on:
            # Opening senders and checking backlog queues both take a while: in parallel.
            rt.pair_clients, warmed = await asyncio.gather(
                _pair_clients(settings, rt.clients, provision), warm
            )
        else:
            warmed = await warm
        if failover_on:
            assert rt.store is not None
            failover = Failover(
                dispatcher,
                rt.pair_clients,
                rt.store,
                settings.failover,
                settings.limits,
                observer=metrics,
                ledger=rt.ledger,
            )
            rt.failover = failover
            app[ROUTER] = failover
            app[FAILOVER] = failover
        else:
            app[ROUTER] = PrimaryRouter(dispatcher, primaries)
        for dest, err in warmed.items():
            if err:
                log.warning("could not open senders for %s yet: %s", dest, err)
        if rt.failover is not None:
            rt.failover.start(catalog.all())
        try:
            yield
        finally:
            if rt.failover is not None:
                await rt.failover.close()
            await dispatcher.close(grace=5.0)

    async def syphon_ctx(app: web.Application) -> AsyncIterator[None]:
        if syphon_on:
            assert rt.dispatcher is not None
            for p in settings.pairs:
                pc = rt.pair_clients.get(p.name)
                if p.secondary is None or pc is None or not pc.backlog_queues:
                    continue
                port = make_backlog(p.secondary, rt.clients[p.secondary.name])
                if port is None:
                    log.warning("pair %s: no backlog receiver available; syphon off", p.name)
                    continue
                syphon = Syphon(
                    backlog=port,
                    queues=pc.backlog_queues,
                    dispatcher=rt.dispatcher,
                    primary=pc.primary,
                    store=rt.store,
                    settings=settings.syphon,
                    timeouts=settings.timeouts,
                    observer=metrics,
                    ledger=rt.ledger,
                )
                syphon.start()
                rt.syphons.append(syphon)
            if mode == "syphon":
                lifecycle.checks.append(_syphon_health(rt.syphons, settings))
        try:
            yield
        finally:
            grace = min(settings.shutdown.shutdown_timeout, settings.timeouts.send_timeout)
            await asyncio.gather(*(s.close(grace) for s in rt.syphons))

    async def lifecycle_ctx(app: web.Application) -> AsyncIterator[None]:
        lifecycle.started = True
        metrics.ready.set_function(lambda: 1.0 if lifecycle.ready else 0.0)
        log.info("gateway ready", extra={"entities": [e.path for e in catalog.all()]})
        yield
        lifecycle.draining = True

    app.cleanup_ctx.append(credential_ctx)
    app.cleanup_ctx.extend(
        [clients_ctx, state_ctx, ledger_ctx, dispatcher_ctx, syphon_ctx, lifecycle_ctx]
    )
    return app


async def _metrics_handler(request: web.Request) -> web.StreamResponse:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    body = generate_latest(request.app[RUNTIME].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def primary_clients(rt: Runtime) -> Mapping[str, NamespaceClient]:
    return {p.name: rt.clients[p.primary.name] for p in rt.settings.pairs}


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
