"""The app factory's wiring: what each cleanup context starts, under which key, and the
reverse order in which aiohttp closes them. Fakes at the ports only; nothing listens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway.app import (
    CLIENTS,
    CREDENTIAL,
    DISPATCHER,
    PAIRS,
    PLAN,
    STORE,
    SYPHONS,
    create_app,
)
from gateway.config import NamespaceSettings, Settings, load_settings
from gateway.core.failover import Failover
from gateway.core.message import OutboundMessage
from gateway.core.ports import BacklogPort
from gateway.core.router import PrimaryRouter
from gateway.servicebus.identity import SharedCredential
from gateway.state.memory import MemoryStateStore
from gateway.web.admin import FAILOVER
from gateway.web.handlers import EDGE, ROUTER

ENV = {
    "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://p.invalid/;SharedAccessKeyName=k;"
    "SharedAccessKey=k",
    "SBGATE_PRIMARY_NAME": "primary",
    "SBGATE_SECONDARY_CONNECTION_STRING": "Endpoint=sb://s.invalid/;SharedAccessKeyName=k;"
    "SharedAccessKey=k",
    "SBGATE_SECONDARY_NAME": "secondary",
    "SBGATE_ENTITIES": "queue:orders",
    "SBGATE_BACKLOG_QUEUE_COUNT": "2",
    "SBGATE_ENABLE_SYPHON": "false",
    "SBGATE_LOG_FORMAT": "text",
}


class Journal(list[str]):
    """What was started and closed, in order."""


class Sender:
    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        return None

    async def close(self) -> None:
        return None


class Client:
    def __init__(self, name: str, journal: Journal) -> None:
        self._name, self._journal = name, journal
        journal.append(f"open client {name}")

    @property
    def name(self) -> str:
        return self._name

    async def open_sender(self, path: str) -> Sender:
        return Sender()

    async def close(self) -> None:
        self._journal.append(f"close client {self._name}")


class Store(MemoryStateStore):
    journal: Journal

    async def start(self) -> None:
        self.journal.append("start store")
        await super().start()

    async def close(self) -> None:
        self.journal.append("close store")
        await super().close()


class Credential(SharedCredential):
    journal: Journal

    async def aclose(self) -> None:
        self.journal.append("close credential")
        await super().aclose()


def build(env: dict[str, str], journal: Journal, **kwargs: Any) -> web.Application:
    settings = load_settings({k: v for k, v in {**ENV, **env}.items() if v})

    def store(s: Settings) -> MemoryStateStore:
        made = Store(s.replica_id)
        made.journal = journal
        return made

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        journal.append(f"provision {ns.name}")
        return paths

    credential = Credential("default")
    credential.journal = journal
    return create_app(
        settings,
        client_factory=lambda ns: Client(ns.name, journal),
        store_factory=store,
        provisioner=provision,
        credential=credential,
        **kwargs,
    )


async def started(app: web.Application) -> web.AppRunner:
    """Start-up as `gateway serve` runs it, without a site (nothing listens)."""
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


async def test_failover_app_starts_in_order_and_closes_in_reverse() -> None:
    journal = Journal()
    runner = await started(build({}, journal))
    app = runner.app
    assert app[PLAN].failover and not app[PLAN].syphon
    assert sorted(app[CLIENTS]) == ["primary", "secondary"]
    assert isinstance(app[STORE], Store)
    assert app[PAIRS]["default"].backlog_queues == (
        "primary/x-servicebus-transfer/0",
        "primary/x-servicebus-transfer/1",
    )
    assert isinstance(app[ROUTER], Failover) and app[FAILOVER] is app[ROUTER]
    assert app[SYPHONS] == []
    assert app[EDGE].lifecycle.ready
    assert journal == [
        "open client primary",
        "open client secondary",
        "start store",
        "provision secondary",
    ]
    journal.clear()
    await runner.cleanup()
    assert app[EDGE].lifecycle.draining and not app[EDGE].lifecycle.ready
    # Reverse order: the store after everything that reads it, the clients after the
    # dispatcher, the credential last.
    assert journal == [
        "close store",
        "close client primary",
        "close client secondary",
        "close credential",
    ]
    assert app[CREDENTIAL].closed


async def test_without_a_secondary_the_app_keeps_no_state_and_routes_to_the_primary() -> None:
    journal = Journal()
    env = {"SBGATE_SECONDARY_CONNECTION_STRING": "", "SBGATE_SECONDARY_NAME": ""}
    runner = await started(build(env, journal))
    app = runner.app
    assert not app[PLAN].shared_state
    assert STORE not in app and FAILOVER not in app
    assert isinstance(app[ROUTER], PrimaryRouter)
    assert app[PAIRS] == {} and app[SYPHONS] == []
    assert app[DISPATCHER] is not None
    assert journal == ["open client primary"]
    await runner.cleanup()
    assert journal[-2:] == ["close client primary", "close credential"]


async def test_syphon_mode_runs_the_syphon_and_no_failover() -> None:
    journal = Journal()
    ports: list[str] = []

    def backlog(ns: NamespaceSettings, client: object) -> BacklogPort | None:
        ports.append(ns.name)
        return None  # no receiver: the pair's syphon stays off (and says so)

    runner = await started(build({}, journal, mode="syphon", backlog_factory=backlog))
    app = runner.app
    assert app[PLAN].syphon and not app[PLAN].failover
    assert isinstance(app[ROUTER], PrimaryRouter) and FAILOVER not in app
    assert ports == ["secondary"] and app[SYPHONS] == []
    assert app[EDGE].lifecycle.checks, "gateway syphon's readiness watches its syphons"
    await runner.cleanup()
    assert journal[-1] == "close credential"
