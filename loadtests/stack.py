"""The system under test as real processes: the local broker pair, Redis, N gateway replicas
(and optionally separate syphon processes), with a fault proxy in front of Redis — and, when
asked, in front of the broker — for each replica, so one replica can be cut off alone.

    async with Stack(StackOptions(replicas=2), run_dir) as stack:
        stack.replicas[0].url, stack.control, stack.redis_proxies[1].blackhole(), ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.core.backlog import backlog_path
from loadtests.proxy import FaultProxy
from sblocal.testing import BrokerProcess, ControlClient
from tests.support.processes import GatewayProcess, RedisServer, broker_wiring, free_port

log = logging.getLogger(__name__)

QUEUES = ("orders", "payments")
TOPIC = "events"
SUBSCRIPTION = "audit"
# The stack's entities in SBGATE_ENTITIES form (also the Locust users' LOADTEST_ENTITIES).
ENTITIES = ",".join([f"queue:{q}" for q in QUEUES] + [f"topic:{TOPIC}"])
PRIMARY = "primary"
SECONDARY = "secondary"


@dataclass(frozen=True)
class StackOptions:
    replicas: int = 2
    failover_interval: float = 2.0
    ping_primary_interval: float = 1.0
    backlog_queue_count: int = 4
    # "off": no syphon; "replicas": SBGATE_ENABLE_SYPHON=true in every replica;
    # "process": `gateway syphon` processes (see Stack.start_syphon).
    syphon: str = "off"
    syphon_processes: int = 1
    redis: bool = True
    proxy_broker: bool = False  # route each replica's AMQP traffic through its own proxy
    duplicate_detection: bool = True
    send_timeout: float = 3.0
    drain_delay: float = 1.0
    shutdown_timeout: float = 8.0
    extra_env: dict[str, str] = field(default_factory=dict)


def broker_config(duplicate_detection: bool) -> str:
    """TOML for the broker pair: the primary's queues and topic (duplicate detection on,
    expired messages dead-lettered so the checker can see them); an empty secondary
    (the gateways create the backlog queues)."""
    dd = "true" if duplicate_detection else "false"
    lines = ["[[namespaces]]", f'name = "{PRIMARY}"']
    for q in QUEUES:
        lines += [
            "[[namespaces.queues]]",
            f'path = "{q}"',
            f"requires_duplicate_detection = {dd}",
            "dead_lettering_on_message_expiration = true",
            "max_size_in_megabytes = 5120",
        ]
    lines += [
        "[[namespaces.topics]]",
        f'path = "{TOPIC}"',
        f"requires_duplicate_detection = {dd}",
        "max_size_in_megabytes = 5120",
        f'subscriptions = [{{ name = "{SUBSCRIPTION}", '
        "dead_lettering_on_message_expiration = true }]",
        "",
        "[[namespaces]]",
        f'name = "{SECONDARY}"',
    ]
    return "\n".join(lines) + "\n"


def _with_port(connection_string: str, port: int) -> str:
    parts = []
    for piece in connection_string.split(";"):
        if piece.startswith("Endpoint=sb://"):
            host = piece.removeprefix("Endpoint=sb://").rstrip("/").rsplit(":", 1)[0]
            piece = f"Endpoint=sb://{host}:{port}"
        parts.append(piece)
    return ";".join(parts)


class Stack:
    """Owns every process and proxy it starts; `stop()` ends them all (bounded)."""

    def __init__(self, options: StackOptions, run_dir: Path) -> None:
        self.options = options
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.broker: BrokerProcess | None = None
        self.redis: RedisServer | None = None
        self.redis_proxies: list[FaultProxy] = []
        self.broker_proxies: list[dict[str, FaultProxy]] = []
        self.replicas: list[GatewayProcess] = []
        self.syphons: list[GatewayProcess] = []

    # -- accessors ---------------------------------------------------------------------

    @property
    def control(self) -> ControlClient:
        assert self.broker is not None
        return self.broker.control

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def backlog_queues(self) -> list[str]:
        return [backlog_path(PRIMARY, i) for i in range(self.options.backlog_queue_count)]

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> Stack:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.run_dir / "broker.toml"
        cfg.write_text(broker_config(self.options.duplicate_detection))
        try:
            self.broker = BrokerProcess(config=cfg)
            await self.broker.astart()
            if self.options.redis:
                await self._start_redis()
            for i in range(self.options.replicas):
                await self._add_proxies(i)
                port = free_port()
                env = self.replica_env(i)
                env["SBGATE_LISTEN_PORT"] = str(port)
                gw = GatewayProcess(f"gw{i}", env, port=port, log_dir=self.log_dir)
                self.replicas.append(gw)
            # Replicas start in parallel: each opens senders and checks the backlog queues.
            async with asyncio.TaskGroup() as tg:
                for gw in self.replicas:
                    tg.create_task(gw.start(within=90))
            if self.options.syphon == "process":
                for _ in range(self.options.syphon_processes):
                    await self.start_syphon()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start_redis(self) -> None:
        self.redis = await asyncio.to_thread(RedisServer().start)

    async def _add_proxies(self, i: int) -> None:
        if self.redis is not None:
            p = FaultProxy(self.redis.port, name=f"redis-gw{i}")
            self.redis_proxies.append(await p.start())
        if self.options.proxy_broker:
            assert self.broker is not None
            pair = {}
            for ns in (PRIMARY, SECONDARY):
                p = FaultProxy(self.broker.amqp_port(ns), name=f"{ns}-gw{i}")
                pair[ns] = await p.start()
            self.broker_proxies.append(pair)

    def base_env(self) -> dict[str, str]:
        """The settings every gateway / syphon process shares."""
        assert self.broker is not None
        o = self.options
        env = {
            **broker_wiring(self.broker),
            "SBGATE_ENTITIES": ENTITIES,
            "SBGATE_FAILOVER_INTERVAL": str(o.failover_interval),
            "SBGATE_PING_PRIMARY_INTERVAL": str(o.ping_primary_interval),
            "SBGATE_BACKLOG_QUEUE_COUNT": str(o.backlog_queue_count),
            "SBGATE_BACKLOG_REPROBE_INTERVAL": "2",
            "SBGATE_ENABLE_SYPHON": "true" if o.syphon == "replicas" else "false",
            "SBGATE_SEND_TIMEOUT": str(o.send_timeout),
            "SBGATE_CONNECT_TIMEOUT": "10",
            "SBGATE_DRAIN_DELAY": str(o.drain_delay),
            "SBGATE_SHUTDOWN_TIMEOUT": str(o.shutdown_timeout),
            "SBGATE_LOG_LEVEL": "WARNING",
            "SBGATE_LOG_FORMAT": "text",
            "SBGATE_RECEIVE_WAIT": "1",
            "SBGATE_IDLE_CHECK_INTERVAL": "2",
        }
        env.update(o.extra_env)
        return {k: v for k, v in env.items() if v != ""}

    def replica_env(self, i: int) -> dict[str, str]:
        env = self.base_env()
        env["SBGATE_REPLICA_ID"] = f"gw{i}"
        if self.redis_proxies:
            env["SBGATE_REDIS_URL"] = f"redis://127.0.0.1:{self.redis_proxies[i].port}/0"
        if self.broker_proxies:
            for ns, key in ((PRIMARY, "PRIMARY"), (SECONDARY, "SECONDARY")):
                env[f"SBGATE_{key}_CONNECTION_STRING"] = _with_port(
                    env[f"SBGATE_{key}_CONNECTION_STRING"], self.broker_proxies[i][ns].port
                )
        if self.replicas and i < len(self.replicas):
            env["SBGATE_LISTEN_PORT"] = str(self.replicas[i].port)
        return env

    async def start_syphon(self, wait_ready: bool = True) -> GatewayProcess:
        """A `gateway syphon` process (Redis direct, no proxy; health on its own port)."""
        env = self.base_env()
        n = len(self.syphons)
        port = free_port()
        env["SBGATE_REPLICA_ID"] = f"syphon{n}"
        env["SBGATE_ENABLE_SYPHON"] = "true"
        env["SBGATE_LISTEN_PORT"] = str(port)
        if self.redis is not None:
            env["SBGATE_REDIS_URL"] = self.redis.url
        sy = GatewayProcess(f"syphon{n}", env, port=port, log_dir=self.log_dir, command="syphon")
        self.syphons.append(sy)
        if wait_ready:
            await sy.start(within=60)
        else:
            sy.spawn()
        return sy

    async def restart_replica(self, i: int, within: float = 60.0) -> None:
        """Start replica `i` again (same port) after it was killed or stopped."""
        gw = self.replicas[i]
        if gw.running:
            await gw.stop()
        await gw.wait(5)
        gw.env.update(self.replica_env(i))
        gw.env["SBGATE_LISTEN_PORT"] = str(gw.port)
        await gw.start(within=within)

    async def stop_gateways(self) -> None:
        """SIGTERM every replica and syphon (in parallel), SIGKILL stragglers."""
        procs = [p for p in self.replicas + self.syphons if p.proc is not None]
        await asyncio.gather(*(p.stop(within=20) for p in procs))

    async def stop(self) -> None:
        await self.stop_gateways()
        for p in self.redis_proxies:
            await p.close()
        for pair in self.broker_proxies:
            for p in pair.values():
                await p.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.redis.close)
            self.redis = None
        if self.broker is not None:
            with contextlib.suppress(Exception):
                await self.broker.astop()
            self.broker = None

    async def __aenter__(self) -> Stack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- admin helpers -----------------------------------------------------------------

    async def admin_entities(self, i: int, within: float = 3.0) -> dict[str, dict[str, Any]]:
        """GET /admin/entities of replica `i`: entity path → its state record."""
        async with asyncio.timeout(within), aiohttp.ClientSession() as s:
            async with s.get(self.replicas[i].url + "/admin/entities") as resp:
                body = await resp.json()
        return {e["entity"]: e for e in body["entities"]}

    async def admin_post(self, i: int, entity: str, action: str, within: float = 5.0) -> None:
        """POST /admin/entities/<entity>/<healthy|failover> on replica `i`."""
        async with asyncio.timeout(within), aiohttp.ClientSession() as s:
            async with s.post(f"{self.replicas[i].url}/admin/entities/{entity}/{action}") as r:
                if r.status >= 400:
                    raise RuntimeError(f"admin {action} {entity}: {r.status} {await r.text()}")

    def keep_logs(self, dest: Path) -> None:
        if self.log_dir.exists() and dest != self.log_dir:
            shutil.copytree(self.log_dir, dest, dirs_exist_ok=True)
