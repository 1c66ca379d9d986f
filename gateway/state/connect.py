"""How the shared state reaches Redis: the command client and the events subscriber, built
from one `RedisTarget` for each deployment shape.

* `standalone` — one endpoint: a single server, Azure Cache for Redis (non-clustered), or
  Azure Managed Redis under the Enterprise clustering policy (its proxy hides the shards).
  Events use classic `SUBSCRIBE`/`PUBLISH`.
* `cluster` — the Redis Cluster protocol: a self-hosted cluster, Azure Cache for Redis
  Premium clustered, Azure Managed Redis under the OSS clustering policy. Commands go through
  redis-py's `RedisCluster`, which follows MOVED/ASK and refreshes the slot map. Every key
  carries the one hash tag of the prefix (see `gateway.state.redis`), so every script touches
  one slot and the events use sharded pub/sub (`SSUBSCRIBE`/`SPUBLISH`) on that slot's owner;
  a server without sharded pub/sub (Redis 6) gets classic pub/sub, which the cluster bus
  broadcasts to every node.
* `sentinel` — self-hosted high availability: the URL names the sentinels and the master
  (`redis+sentinel://[[user]:password@]h1:26379,h2:26379/<master>[/db]`, `rediss+sentinel`
  for TLS; the credentials are the data nodes', the sentinels are asked without them).
  Each session asks the sentinels where the master is and talks to it as one server; a
  failover drops our connections (Sentinel kills the old master's clients), and the next
  session finds the promoted one.

A session is one client plus one subscriber. Anything that disturbs either (a dropped
connection, our slot moving to another node: the server then sends `sunsubscribe`) raises,
and the store opens a new session — a fresh client that reads the topology again — and
resyncs. No retries inside redis-py: a failure must surface so that the resync runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args
from urllib.parse import unquote

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import ConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.config import RedisMode

REDIS_MODES: tuple[str, ...] = get_args(RedisMode)

Client = Redis | RedisCluster


class ExpiringCredentialProvider(CredentialProvider):
    """Credentials that stop working at some point (an Entra ID token): a connection opened
    with them must be replaced before then. The store calls `prepare()` (under the
    provider's own deadline) before it opens connections, so that each connection's
    `get_credentials_async` returns at once; `renew_in()` is how many seconds from now it
    must open a new session with fresh credentials and close the old one (None: never)."""

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        raise NotImplementedError("async only: use get_credentials_async")

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        raise NotImplementedError

    async def prepare(self) -> None:
        """Have current credentials ready (fetch new ones if these are due); may raise."""

    def renew_in(self) -> float | None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release what the provider holds (an azure-identity credential's sessions)."""


class SlotMoved(RedisConnectionError):
    """The server dropped our sharded subscription: the events slot moved (a resharding or a
    failed-over shard). The session ends and the next one subscribes on the new owner."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where and how to connect. `url` is `redis://` or `rediss://` (TLS) with the password
    (access key) if any; `ca_file` is a PEM bundle trusted in addition to the system store
    (TLS only); `credential_provider` supplies user name and password (token) for each new
    connection instead of the URL's."""

    url: str
    mode: RedisMode = "standalone"
    ca_file: str | None = None
    credential_provider: CredentialProvider | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in REDIS_MODES:
            raise ValueError(f"redis mode must be one of {REDIS_MODES}, got {self.mode!r}")
        if (self.mode == "sentinel") != self.url.split("://", 1)[0].endswith("+sentinel"):
            raise ValueError(
                "a redis+sentinel:// (or rediss+sentinel://) URL goes with redis_mode "
                "sentinel, and only with it"
            )
        if self.mode == "sentinel":
            parse_sentinel_url(self.url)  # refuse a malformed one now, not at each session

    def __repr__(self) -> str:
        """The URL without its password (the access key): a target ends up in logs and
        tracebacks."""
        scheme, sep, rest = self.url.partition("://")
        userinfo, at, hosts = rest.rpartition("@")
        if at:
            user, colon, _ = userinfo.partition(":")
            rest = f"{user}{colon and ':***'}@{hosts}"
        return (
            f"RedisTarget(url={scheme + sep + rest!r}, mode={self.mode!r}, "
            f"ca_file={self.ca_file!r}, credential_provider={self.credential_provider!r})"
        )

    def _expiring(self) -> ExpiringCredentialProvider | None:
        provider = self.credential_provider
        return provider if isinstance(provider, ExpiringCredentialProvider) else None

    async def prepare(self) -> None:
        """Before opening connections: have their credentials ready (may raise)."""
        if (provider := self._expiring()) is not None:
            await provider.prepare()

    def renew_in(self) -> float | None:
        """Seconds until the current credentials must be replaced (None: never)."""
        provider = self._expiring()
        return None if provider is None else provider.renew_in()

    async def aclose(self) -> None:
        if (provider := self._expiring()) is not None:
            await provider.aclose()

    def _options(self, op_timeout: float, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": op_timeout,
            "socket_timeout": op_timeout,
            "retry": Retry(NoBackoff(), 0),
            "client_name": name,
            # Bytes that are not UTF-8 (anyone may write them) must not fail a whole read:
            # they are replaced, and the value then fails validation alone.
            "encoding_errors": "replace",
        }
        if self.ca_file is not None:
            opts["ssl_ca_certs"] = self.ca_file
        if self.credential_provider is not None:
            opts["credential_provider"] = self.credential_provider
        return opts

    async def open_client(self, *, op_timeout: float, name: str) -> Client:
        """A new command client. In sentinel mode, the sentinels are asked (each bounded
        by `op_timeout`) where the master is; raises the Redis error if none knows."""
        if self.mode != "sentinel":
            return self.client(op_timeout=op_timeout, name=name)
        where = parse_sentinel_url(self.url)
        opts = self._options(op_timeout, name)
        ask = {k: v for k, v in opts.items() if k not in ("client_name", "credential_provider")}
        if where.tls:
            ask["ssl"] = True
        sentinel = Sentinel(where.sentinels, sentinel_kwargs=ask)  # type: ignore[no-untyped-call]
        try:
            async with asyncio.timeout(op_timeout * len(where.sentinels)):
                host, port = await sentinel.discover_master(where.master)
        finally:
            for s in sentinel.sentinels:
                await s.aclose()
        if where.username is not None:
            opts["username"] = where.username
        if where.password is not None and self.credential_provider is None:
            opts["password"] = where.password
        if where.tls:
            opts["ssl"] = True
        return Redis(host=host, port=int(port), db=where.db, **opts)

    def client(self, *, op_timeout: float, name: str) -> Client:
        """A new command client (no connection made yet); not for sentinel mode."""
        opts = self._options(op_timeout, name)
        if self.mode == "sentinel":
            raise ValueError("sentinel mode: use open_client")
        if self.mode == "cluster":
            return RedisCluster.from_url(self.url, **opts)
        return Redis.from_url(self.url, **opts)

    async def subscriber(self, client: Client, channel: str, op_timeout: float) -> Subscriber:
        """Check the server answers, then subscribe to `channel` on the connection that
        receives its events; returns once the subscription is confirmed. Bounded by
        `op_timeout` per step; raises the Redis error (the caller closes `client`)."""
        if isinstance(client, Redis):
            async with asyncio.timeout(op_timeout):
                await client.ping()
                if self.mode == "sentinel":
                    # A sentinel that has not heard of a failover yet names the old master.
                    role = await client.execute_command("ROLE")  # type: ignore[no-untyped-call]
                    if str(role[0]) != "master":
                        raise RedisConnectionError("the sentinel named a node that is no master")
            sub = Subscriber(client.pubsub(), sharded=False, own=None)
        else:
            async with asyncio.timeout(op_timeout):
                await client.initialize()
            node = client.get_node_from_key(channel)
            if node is None:
                raise SlotMoved(f"no node serves the slot of {channel!r}")
            node_client = _node_client(node)
            try:
                async with asyncio.timeout(op_timeout):
                    await node_client.ping()
                    # Redis 7 knows SPUBLISH; Redis 6 (Azure Cache for Redis) refuses it. A
                    # probe on a channel of the same slot that nobody hears; not COMMAND
                    # INFO, whose nil answer for an unknown command redis-py fails to parse.
                    try:
                        await node_client.execute_command(  # type: ignore[no-untyped-call]
                            "SPUBLISH", f"{channel}:probe", ""
                        )
                        sharded = True
                    except ResponseError:
                        sharded = False
            except BaseException:
                await node_client.aclose()
                raise
            sub = Subscriber(node_client.pubsub(), sharded=sharded, own=node_client)
        try:
            await sub.subscribe(channel, op_timeout)
        except BaseException:
            await sub.aclose()
            raise
        return sub


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    master: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelUrl:
    """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db]`; the
    port defaults to 26379. Raises ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis+sentinel", "rediss+sentinel"):
        raise ValueError("a sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    userinfo, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    path = path.partition("?")[0]
    master, _, db = path.partition("/")
    if not hosts or not master:
        raise ValueError("a sentinel URL names the sentinels and the master: h1:26379,h2/name")
    sentinels = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":")
        if not colon:
            name, port = host, "26379"
        try:
            sentinels.append((name, int(port)))
        except ValueError:
            raise ValueError(f"a sentinel URL has a bad port in {host!r}") from None
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    try:
        db_number = int(db or 0)
    except ValueError:
        raise ValueError(f"a sentinel URL has a bad database number {db!r}") from None
    return SentinelUrl(
        sentinels, unquote(master), db_number, username, password, scheme.startswith("rediss")
    )


def _node_client(node: ClusterNode) -> Redis:
    """A plain client to one cluster node, with the cluster client's connection options."""
    kwargs = dict(node.connection_kwargs)
    pool = ConnectionPool(connection_class=node.connection_class, **kwargs)
    return Redis.from_pool(pool)


class Subscriber:
    """The events subscription on one dedicated connection. `publish` is the command a
    publisher must use for this subscriber to hear it (`PUBLISH` or `SPUBLISH`)."""

    def __init__(self, pubsub: PubSub, *, sharded: bool, own: Redis | None) -> None:
        self._pubsub = pubsub
        self._own = own  # a node client we opened (cluster), closed with the subscription
        self.sharded = sharded
        self.publish = "SPUBLISH" if sharded else "PUBLISH"

    async def subscribe(self, channel: str, op_timeout: float) -> None:
        want = "ssubscribe" if self.sharded else "subscribe"
        async with asyncio.timeout(op_timeout):
            if self.sharded:
                await self._pubsub.ssubscribe(channel)
            else:
                await self._pubsub.subscribe(channel)
            while True:
                msg = await self._pubsub.get_message(timeout=op_timeout)
                if msg is not None and msg["type"] == want:
                    return

    async def get_message(self, wait: float) -> dict[str, Any] | None:
        """The next message (an event is `{"type": "message", "data": ...}`, whichever
        pub/sub carries it), a PONG, or None after `wait` seconds. Raises `SlotMoved` when
        the server drops a sharded subscription."""
        msg: dict[str, Any] | None = await self._pubsub.get_message(timeout=wait)
        if msg is None:
            return None
        kind = msg["type"]
        if kind == "smessage":
            return {**msg, "type": "message"}
        if kind == "sunsubscribe":
            raise SlotMoved(f"the server dropped the subscription to {msg['channel']!r}")
        return msg

    async def drain(self, barrier: str, on_event: Callable[[Any], None]) -> None:
        """Hand every event still queued on this subscription to `on_event`, in order.
        Subscribes to `barrier` (a channel in the same slot that nobody publishes on) and
        reads up to its confirmation, which the server sends after everything it queued
        for us before. (Not a PING: redis-py mangles a decoded RESP3 PING reply on a
        subscribed connection.) The caller bounds it."""
        want = "ssubscribe" if self.sharded else "subscribe"
        if self.sharded:
            await self._pubsub.ssubscribe(barrier)
        else:
            await self._pubsub.subscribe(barrier)
        while True:
            msg = await self.get_message(wait=1.0)
            if msg is None:
                continue
            if msg["type"] == "message":
                on_event(msg["data"])
            elif msg["type"] == want and msg["channel"] == barrier:
                return

    async def ping(self) -> None:
        # Any reply counts as "heard" (redis-py mangles RESP3's decoded PONG here).
        await self._pubsub.ping()

    async def aclose(self) -> None:
        try:
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        finally:
            if self._own is not None:
                await self._own.aclose()
