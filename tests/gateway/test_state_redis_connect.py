"""How the state store reaches Redis (`gateway/state/connect.py`), against real servers: TLS
with a private CA, credentials that expire (an Entra ID stand-in built from ACL users)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from redis import Redis as SyncRedis

from gateway.app import redis_target
from gateway.config import ConfigError, load_settings
from gateway.lifetimes import Backoff
from gateway.state import RedisStateStore
from gateway.state.connect import RedisTarget, parse_sentinel_url
from gateway.state.entra import EntraIdCredentials, TokenError, object_id
from tests.support.identity import AZURE_ENV, TokenEndpoint
from tests.support.processes import REDIS_SERVER, RedisServer
from tests.support.redis import (
    RedisClusterServers,
    RotatingAclUsers,
    SentinelGroup,
)
from tests.support.redis import redis_cluster as redis_cluster  # the fixture
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

FAST: dict[str, Any] = {
    "op_timeout": 1.0,  # a TLS handshake on a loaded machine can take longer than 0.3 s
    "health_interval": 0.2,
    "reconnect_backoff": Backoff(0.05, 0.3, jitter=0.25),
}


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisServer]:
    """One TLS server (a self-signed certificate, its own CA) for the module; tests use
    their own users and entity names."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    with RedisServer(tls=True) as server:
        yield server


@asynccontextmanager
async def two(
    targets: list[RedisTarget], connect: bool = True
) -> AsyncIterator[list[RedisStateStore]]:
    """Replicas on `targets`; with `connect`, once every one is connected (`start()` waits
    for the first attempt only, which a loaded machine can fail, and a later one succeed)."""
    stores = [RedisStateStore(t, f"r{i}", **FAST) for i, t in enumerate(targets)]
    await asyncio.gather(*(s.start() for s in stores))
    try:
        if connect:
            await eventually(
                lambda: all(s.connected for s in stores), what="every replica connected"
            )
        yield stores
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def exchange(stores: list[RedisStateStore], entity: str) -> None:
    """One decision on each replica, each heard by the other."""
    for i, store in enumerate(stores):
        made = store.propose(store.get(entity), "failing" if i == 0 else "healthy", f"step-{i}")
        assert made is not None
        await eventually(lambda m=made: all(s.get(entity) == m for s in stores), within=5)


async def test_tls_with_a_private_ca_file(tls_server: RedisServer) -> None:
    """`rediss://` with `ca_file`: the bundle is trusted in addition to the system store."""
    assert tls_server.ca_file is not None
    target = RedisTarget(tls_server.tls_url, ca_file=str(tls_server.ca_file))
    async with two([target, target]) as stores:
        assert all(s.connected for s in stores)
        await exchange(stores, "tls-orders")


async def test_tls_refuses_a_server_the_system_store_does_not_trust(
    tls_server: RedisServer,
) -> None:
    async with two([RedisTarget(tls_server.tls_url)], connect=False) as (store,):
        await eventually(lambda: store.stats.redis_errors >= 1, what="a refused handshake")
        assert not store.connected


@pytest.mark.integration  # the servers come through `request`
@pytest.mark.slow  # waits out credentials' lifetimes
@pytest.mark.parametrize("mode", ["standalone", "cluster"])
async def test_expiring_credentials_are_renewed_before_expiry_without_a_disconnect(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """Entra ID's contract, on ACL users (over TLS on one server; on every node of a
    cluster): every credential is deleted when its lifetime ends, which closes every
    connection still using it. Each replica opens its next session with fresh credentials
    before that and closes the old one, so over several rotations both keep exchanging
    decisions with no error and no reconnect."""
    if mode == "cluster":
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        cluster.heal()
        servers, url, ca = cluster.nodes, cluster.url, None
    else:
        server: RedisServer = request.getfixturevalue("tls_server")
        servers, url, ca = [server], server.tls_url, str(server.ca_file)
    # Renewal starts `margin` before expiry and closes the old connections one `op_timeout`
    # (FAST: 1 s) after switching to the new ones: the margin leaves room for both, and for
    # opening the new ones on a loaded machine.
    providers = [RotatingAclUsers(servers, lifetime=4.0, margin=2.5) for _ in range(2)]
    targets = [
        RedisTarget(url, mode=mode, ca_file=ca, credential_provider=p)  # type: ignore[arg-type]
        for p in providers
    ]
    async with two(targets) as stores:
        # From here on (a first attempt that timed out on a loaded machine is not the subject).
        before = [(s.stats.redis_errors, s.stats.reconnects) for s in stores]
        stop = asyncio.Event()

        async def expire() -> None:  # the service's side: credentials past their lifetime go
            while not stop.is_set():
                for p in providers:
                    p.expire()
                await asyncio.sleep(0.05)  # paces the reaper; not a wait for a condition

        async with asyncio.TaskGroup() as tg:
            tg.create_task(expire())
            round_ = 0
            while min(p.deleted for p in providers) < 4:  # several rotations on each
                await exchange(stores, f"rot-{round_ % 4}")
                round_ += 1
            stop.set()
        for store, (errors, reconnects) in zip(stores, before, strict=True):
            assert store.stats.redis_errors == errors, "no call failed"
            assert store.stats.reconnects == reconnects, "no session was lost"
            assert store.connected
        assert all(s.renewals >= 3 for s in stores)


# -- Microsoft Entra ID ---------------------------------------------------------------------


def jwt(claims: dict[str, Any]) -> str:
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none'})}.{part(claims)}.sig"


class Tokens:
    """An azure-identity credential at its port (`get_token`), for the timing logic."""

    def __init__(self, lifetime: float, now: float = 1_000_000.0) -> None:
        self.lifetime, self.now, self.scopes = lifetime, now, []  # type: list[str]

    async def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        self.scopes.extend(scopes)
        claims = {"oid": "0000-oid", "n": len(self.scopes)}
        return AccessToken(jwt(claims), int(self.now + self.lifetime))

    async def close(self) -> None:
        pass


async def test_the_object_id_is_the_user_and_renewal_is_jittered_at_least_3_minutes_early() -> None:
    seen = set()
    for _ in range(20):
        tokens = Tokens(lifetime=3600)
        creds = EntraIdCredentials(tokens, clock=lambda t=tokens: t.now)  # type: ignore[arg-type]
        await creds.prepare()
        user, token = await creds.get_credentials_async()
        assert user == "0000-oid" and object_id(token) == "0000-oid"
        assert tokens.scopes == ["https://redis.azure.com/.default"]
        renew_in = creds.renew_in()
        assert renew_in is not None and 3600 - 180 - 60 <= renew_in <= 3600 - 180
        seen.add(round(renew_in))
        await creds.prepare()  # not due: the same token, no new request
        assert tokens.scopes == ["https://redis.azure.com/.default"]
        tokens.now += renew_in
        await creds.prepare()  # due: a fresh one
        assert len(tokens.scopes) == 2 and (await creds.get_credentials_async())[1] != token
    assert len(seen) > 1, "jittered: replicas do not renew in step"


def test_a_token_without_an_object_id_is_refused() -> None:
    with pytest.raises(TokenError):
        object_id(jwt({"sub": "x"}))
    with pytest.raises(TokenError):
        object_id("not-a-jwt")


async def test_a_managed_identity_token_authenticates_as_the_object_id(
    tls_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole Entra path with azure-identity's real `ManagedIdentityCredential` against a
    local token endpoint: Redis knows the identity as an ACL user named by its object id,
    whose password is each token issued (as the service accepts any valid token for it)."""
    oid = "6f1e0c2a-0000-4000-8000-00000000abcd"
    tls_server.command("ACL", "DELUSER", oid)

    def grant(token: str) -> None:
        tls_server.command("ACL", "SETUSER", oid, "on", f">{token}", "~*", "&*", "+@all")

    for name in AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    async with TokenEndpoint(tmp_path / "certs", oid=oid, on_issue=grant) as idp:
        for name, value in idp.managed_identity_env().items():
            monkeypatch.setenv(name, value)
        settings = load_settings(
            {
                "SBGATE_REDIS_URL": tls_server.tls_url,
                "SBGATE_REDIS_CA_FILE": str(tls_server.ca_file),
                "SBGATE_REDIS_CREDENTIAL": "managed",
            }
        )
        target = redis_target(settings)
        async with two([target]) as (store,):
            assert store.connected
            made = store.propose(store.get("entra"), "failing", "timeout")
            await eventually(lambda: store.stats.writes == 1)
            assert made is not None
            with SyncRedis(port=tls_server.port, decode_responses=True) as admin:
                users = {c["user"] for c in admin.client_list() if c["name"].startswith("sbgate")}
            assert users == {oid}, "every connection of the store is the identity's"
        assert idp.requests and idp.requests[0].params["resource"] == "https://redis.azure.com"


# -- Sentinel -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    with SentinelGroup() as group:
        yield group


@pytest.mark.slow  # a Sentinel group's failover takes seconds
async def test_after_a_sentinel_failover_the_replicas_follow_the_promoted_master(
    sentinel_group: SentinelGroup,
) -> None:
    # As docs/configuration.md#redis-on-azure says, through the settings.
    env = {"SBGATE_REDIS_URL": sentinel_group.url, "SBGATE_REDIS_MODE": "sentinel"}
    target = redis_target(load_settings(env))
    async with two([target, target]) as stores:
        r0, r1 = stores
        assert all(s.connected for s in stores)
        one = r0.propose(r0.get("orders"), "failed_over", "timeout")
        two_ = r1.propose(r1.get("billing"), "failing", "timeout")
        await eventually(
            lambda: all(s.get("orders") == one and s.get("billing") == two_ for s in stores)
        )
        old, _ = sentinel_group.roles()
        new = await asyncio.to_thread(sentinel_group.failover)
        assert new is not old
        await eventually(
            lambda: all(s.connected and s.stats.reconnects >= 1 for s in stores),
            within=20,
            what="both replicas on the promoted master",
        )
        assert all(s.get("orders") == one and s.get("billing") == two_ for s in stores)
        after = r1.propose(r1.get("orders"), "healthy", "recovered")
        await eventually(lambda: r0.get("orders") == after)
        with SyncRedis(port=new.port, decode_responses=True) as admin:

            def on_new_master() -> bool:
                h = admin.hgetall("{sbgate}:entity:orders")
                b = admin.hgetall("{sbgate}:entity:billing")
                return h.get("status") == "healthy" and b.get("status") == "failing"

            await eventually(on_new_master, what="the state is on the promoted master")


def test_sentinel_urls() -> None:
    where = parse_sentinel_url("rediss+sentinel://:p%40ss@h1:26380,h2/prod-master/2")
    assert where.sentinels == [("h1", 26380), ("h2", 26379)]
    assert (where.master, where.db, where.password, where.username, where.tls) == (
        "prod-master",
        2,
        "p@ss",
        None,
        True,
    )
    for bad in ("redis+sentinel://h1", "redis+sentinel://h1:x/m", "redis://h1/m"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)
    with pytest.raises(ValueError, match="sentinel"):
        RedisTarget("redis+sentinel://h1/m")  # mode standalone with a sentinel URL
    with pytest.raises(ConfigError, match="redis_mode"):
        redis_target(
            load_settings({"SBGATE_REDIS_URL": "redis://h1/0", "SBGATE_REDIS_MODE": "sentinel"})
        )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("rediss://:s3cr3t@cache.example:6380/0", "rediss://:***@cache.example:6380/0"),
        ("redis://sbgate:s3cr3t@cache/0", "redis://sbgate:***@cache/0"),
        ("redis://cache:6379", "redis://cache:6379"),
        (
            "redis+sentinel://:s3cr3t@s1:26379,s2:26379/main",
            "redis+sentinel://:***@s1:26379,s2:26379/main",
        ),
    ],
)
def test_a_targets_repr_hides_the_access_key(url: str, shown: str) -> None:
    """Issue 33: the dataclass repr printed the URL with its password into logs."""
    mode = "sentinel" if "sentinel" in url else "standalone"
    text = repr(RedisTarget(url, mode))
    assert "s3cr3t" not in text and repr(shown) in text
