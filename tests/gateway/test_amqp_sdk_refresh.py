"""Token refresh over `$cbs` with the real SDKs: a grant expires, the SDK puts a new token on
the same connection and the same `$cbs` link, and its sends go on; a grant that expired
without a refresh refuses the next send with the error the SDK raises for it.

How each SDK decides to refresh (read in its source, pinned versions):

* Python (azure-servicebus 7.15.0, `_pyamqp/aio/_cbs_async.py`): at each put-token it takes a
  refresh window of a tenth of the token's remaining life (``expires_on`` of the credential's
  `AccessToken`, whole seconds), and before each send (`client_ready`) puts a new token once
  inside that window; a token it believes expired raises `TokenExpired` on its own side.
* Node (@azure/service-bus 7.9.5, `_negotiateClaim`): a timer renews the token two minutes
  before the credential's ``expiresOnTimestamp`` (every 45 minutes for a key in a
  connection string, whatever it says).

So each test gives the SDK an application's own credential that mints short SAS tokens
(seconds), telling the SDK their real expiry (a refresh) or an hour (no refresh before the
grant lapses). The gateway allows no clock skew here (``SBGATE_AUTH_CLOCK_SKEW=0``), so a
send after the first token's expiry is accepted only on the refreshed grant. A relay
between the SDK and the gateway (tests/support/relay.py) counts the TCP connections and,
in plain AMQP, reads the frames: the second put-token is a transfer on the `$cbs` link the
first came on, with no new link attached. The gateway's own `sbgate_amqp_put_tokens_total`
counts the grants.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import ServiceBusAuthorizationError

from gateway.amqp.server import AmqpServer
from gateway.app import AMQP_SERVER
from gateway.auth import mint_token
from gateway.metrics import Metrics
from sblocal.certs import ensure_dev_cert
from sblocal.testing import ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, SEND_KEY
from tests.support.node import INSTALLED, NODE, run_job
from tests.support.processes import free_port
from tests.support.relay import Relay
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# No skew: a token is refused the second after its `se`.
NO_SKEW = {**AUTH, "SBGATE_AUTH_CLOCK_SKEW": "0"}
# Python refreshes in the last tenth of a token's life: 30 s gives a 3 s window, which a
# send every quarter second cannot miss even on a loaded machine.
PYTHON_TTL = 30
TEST_DEADLINE = 90.0  # the whole exchange, every SDK call inside it
NODE_SKIP = pytest.mark.skipif(
    NODE is None or not INSTALLED, reason="the Node SDK tier (tests/compat/node) is not installed"
)

Start = Callable[..., Awaitable[AmqpServer]]


@dataclass
class ShortLivedSas:
    """An application's credential (azure-core's `AsyncTokenCredential` protocol) that mints
    SAS tokens living `ttl` seconds, and tells the SDK they expire after `claimed` seconds
    (their real life by default). Every token it issued is kept: (``se``, when)."""

    uri: str
    key_name: str
    key: str
    ttl: int
    claimed: int | None = None
    issued: list[int] = field(default_factory=list)

    async def get_token(self, *_scopes: str, **_kw: Any) -> AccessToken:
        now = time.time()
        token = mint_token(self.uri, self.key_name, self.key, self.ttl, now=now)
        expiry = int(now + self.ttl)
        self.issued.append(expiry)
        return AccessToken(token, int(now + self.claimed) if self.claimed else expiry)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> ShortLivedSas:
        return self

    async def __aexit__(self, *_args: object) -> None:
        return None


@pytest.fixture
async def amqp_server(gateway: GatewayFactory) -> AsyncIterator[Start]:
    async def start(env: dict[str, str] | None = None) -> AmqpServer:
        gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **NO_SKEW, **(env or {})})
        return gw.app[AMQP_SERVER]

    yield start


def put_tokens(server: AmqpServer, result: str) -> float:
    observer = server.edge.observer
    assert isinstance(observer, Metrics)
    value = observer.registry.get_sample_value("sbgate_amqp_put_tokens_total", {"result": result})
    return value or 0.0


def message(mid: str) -> ServiceBusMessage:
    return ServiceBusMessage(mid.encode(), message_id=mid)


async def stored_ids(control: ControlClient) -> list[str]:
    return sorted(m["message_id"] for m in await control.messages("primary", "orders", limit=1000))


def python_client(relay: Relay, credential: ShortLivedSas) -> ServiceBusClient:
    # A credential and a namespace with its port, over plain TCP: the emulator's route.
    return ServiceBusClient(
        f"localhost:{relay.port}",
        credential,
        use_tls=False,
        retry_total=0,  # type: ignore[arg-type]
    )


async def test_the_python_sdk_refreshes_on_the_same_cbs_link_and_keeps_sending(
    amqp_server: Start, control: ControlClient
) -> None:
    server = await amqp_server()
    async with Relay(server.ports["plain"]) as relay:
        credential = ShortLivedSas(
            f"sb://localhost:{relay.port}/orders", "sender", SEND_KEY, PYTHON_TTL
        )
        sent: list[str] = []
        async with asyncio.timeout(TEST_DEADLINE):
            async with python_client(relay, credential) as sb:
                async with sb.get_queue_sender("orders") as sender:

                    async def send_one() -> None:
                        mid = f"py-{len(sent)}"
                        await sender.send_messages(message(mid))
                        sent.append(mid)

                    await send_one()
                    [conn] = relay.connections
                    links = conn.links_attached()
                    first_expiry = credential.issued[0]

                    async def refreshed_and_first_expired() -> bool:
                        # One send a poll: the SDK looks at its token only when it sends.
                        await send_one()
                        return len(credential.issued) >= 2 and time.time() > first_expiry + 1

                    await eventually(
                        refreshed_and_first_expired, within=PYTHON_TTL + 30, every=0.25
                    )
                    await send_one()  # the first grant has lapsed: only the refresh covers it
        assert len(relay.connections) == 1, "one connection throughout: no reconnect"
        assert conn.links_attached() == links, "the refresh attached no new link"
        assert conn.transfers_to("$cbs") == len(credential.issued) >= 2
        # Python asks for no idle timeout in its open (so it needs no heartbeats).
        assert conn.client_idle_timeout_ms() is None
    assert put_tokens(server, "granted") == len(credential.issued)
    assert put_tokens(server, "refused") == 0
    assert await stored_ids(control) == sorted(sent)


async def test_a_python_send_after_the_grant_lapsed_unrefreshed_is_refused_unauthorized(
    amqp_server: Start, control: ControlClient
) -> None:
    server = await amqp_server()
    async with Relay(server.ports["plain"]) as relay:
        # Tokens of 3 s that the SDK believes good for an hour: it never refreshes in time.
        credential = ShortLivedSas(
            f"sb://localhost:{relay.port}/orders", "sender", SEND_KEY, 3, claimed=3600
        )
        async with asyncio.timeout(TEST_DEADLINE):
            async with python_client(relay, credential) as sb:
                async with sb.get_queue_sender("orders") as sender:
                    await sender.send_messages(message("before"))
                    expiry = credential.issued[0]
                    await eventually(lambda: time.time() > expiry + 1, within=15)
                    with pytest.raises(ServiceBusAuthorizationError, match="expired"):
                        await sender.send_messages(message("after"))
        assert len(relay.connections) == 1 and credential.issued == [expiry]
    assert put_tokens(server, "granted") == 1
    assert await stored_ids(control) == ["before"]


# -- Node --------------------------------------------------------------------------------


async def node_across_expiry(
    gateway: GatewayFactory, tmp_path: Path, credential: dict[str, Any], prefix: str
) -> tuple[dict[str, Any], AmqpServer, Relay]:
    """A Node sender whose credential is `credential` (habits.mjs's `shortLivedSas`) sends
    `<prefix>-before`, waits until its first token has expired, and sends `<prefix>-after`,
    through a relay, to the gateway's TLS listener.

    A credential (not a connection string) is what makes the Node SDK renew on the token's
    own expiry, and its constructor has no plain-TCP form: TLS, trusting the dev CA."""
    cert, key = ensure_dev_cert(tmp_path)
    gw = await gateway(
        {
            **NO_SKEW,
            "SBGATE_AMQP_PORT": str(free_port()),
            "SBGATE_AMQP_TLS_CERT_FILE": str(cert),
            "SBGATE_AMQP_TLS_KEY_FILE": str(key),
        }
    )
    server = gw.app[AMQP_SERVER]
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": str(cert)}
    async with Relay(server.ports["tls"]) as relay:
        host = f"localhost:{relay.port}"
        job = {
            "host": host,
            "credential": {
                "uri": f"sb://{host}/orders",
                "keyName": "sender",
                "key": SEND_KEY,
                **credential,
            },
            "entity": "orders",
            "steps": [
                {"op": "send", "messageId": f"{prefix}-before"},
                {"op": "waitExpired", "token": 0},
                {"op": "send", "messageId": f"{prefix}-after"},
            ],
        }
        result = await run_job(job, env=env, script="habits.mjs", deadline=TEST_DEADLINE)
    return result, server, relay


@NODE_SKIP
async def test_the_node_sdk_renews_on_its_timer_and_keeps_sending(
    gateway: GatewayFactory, control: ControlClient, tmp_path: Path
) -> None:
    # Tokens of 6 s that Node renews 2 s after each (its timer: two minutes before the
    # claimed expiry), so the first has lapsed well before the last send.
    result, server, relay = await node_across_expiry(
        gateway, tmp_path, {"ttlSeconds": 6, "claimedSeconds": 122}, "renewed"
    )
    assert result["ok"], result
    issued = result["tokens"]
    assert len(issued) >= 3, "the first token, and renewals every 2 s until it lapsed"
    assert len(relay.connections) == 1, "renewed on the same connection: no reconnect"
    # Every token the credential issued was put and granted (the last may still be in
    # flight when the job ends: the renewal timer runs on its own).
    assert len(issued) - 1 <= put_tokens(server, "granted") <= len(issued)
    assert put_tokens(server, "refused") == 0
    assert await stored_ids(control) == ["renewed-after", "renewed-before"]


@NODE_SKIP
async def test_a_node_send_after_the_grant_lapsed_unrenewed_is_refused_unauthorized(
    gateway: GatewayFactory, control: ControlClient, tmp_path: Path
) -> None:
    result, server, relay = await node_across_expiry(
        gateway, tmp_path, {"ttlSeconds": 3, "claimedSeconds": 3600}, "lapsed"
    )
    assert not result["ok"], result
    assert result["error"]["code"] == "UnauthorizedAccess", result
    assert "expired" in result["error"]["message"], result
    assert result["done"] == 2 and len(result["tokens"]) == 1
    assert len(relay.connections) == 1
    assert put_tokens(server, "granted") == 1
    assert await stored_ids(control) == ["lapsed-before"]
