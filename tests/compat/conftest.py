"""The conformance suite's gateway: the real app over a real socket, SAS rules on, the public
host a Service Bus namespace name, sending to the local broker; answers read raw."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.auth import Authorizer, load_rules
from gateway.web.auth import AUTHORIZER
from sblocal.testing import BrokerProcess, ControlClient
from tests.compat.clients import HttpRequest
from tests.conftest import GatewayFactory
from tests.gateway.test_integration import receive
from tests.support.http import exchange

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "dev" / "demo-rules.toml"  # make run's public demo keys
KEY_NAME = "demo"
KEY = "ZGVtby1wcmltYXJ5LWtleS1mb3ItbWFrZS1ydW4tMDAwMDA="
HOST = "contoso.servicebus.windows.net"
CAPTURED = json.loads((Path(__file__).parent / "data" / "captured.json").read_text())
# The captured requests were signed at this time (their se is 300 s later).
CAPTURED_AT = 1795523784 - 300


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class CompatGateway:
    port: int

    async def send(self, request: HttpRequest | bytes) -> Answer:
        """Write the request exactly as given on a new connection; read one answer."""
        raw = request.raw() if isinstance(request, HttpRequest) else request
        status, headers, body = await exchange(self.port, raw)
        return Answer(status, headers, orjson.loads(body))

    async def replay_captured(self, client_prefix: str) -> None:
        """Send every captured request of one client as it was written: each is a 201."""
        for c in CAPTURED:
            if c["client"].startswith(client_prefix):
                answer = await self.send(c["request"].encode("latin-1"))
                assert answer.status == 201, (c["request"][:60], answer.body)


def expiry() -> int:
    return int(time.time()) + 600


def frozen_clock(at: float) -> Callable[[web.Application], None]:
    """Replace the authorizer's clock (a port): captured tokens stay valid when replayed."""

    def prepare(app: web.Application) -> None:
        app[AUTHORIZER] = Authorizer(load_rules(str(RULES_FILE)), [HOST], clock=lambda: at)

    return prepare


@pytest.fixture
async def compat(gateway: GatewayFactory, control: ControlClient) -> CompatGateway:
    gw = await gateway({"SBGATE_AUTH_RULES_FILE": str(RULES_FILE), "SBGATE_PUBLIC_HOSTS": HOST})
    assert gw.server.port is not None
    return CompatGateway(gw.server.port)


@pytest.fixture
async def replay(gateway: GatewayFactory, control: ControlClient) -> CompatGateway:
    """The same gateway, its authorizer's clock at the captured requests' signing time."""
    gw = await gateway(
        {"SBGATE_AUTH_RULES_FILE": str(RULES_FILE), "SBGATE_PUBLIC_HOSTS": HOST},
        prepare=frozen_clock(CAPTURED_AT),
    )
    assert gw.server.port is not None
    return CompatGateway(gw.server.port)


def app_properties(message: Any) -> dict[str, Any]:
    """A received message's application properties with str keys and values."""
    out: dict[str, Any] = {}
    for k, v in (message.application_properties or {}).items():
        key = k.decode() if isinstance(k, bytes) else k
        out[key] = v.decode() if isinstance(v, bytes) else v
    return out


async def received(broker: BrokerProcess, entity: str, count: int = 1) -> dict[str, Any]:
    """Receive `count` messages with the real SDK (events: its subscription), by MessageId."""
    if entity == "events":
        got = await receive(broker, topic_sub=("events", "audit"), count=count)
    else:
        got = await receive(broker, entity, count=count)
    return {m.message_id: m for m in got}


def body_of(message: Any) -> bytes:
    return b"".join(message.body)
