"""`LocalBroker`: the whole broker in one object (AMQP reactor thread + HTTP servers).

Use it in-process for fast tests::

    async with LocalBroker(default_config()) as broker:
        conn_str = broker.connection_string("primary")

or run it as a process with ``python -m sblocal`` (see `sblocal.testing.BrokerProcess`).

Threads and loops: `start()` must be awaited on the asyncio loop that will serve the control
API and the management (HTTPS) API; the AMQP reactor gets its own thread. `stop()` closes the
HTTP sites first (no new control calls), then stops the reactor (joined in a worker thread so
the loop is never blocked), then closes durable storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import shutil
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sblocal.amqp import AmqpServer, NamespaceRuntime
from sblocal.config import DEV_KEY_NAME, DEV_KEY_VALUE, BrokerConfig, default_config
from sblocal.control import create_control_app
from sblocal.persistence import Persistence
from sblocal.store import Namespace

if TYPE_CHECKING:
    from sblocal.testing import ControlClient

_log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT = 5.0

# create_management_app(registry, *, keys=None): keys are the namespace's SAS keys.
ManagementAppFactory = Callable[..., web.Application]
CertFactory = Callable[[Path], tuple[Path | str, Path | str]]


def _management_support() -> tuple[ManagementAppFactory, CertFactory] | None:
    """The HTTPS management API lives in `sblocal.management` + `sblocal.certs`.

    They are optional at import time so that the AMQP side runs without them; when either
    module is missing the broker simply serves no management endpoint.
    """
    try:
        management = importlib.import_module("sblocal.management")
        certs = importlib.import_module("sblocal.certs")
    except ModuleNotFoundError as exc:
        if exc.name not in ("sblocal.management", "sblocal.certs"):
            raise
        return None
    app_factory = getattr(management, "create_management_app", None)
    cert_factory = getattr(certs, "ensure_dev_cert", None)
    if app_factory is None or cert_factory is None:
        return None
    return app_factory, cert_factory


def _endpoint_host(host: str) -> str:
    # The SDK connects to the connection string's host; loopback binds are reached as
    # "localhost" like the official emulator's connection strings.
    loopback_or_any = ("127.0.0.1", "0.0.0.0", "localhost", "::1", "::")  # noqa: S104
    return "localhost" if host in loopback_or_any else host


class LocalBroker:
    """Every namespace of a `BrokerConfig`, served over AMQP, control HTTP and HTTPS."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or default_config()
        self._namespaces: dict[str, Namespace] = {}
        self._runtimes: dict[str, NamespaceRuntime] = {}
        self._amqp: AmqpServer | None = None
        self._runners: list[web.AppRunner] = []
        self._control_port: int | None = None
        self._management_ports: dict[str, int] = {}
        self._ca_cert: str | None = None
        self._temp_cert_dir: str | None = None
        self._tls_context: ssl.SSLContext | None = None
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every port and start serving; raises OSError if a configured port is taken."""
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        cfg = self.config
        amqp_tls = await self._dev_tls() if cfg.amqp_tls else None
        for ns_cfg in cfg.namespaces:
            persistence = (
                Persistence(cfg.data_dir / f"{ns_cfg.name}.sqlite3") if cfg.data_dir else None
            )
            ns = Namespace(ns_cfg, persistence=persistence)
            self._namespaces[ns.name] = ns
            self._runtimes[ns.name] = NamespaceRuntime(ns, cfg.host, ns_cfg.amqp_port, amqp_tls)
        self._amqp = AmqpServer(
            list(self._runtimes.values()), housekeeping_interval=cfg.housekeeping_interval
        )
        self._amqp.start()
        for name, ns in self._namespaces.items():
            ns.on_change = functools.partial(self._amqp.wake, name)

        control = web.AppRunner(
            create_control_app(self), access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT
        )
        await control.setup()
        self._runners.append(control)
        site = web.TCPSite(control, cfg.host, cfg.control_port)
        await site.start()
        self._control_port = _bound_port(control)

        support = _management_support()
        wanted = [ns for ns in cfg.namespaces if ns.management_port is not None]
        if support is None:
            if wanted:
                _log.info("sblocal.management is not available: no HTTPS management API")
            return
        if not wanted:
            return
        app_factory, _ = support
        ssl_ctx = await self._dev_tls()
        for ns_cfg in wanted:
            runner = web.AppRunner(
                app_factory(self._namespaces[ns_cfg.name], keys=ns_cfg.key_map),
                access_log=None,
                shutdown_timeout=_SHUTDOWN_TIMEOUT,
            )
            await runner.setup()
            self._runners.append(runner)
            site = web.TCPSite(runner, cfg.host, ns_cfg.management_port, ssl_context=ssl_ctx)
            await site.start()
            self._management_ports[ns_cfg.name] = _bound_port(runner)

    async def _dev_tls(self) -> ssl.SSLContext:
        """The server TLS context of the development certificate (`sblocal.certs`), shared
        by the HTTPS management API and AMQPS; made once."""
        if self._tls_context is not None:
            return self._tls_context
        from sblocal.certs import ensure_dev_cert

        cfg = self.config
        cert_dir = cfg.cert_dir or (cfg.data_dir / "certs" if cfg.data_dir else None)
        if cert_dir is None:
            self._temp_cert_dir = tempfile.mkdtemp(prefix="sblocal-certs-")
            cert_dir = Path(self._temp_cert_dir)
        # Generating a key pair blocks for a while: keep it off the event loop.
        self._ca_cert, context = await asyncio.to_thread(_server_tls, ensure_dev_cert, cert_dir)
        self._tls_context = context
        return context

    async def stop(self) -> None:
        """Stop serving. Idempotent; safe after a failed start."""
        # The loop over runners is intentional: one failing cleanup must not leak the others.
        for runner in reversed(self._runners):
            try:
                await runner.cleanup()
            except Exception:
                _log.exception("HTTP server cleanup failed")
        self._runners.clear()
        if self._amqp is not None:
            await asyncio.to_thread(self._amqp.stop)
            self._amqp = None
        for ns in self._namespaces.values():
            ns.on_change = None
            ns.close()
        if self._temp_cert_dir is not None:
            shutil.rmtree(self._temp_cert_dir, ignore_errors=True)
            self._temp_cert_dir = None
        self._tls_context = None
        self._started = False

    async def __aenter__(self) -> LocalBroker:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- accessors -------------------------------------------------------------------------

    @property
    def amqp(self) -> AmqpServer:
        if self._amqp is None:
            raise RuntimeError("the broker is not running")
        return self._amqp

    @property
    def namespace_names(self) -> list[str]:
        return list(self._namespaces)

    def namespace(self, name: str) -> Namespace:
        """The live namespace (it implements `EntityRegistry`); raises KeyError."""
        return self._namespaces[name]

    def runtime(self, name: str) -> NamespaceRuntime:
        return self._runtimes[name]

    def amqp_port(self, name: str) -> int:
        return self._runtimes[name].port

    def _key(self, name: str) -> tuple[str, str]:
        keys = self.config.namespace(name).keys
        return keys[0] if keys else (DEV_KEY_NAME, DEV_KEY_VALUE)

    def connection_string(self, name: str) -> str:
        """The namespace's SDK connection string. With AMQPS it leaves out
        UseDevelopmentEmulator (which makes clients speak plain AMQP); Node and .NET then dial
        its port, but the Python SDK dials 5671 whatever the port (see docs/sblocal.md)."""
        key_name, key = self._key(name)
        host = _endpoint_host(self.config.host)
        emulator = "" if self.config.amqp_tls else "UseDevelopmentEmulator=true;"
        return (
            f"Endpoint=sb://{host}:{self.amqp_port(name)};SharedAccessKeyName={key_name};"
            f"SharedAccessKey={key};{emulator}"
        )

    def management_port(self, name: str) -> int | None:
        return self._management_ports.get(name)

    def management_connection_string(self, name: str) -> str | None:
        port = self._management_ports.get(name)
        if port is None:
            return None
        key_name, key = self._key(name)
        host = _endpoint_host(self.config.host)
        return f"Endpoint=sb://{host}:{port};SharedAccessKeyName={key_name};SharedAccessKey={key}"

    @property
    def control_url(self) -> str:
        if self._control_port is None:
            raise RuntimeError("the broker is not running")
        any_host = self.config.host in ("0.0.0.0", "::")  # noqa: S104 - a comparison, no bind
        host = "127.0.0.1" if any_host else self.config.host
        return f"http://{host}:{self._control_port}"

    @property
    def ca_cert(self) -> str | None:
        return self._ca_cert

    @property
    def info(self) -> dict[str, Any]:
        """What ``python -m sblocal --json`` prints and ``GET /namespaces`` returns."""
        return {
            "control": self.control_url,
            "ca_cert": self._ca_cert,
            "amqp_tls": self.config.amqp_tls,
            "namespaces": {
                name: {
                    "amqp_port": self.amqp_port(name),
                    "up": self._runtimes[name].up,
                    "connection_string": self.connection_string(name),
                    "management_port": self.management_port(name),
                    "management_connection_string": self.management_connection_string(name),
                }
                for name in self._namespaces
            },
        }

    def control_client(self) -> ControlClient:
        """An async client of this broker's control API (close it with ``await c.close()``)."""
        from sblocal.testing import ControlClient

        return ControlClient(self.control_url)

    def reset_namespace(self, name: str) -> None:
        """Clear messages, faults, latency and counters of one namespace (keep entities)."""
        rt = self._runtimes[name]
        rt.faults.clear()
        rt.latency.round_trip_ms = 0.0
        rt.latency.store_ms = 0.0
        rt.namespace.reset()


def _server_tls(cert_factory: CertFactory, cert_dir: Path) -> tuple[str, ssl.SSLContext]:
    cert_path, key_path = cert_factory(cert_dir)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert_path), str(key_path))
    return str(Path(cert_path).resolve()), ctx


def _bound_port(runner: web.AppRunner) -> int:
    for addr in runner.addresses:
        with contextlib.suppress(TypeError, IndexError):
            return int(addr[1])
    raise RuntimeError("the HTTP server is not bound")
