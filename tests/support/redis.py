"""Redis for tests, built from the launcher kit's `RedisServer` (`tests.support.processes`:
our own redis-server on a free 127.0.0.1 port, never a system Redis, no persistence, real
faults): a Redis Cluster and a Sentinel group of such servers, a TCP proxy a test can cut,
rotating ACL users, and the fixtures.

A conftest makes the fixtures available with::

    from tests.support.redis import redis_server, redis_server_factory  # noqa: F401
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Self

import pytest
from redis import Redis as SyncRedis
from redis.exceptions import RedisError

from gateway.state.connect import ExpiringCredentialProvider
from tests.support.processes import REDIS_SERVER, RedisServer, free_port

REDIS_CLI = shutil.which("redis-cli")


class _ServerGroup:
    """Servers started as one and closed as one (also when starting them fails)."""

    timeout: float

    def servers(self) -> list[RedisServer]:
        raise NotImplementedError

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        for server in self.servers():
            server.close()

    def _until(self, what: str, ok: Callable[[], bool]) -> None:
        """Poll `ok` (Redis errors count as not yet) until true; TimeoutError after
        `timeout`."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if ok():
                    return
            except (OSError, RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{type(self).__name__}: {what}")
            time.sleep(0.05)  # polling processes we own, with a deadline

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterServers(_ServerGroup):
    """A Redis Cluster of `masters` redis-server processes we own (no replicas), created with
    `redis-cli --cluster create`, as a self-hosted cluster or Azure Managed Redis under the
    OSS clustering policy presents itself. Each node is a `RedisServer` (kill, pause,
    restart keep its `nodes.conf`, so a restarted node rejoins with its slots, empty)."""

    def __init__(
        self, masters: int = 3, *, timeout: float = 20.0, args: Sequence[str] = ()
    ) -> None:
        args = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "1000",
            *args,
        )  # fmt: skip
        # The bus port is our own free port too (the default, port + 10000, may not exist).
        self.nodes = [
            RedisServer(timeout=timeout, args=(*args, "--cluster-port", str(free_port())))
            for _ in range(masters)
        ]
        for node in self.nodes:
            node.mode = "cluster"
        self.timeout = timeout

    @property
    def url(self) -> str:
        """A seed: the cluster client learns every other node from it."""
        return self.nodes[0].url

    def admin(self, node: RedisServer) -> SyncRedis:
        return SyncRedis(port=node.port, decode_responses=True, socket_timeout=self.timeout)

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                str(REDIS_CLI), "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=self.timeout,
        )  # fmt: skip
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        """Until every node says `cluster_state:ok` and agrees on the slot map."""

        def ok() -> bool:
            states, maps = set(), set()
            for node in self.nodes:
                with self.admin(node) as r:
                    states.add(r.cluster("INFO")["cluster_state"])
                    maps.add(repr(sorted(r.execute_command("CLUSTER", "SLOTS"))))
            return states == {"ok"} and len(maps) == 1

        self._until("every node ok, one slot map", ok)

    def slot(self, key: str) -> int:
        with self.admin(self.nodes[0]) as r:
            return int(r.execute_command("CLUSTER", "KEYSLOT", key))

    def node_id(self, node: RedisServer) -> str:
        with self.admin(node) as r:
            return str(r.execute_command("CLUSTER", "MYID"))

    def owner(self, key: str) -> RedisServer:
        """The node that serves `key`'s slot."""
        slot = self.slot(key)
        with self.admin(self.nodes[0]) as r:
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"no node serves slot {slot}")

    def migrate(self, key: str, to: RedisServer) -> None:
        """Move `key`'s slot, with its keys, to `to` — the steps `redis-cli --cluster
        reshard` takes: importing/migrating, MIGRATE in batches, then SETSLOT NODE."""
        slot, source = self.slot(key), self.owner(key)
        if source is to:
            return
        src_id, dst_id = self.node_id(source), self.node_id(to)
        with self.admin(source) as src, self.admin(to) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command(
                    "MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "REPLACE", "KEYS", *keys
                )
            for node in (to, source, *(n for n in self.nodes if n not in (to, source))):
                with self.admin(node) as r:
                    r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()

    def heal(self) -> None:
        """Every node running and unpaused, the cluster ok, and no data: between tests."""
        for node in self.nodes:
            if node._paused:
                node.resume()
            if not node.running:
                node.start()
        self.wait_ok()
        for node in self.nodes:
            node.command("FLUSHALL")

    def servers(self) -> list[RedisServer]:
        return list(self.nodes)


class SentinelGroup(_ServerGroup):
    """Self-hosted high availability: one master, one replica and three sentinels (quorum
    2), all ours. `url` is what the gateway is given; `failover()` is `SENTINEL FAILOVER`."""

    def __init__(self, name: str = "sbgate", *, timeout: float = 20.0) -> None:
        self.name, self.timeout = name, timeout
        self.master = RedisServer(timeout=timeout)
        self.replica = RedisServer(timeout=timeout, args=("--replicaof", "127.0.0.1", "0"))
        self.replica._args = ("--replicaof", "127.0.0.1", str(self.master.port))
        conf = (
            f"sentinel monitor {name} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {name} 1000\n"
            f"sentinel failover-timeout {name} 5000\n"
        )
        self.sentinels = [RedisServer(timeout=timeout, sentinel=conf) for _ in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.name}/0"

    def _admin(self, server: RedisServer) -> SyncRedis:
        return SyncRedis(port=server.port, decode_responses=True, socket_timeout=self.timeout)

    def master_port(self, sentinel: RedisServer) -> int:
        with self._admin(sentinel) as r:
            addr = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
            return int(addr[1])

    def _settled(self, master: RedisServer, replica: RedisServer) -> bool:
        with self._admin(replica) as r:
            if r.info("replication").get("master_link_status") != "up":
                return False
        for s in self.sentinels:
            with self._admin(s) as r:
                state = r.execute_command("SENTINEL", "MASTER", self.name)
                if isinstance(state, list):  # RESP2: a flat list of names and values
                    state = dict(zip(state[::2], state[1::2], strict=True))
                if int(state["port"]) != master.port or int(state["num-slaves"]) < 1:
                    return False
                if int(state["num-other-sentinels"]) < 2:
                    return False
        return True

    def start(self) -> SentinelGroup:
        self.master.start()
        self.replica.start()
        for s in self.sentinels:
            s.start()
        self._until("replica linked, sentinels agree", lambda: self._settled(*self.roles()))
        return self

    def roles(self) -> tuple[RedisServer, RedisServer]:
        """(master, replica) as the sentinels see them now."""
        port = self.master_port(self.sentinels[0])
        if port == self.master.port:
            return self.master, self.replica
        return self.replica, self.master

    def failover(self) -> RedisServer:
        """Promote the replica; returns the new master once every sentinel names it."""
        _, new = self.roles()
        with self._admin(self.sentinels[0]) as r:
            r.execute_command("SENTINEL", "FAILOVER", self.name)
        self._until(
            "promotion seen by every sentinel",
            lambda: all(self.master_port(s) == new.port for s in self.sentinels),
        )
        return new

    def servers(self) -> list[RedisServer]:
        return [*self.sentinels, self.replica, self.master]


class TcpProxy:
    """A loopback TCP forwarder to `127.0.0.1:target_port` that a test can cut and heal:
    one client loses Redis while the others keep it. Runs on the test's event loop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._open = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        """Drop every connection now and refuse new ones until `heal()`."""
        self._open = False
        for task in list(self._links):
            task.cancel()

    def heal(self) -> None:
        self._open = True

    async def close(self) -> None:
        self.cut()
        if self._links:
            await asyncio.wait(list(self._links), timeout=5)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._pipe(reader, up_w))
                    tg.create_task(self._pipe(up_r, writer))
            finally:
                up_w.close()
        except (OSError, asyncio.CancelledError, ExceptionGroup):
            pass  # a cut or a closed peer: the link ends, which is the point
        finally:
            writer.close()
            self._links.discard(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        raise ConnectionResetError("peer closed")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server for one test, killed afterwards (even if paused)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_server_factory() -> Iterator[type[RedisServer]]:
    """Start more servers in one test: `redis_server_factory().start()`; all are closed."""
    started: list[RedisServer] = []

    class _Tracked(RedisServer):
        def __init__(self, port: int | None = None, *, timeout: float = 10.0) -> None:
            super().__init__(port, timeout=timeout)
            started.append(self)

    yield _Tracked
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One 3-master cluster for the session; `redis_server_in` heals and empties it per test."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server or redis-cli is not installed")
    with RedisClusterServers() as cluster:
        yield cluster


# The one hash tag of the default key prefix (`gateway.state.redis`).
STATE_TAG = "{sbgate}"


def redis_server_in(request: pytest.FixtureRequest, mode: str) -> Iterator[RedisServer]:
    """For a fixture parametrized over modes: a fresh server (`standalone`; `tls`: clients
    use its TLS port and trust its `ca_file`), or the node of the session's cluster that
    serves the state's slot (`cluster`: faults on it are faults of the state's shard;
    `client_url` seeds the cluster client)."""
    if mode == "cluster":
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        cluster.heal()
        owner = cluster.owner(STATE_TAG)
        # Seeded with a node that does not serve the slot: the first write meets MOVED.
        owner.client_url = next(n for n in cluster.nodes if n is not owner).url
        yield owner
        return
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    with RedisServer(tls=mode == "tls") as server:
        if mode == "tls":
            server.client_url = server.tls_url  # faults and `command` keep the plain port
        yield server


class RotatingAclUsers(ExpiringCredentialProvider):
    """An Entra ID stand-in on a real server: each credential is a fresh ACL user with a
    random password, valid for `lifetime` seconds and to be renewed `margin` seconds before
    that. `expire()` deletes every user past its lifetime, and `ACL DELUSER` closes every
    connection still authenticated as it — what the service does to a connection whose token
    expired. (A new user per credential, because changing a password leaves connections
    authenticated with the old one open.)"""

    def __init__(
        self, servers: Sequence[RedisServer], lifetime: float = 2.0, margin: float = 1.0
    ) -> None:
        # Every node of a cluster keeps its own ACL: a user exists on all of them.
        self.servers, self.lifetime, self.margin = list(servers), lifetime, margin
        self._current: tuple[str, str, float] | None = None  # user, password, issued (mono)
        self._users: dict[str, float] = {}  # user -> when it expires (monotonic)
        self.issued = 0
        self.deleted = 0

    def _issue(self) -> tuple[str, str, float]:
        self.issued += 1
        user, password = f"sbgate-{self.issued}", secrets.token_hex(16)
        for server in self.servers:
            server.command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
        now = time.monotonic()
        self._users[user] = now + self.lifetime
        return user, password, now

    async def prepare(self) -> None:
        if self._current is None or time.monotonic() >= self._current[2] + self.lifetime - (
            self.margin
        ):
            self._current = self._issue()

    async def get_credentials_async(self) -> tuple[str, str]:
        if self._current is None:
            await self.prepare()
        assert self._current is not None
        return self._current[0], self._current[1]

    def renew_in(self) -> float | None:
        if self._current is None:
            return 0.0
        return self._current[2] + self.lifetime - self.margin - time.monotonic()

    def expire(self) -> int:
        """Delete the users whose lifetime is over; how many."""
        now = time.monotonic()
        gone = [u for u, until in self._users.items() if until <= now]
        for user in gone:
            for server in self.servers:
                server.command("ACL", "DELUSER", user)
            del self._users[user]
        self.deleted += len(gone)
        return len(gone)
