"""The AMQP edge's listeners, caps and shutdown (its cleanup context, `amqp_ctx`, is the app's).

Two listeners, each optional: TLS (``amqp.port``, 5671 by default; certificate and key read
again when either file changes) and plain TCP (``amqp.plain_port``; loopback unless said
otherwise). Both run `AmqpConnection`s on the app's event loop, sharing its router,
catalog, authorizer, metrics, ledger and access log (`gateway.ingest`).

Shutdown (`AmqpServer.close`): the listeners stop accepting, every link's credit goes to 0,
the deliveries in flight finish (bounded), and every connection is closed with
`amqp:connection:forced`, which the SDKs answer by reconnecting on their next send. The
context is registered after the router's, so it drains before the router and the
dispatcher close (aiohttp cleans up in reverse order).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import ssl
import time
from typing import Any

from gateway.accepting import Acceptor
from gateway.amqp.connection import AmqpConnection
from gateway.amqp.management import Scheduler
from gateway.auth import AuthConfigError, Authorizer
from gateway.auth.sas import parse_host_entry
from gateway.config import AmqpSettings, ConfigError, LimitSettings, Settings
from gateway.core.admission import AdmissionGate
from gateway.core.router import Router
from gateway.ingest import EdgeState
from gateway.lifetimes import CANCEL_GRACE, stop_after
from sbamqp.engine import Limits

log = logging.getLogger(__name__)

# Seconds the client gets to answer our close before the socket is dropped.
CLOSE_GRACE = 2.0
# Admission used beyond this share: links are topped up no more (`AmqpConnection._replenish`).
HIGH_WATER = 0.9
# The deliveries the edge holds (read, not settled), against the dispatcher's pending bytes:
# those admitted, and as many waiting for admission (`AmqpServer.held_bytes`).
HELD_BYTES_FACTOR = 2
# How often, at most, a TLS handshake looks at the certificate files' modification times.
CERT_CHECK_INTERVAL = 1.0


class AmqpServer:
    """The listeners and the open connections (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        edge: EdgeState,
        router: Router,
        *,
        authorizer: Authorizer | None = None,
        gate: AdmissionGate | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.settings: AmqpSettings = settings.amqp
        self.settings_limits: LimitSettings = settings.limits
        self.edge = edge
        self.router = router
        self.authorizer = authorizer
        self.scheduler = scheduler  # None: scheduling is refused (501)
        self._gate = gate
        self._drain_bound = drain_bound(settings)
        self._listen_host = settings.listen_host
        amqp = settings.amqp
        self.limits = Limits(
            max_frame_size=amqp.max_frame_size,
            channel_max=amqp.max_sessions - 1,
            max_sessions=amqp.max_sessions,
            handle_max=amqp.max_links - 1,
            max_links=amqp.max_links,
            # A batch transfer is one delivery of up to max_batch_bytes (its envelope aside).
            max_message_size=settings.limits.max_batch_bytes,
            handshake_timeout=amqp.handshake_timeout,
            idle_timeout=amqp.idle_timeout or None,
            close_grace=CLOSE_GRACE,
            container_id=f"sbgate-{settings.replica_id}",
        )
        self._hosts = _hosts(settings)
        self._connections: set[AmqpConnection] = set()
        # Deliveries of connections that were lost before they settled: still ours to await.
        self._orphans: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.Server] = []
        # Connections taken from the accept queues a batch at a time, while under the cap
        # (the loop alone takes one a turn: a fleet of clients reconnecting at once after a
        # restart would wait in the queue, or have its connects dropped when it is full).
        self._acceptor = Acceptor("AMQP", room=self._has_room_for_connections)
        self._tls: _ReloadingContext | None = None
        self.draining = False
        self.ports: dict[str, int] = {}  # listener → bound port (tests bind port 0)
        # Bytes of the deliveries read and not yet settled, on every connection: at most
        # HELD_BYTES_FACTOR x the dispatcher's pending bytes, whatever the links' credit (a
        # client may send past it, and the credit of every link adds up).
        self.held_bytes = 0
        self.held_bytes_cap = HELD_BYTES_FACTOR * settings.limits.max_pending_bytes

    # -- listeners ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the configured listeners. Raises `ConfigError` (a certificate without its
        key, or one that does not load), OSError (a port in use)."""
        loop = asyncio.get_running_loop()
        amqp = self.settings
        if bool(amqp.tls_cert_file) != bool(amqp.tls_key_file):
            raise ConfigError("amqp.tls_cert_file and amqp.tls_key_file go together")
        if amqp.tls_cert_file and amqp.tls_key_file:
            try:
                self._tls = _ReloadingContext(amqp.tls_cert_file, amqp.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"amqp.tls_cert_file / amqp.tls_key_file: {exc}") from None
            server = await loop.create_server(
                lambda: AmqpConnection(self, "tls"),
                amqp.host or self._listen_host,
                amqp.port,
                ssl=self._tls.context,
                ssl_handshake_timeout=amqp.handshake_timeout,
                backlog=256,
            )
            self._servers.append(server)
            self._acceptor.watch(
                server.sockets,
                lambda: AmqpConnection(self, "tls"),
                ssl_context=self._tls.context,
                ssl_handshake_timeout=amqp.handshake_timeout,
            )
            self.ports["tls"] = _port(server)
        if amqp.plain_port:
            server = await loop.create_server(
                lambda: AmqpConnection(self, "plain"), amqp.plain_host, amqp.plain_port
            )
            self._servers.append(server)
            self._acceptor.watch(server.sockets, lambda: AmqpConnection(self, "plain"))
            self.ports["plain"] = _port(server)
        for name, port in self.ports.items():
            log.info("AMQP %s listener on port %d", name, port)

    def admit(self, connection: AmqpConnection) -> bool:
        """Count a new connection in; False (to be closed) over the cap or while draining."""
        if self.draining or len(self._connections) >= self.settings.max_connections:
            log.warning("AMQP connection refused: %d open (cap)", len(self._connections))
            self.edge.observer.amqp_refused("connection")
            return False
        self._connections.add(connection)
        return True

    def _has_room_for_connections(self) -> bool:
        """Worth taking queued connections a batch at a time: under the cap, counting those
        still in their TLS handshake, and not draining (over it, the loop's one-a-turn accept
        brings each to `admit`, which closes it)."""
        taken = len(self._connections) + self._acceptor.pending
        return not self.draining and taken < self.settings.max_connections

    def forget(self, connection: AmqpConnection, tasks: set[asyncio.Task[None]]) -> None:
        """A connection is gone; its deliveries still in flight finish, owned here."""
        self._connections.discard(connection)
        for task in tasks:
            if not task.done():
                self._orphans.add(task)
                task.add_done_callback(self._orphans.discard)

    @property
    def connections(self) -> int:
        return len(self._connections)

    # -- what connections ask -------------------------------------------------------------

    def has_room(self) -> bool:
        """Below the admission high-water mark, nobody waiting: links may get more credit."""
        gate = self._gate
        if gate is None:
            return True
        return gate.waiting == 0 and gate.used < gate.capacity * HIGH_WATER

    def serves_host(self, hostname: str) -> bool:
        """The open's hostname is a public host or a loopback name."""
        try:
            host = parse_host_entry(hostname)[0]
        except AuthConfigError:
            return False
        return _is_loopback(host) or host in self._hosts

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Drain (see the module docstring): at most `drain_bound` plus the close grace and
        two cancel graces."""
        self.draining = True
        for server in self._servers:
            server.close()
        await self._acceptor.stop(CANCEL_GRACE)  # its hand-overs end first (TLS: a grace)
        connections = list(self._connections)
        for c in connections:
            c.stop_credit()
        tasks = [t for c in connections for t in c.tasks] + list(self._orphans)
        if tasks:
            log.info("AMQP drain: %d deliveries in flight", len(tasks))
        await stop_after(tasks, self._drain_bound, "AMQP drain")
        for c in connections:
            c.close("the gateway is shutting down")
        lost = [asyncio.ensure_future(c.lost.wait()) for c in connections]
        if lost:
            _done, pending = await asyncio.wait(lost, timeout=CLOSE_GRACE + CANCEL_GRACE)
            for c in connections:
                if not c.lost.is_set():
                    c.abort()
            for waiter in pending:
                waiter.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CANCEL_GRACE):
                    await server.wait_closed()


def drain_bound(settings: Settings) -> float:
    """How long the drain waits for deliveries in flight: a delivery ends within admission
    and one send (a backlog send after a failed primary one is inside it too: the
    dispatcher's own deadline), and never longer than the shutdown timeout."""
    timeouts = settings.timeouts
    return min(
        settings.shutdown.shutdown_timeout,
        settings.limits.admission_timeout + 2 * timeouts.send_timeout + CANCEL_GRACE,
    )


def _port(server: asyncio.Server) -> int:
    sockets = server.sockets
    return int(sockets[0].getsockname()[1]) if sockets else 0


def _hosts(settings: Settings) -> frozenset[str]:
    """The host names an open may name (ports do not matter: the SDKs send none)."""
    entries: list[Any] = [*settings.public_hosts, settings.listen_host, "localhost", "127.0.0.1"]
    hosts = set()
    for entry in entries:
        with contextlib.suppress(AuthConfigError):
            hosts.add(parse_host_entry(entry)[0])
    return frozenset(hosts)


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _ReloadingContext:
    """A server SSLContext whose certificate is loaded again when its files change.

    Each handshake's SNI callback looks at the files' modification times (at most once a
    second) and, when they changed, hands that handshake — and every later one — a new
    context with the new certificate; open connections keep theirs. A certificate that
    fails to load is logged and the last good one stays."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._stamp = self._mtimes()
        self._checked = time.monotonic()
        self._current = self._load()
        self.context = self._current
        self.context.sni_callback = self._on_sni

    def _mtimes(self) -> tuple[float, float]:
        try:
            return (os.stat(self._cert_file).st_mtime, os.stat(self._key_file).st_mtime)
        except OSError:
            return (0.0, 0.0)

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self._cert_file, self._key_file)
        return ctx

    def _on_sni(self, sock: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        now = time.monotonic()
        if now - self._checked >= CERT_CHECK_INTERVAL:
            self._checked = now
            stamp = self._mtimes()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    fresh = self._load()
                except (OSError, ssl.SSLError) as exc:
                    log.error("AMQP TLS: cannot load the new certificate: %s", exc)
                else:
                    log.info("AMQP TLS: certificate reloaded from %s", self._cert_file)
                    self._current = fresh
        if self._current is not self.context:
            sock.context = self._current
