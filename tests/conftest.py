"""Shared fixtures: the local broker (a real subprocess) and gateways pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web import BaseRunner

from gateway.app import create_app, edge_runner
from gateway.config import Settings, load_settings
from gateway.servicebus import internals as sdk_internals
from sblocal.testing import BrokerProcess, ControlClient
from tests.support import markers
from tests.support.markers import forbid_real_components  # noqa: F401 (autouse fixture)
from tests.support.processes import broker_env
from tests.support.redis import redis_server, redis_server_factory  # noqa: F401 (fixtures)

GatewayFactory = Callable[..., Awaitable[TestClient[Any, web.Application]]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    markers.classify(items)  # unit or integration: see tests/support/markers.py


@pytest.fixture(scope="session", autouse=True)
def _sdk_patches() -> None:
    """The SDK seam's process-wide patches, as `create_app` installs them in production:
    tests that build an `SdkNamespaceClient` without an app share connections as it does."""
    sdk_internals.install()


class HardenedTestServer(TestServer):
    """`TestServer` with the production runner (head/body deadlines, head-size cap), so
    every test exercises the protocol `gateway serve` uses."""

    def __init__(self, app: web.Application, *, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._settings = settings

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return edge_runner(self.app, self._settings, **kwargs)


@pytest.fixture(scope="session")
def broker() -> Iterator[BrokerProcess]:
    """One local broker pair (``primary``, ``secondary``) for the whole session."""
    with BrokerProcess() as b:
        yield b


@pytest.fixture
async def control(broker: BrokerProcess) -> AsyncIterator[ControlClient]:
    """The broker's control API, reset (messages, faults, latency, counters) before the test."""
    ctl = broker.control
    await ctl.reset()
    yield ctl
    await ctl.reset()


@pytest.fixture
async def gateway(broker: BrokerProcess, control: ControlClient) -> AsyncIterator[GatewayFactory]:
    """Start gateways (real servers on 127.0.0.1, the production runner) against the broker."""
    clients: list[TestClient[Any, web.Application]] = []

    async def make(
        env: dict[str, str] | None = None,
        *,
        prepare: Callable[[web.Application], None] | None = None,
        **factory_kwargs: Any,
    ) -> TestClient[Any, web.Application]:
        # The test's client shares the gateway's event loop, so a head's wait measures the
        # test's own load too: time-based shedding is off unless a test sets it (shedding
        # has its own tests, tests/security/test_shedding.py).
        env = {"SBGATE_MAX_HEAD_WAIT": "0", **(env or {})}
        settings = load_settings(broker_env(broker, **env))
        app = create_app(settings, **factory_kwargs)
        if prepare is not None:
            prepare(app)  # before the app is frozen: replace a port (the auth clock, ...)
        server = HardenedTestServer(app, settings=settings, host="127.0.0.1")
        client: TestClient[Any, web.Application] = TestClient(server)
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in reversed(clients):
        await c.close()
