"""Entra ID credentials: azure-identity's real classes against a local token endpoint.

`tests.support.identity.TokenEndpoint` plays the managed-identity endpoint (App Service
protocol, plain HTTP) and Entra ID's token endpoint (HTTPS, for workload identity), both on
127.0.0.1. Every variable through which azure-identity could find a real identity or endpoint
is cleared first, so nothing here leaves the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from azure.identity.aio import (
    DefaultAzureCredential,
    ManagedIdentityCredential,
    WorkloadIdentityCredential,
)
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from gateway.app import CLIENTS, CREDENTIAL, create_app, default_client_factory
from gateway.audit.drain import drain
from gateway.audit.drain import main as drain_main
from gateway.config import ConfigError, load_settings
from gateway.servicebus import admin as admin_module
from gateway.servicebus.client import SdkNamespaceClient
from gateway.servicebus.identity import SharedCredential, create_credential
from sblocal.config import BrokerConfig, NamespaceConfig, QueueConfig
from sblocal.server import LocalBroker
from tests.conftest import HardenedTestServer
from tests.support.identity import AZURE_ENV, TokenEndpoint

pytestmark = pytest.mark.integration  # local token endpoints on 127.0.0.1, subprocesses

SCOPE = "https://servicebus.azure.net/.default"


@pytest.fixture(autouse=True)
def no_real_identity(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture
async def idp(tmp_path: Path) -> AsyncIterator[TokenEndpoint]:
    async with TokenEndpoint(tmp_path / "certs") as endpoint:
        yield endpoint


@pytest.fixture
def managed_env(idp: TokenEndpoint, monkeypatch: pytest.MonkeyPatch) -> TokenEndpoint:
    for name, value in idp.managed_identity_env().items():
        monkeypatch.setenv(name, value)
    return idp


def spy_close(credential: Any) -> list[bool]:
    """Record calls to the real credential's close (and still close it)."""
    calls: list[bool] = []
    original = credential.close

    async def close() -> None:
        calls.append(True)
        await original()

    credential.close = close
    return calls


def test_the_setting_picks_the_class(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("jwt")
    monkeypatch.setenv("AZURE_TENANT_ID", "tenant")
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(token_file))
    picked = {
        kind: type(create_credential(kind, "client-1"))  # type: ignore[arg-type]
        for kind in ("workload", "managed", "default")
    }
    assert picked == {
        "workload": WorkloadIdentityCredential,
        "managed": ManagedIdentityCredential,
        "default": DefaultAzureCredential,
    }
    with pytest.raises(ValueError, match="azure_credential"):
        create_credential("cli")  # type: ignore[arg-type]


def test_workload_identity_without_its_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"azure_credential=workload: .*WorkloadIdentity"):
        SharedCredential("workload", "client-1").get()


@pytest.mark.integration  # a `gateway serve` subprocess
def test_gateway_serve_without_the_credentials_environment_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k not in AZURE_ENV and "SBGATE_" not in k}
    env |= {
        "SBGATE_PRIMARY_NAMESPACE": "contoso.servicebus.windows.net",
        "SBGATE_ENTITIES": "queue:orders",
        "SBGATE_AZURE_CREDENTIAL": "workload",
        "SBGATE_LISTEN_PORT": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("configuration error: azure_credential=workload:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_settings_name_the_credential() -> None:
    s = load_settings({"SBGATE_AZURE_CREDENTIAL": "managed", "SBGATE_AZURE_CLIENT_ID": "c-1"})
    assert (s.azure_credential, s.azure_client_id) == ("managed", "c-1")
    assert load_settings({}).azure_credential == "default"
    with pytest.raises(ConfigError, match="azure_credential"):
        load_settings({"SBGATE_AZURE_CREDENTIAL": "DefaultAzureCredential"})


async def test_managed_identity_gets_and_caches_a_token(managed_env: TokenEndpoint) -> None:
    shared = SharedCredential("managed", "client-7")
    credential = shared.get()
    assert shared.get() is credential  # one object, however often it is asked for
    first = await credential.get_token(SCOPE)
    again = await credential.get_token(SCOPE)
    assert first.token == again.token == managed_env.issued[0]
    (req,) = managed_env.requests  # cached: one request for two get_token calls
    assert req.params == {
        "api-version": "2019-08-01",
        "resource": "https://servicebus.azure.net",
        "client_id": "client-7",
    }
    closes = spy_close(credential)
    await shared.aclose()
    await shared.aclose()
    assert closes == [True] and shared.closed
    with pytest.raises(RuntimeError, match="closed"):
        shared.get()


async def test_workload_identity_posts_the_federated_token(
    idp: TokenEndpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = tmp_path / "azure-identity-token"
    token_file.write_text("federated-jwt-from-kubernetes")
    for name, value in idp.workload_identity_env(
        token_file, tenant="tenant-1", client_id="client-2"
    ).items():
        monkeypatch.setenv(name, value)
    shared = SharedCredential("workload", connection_verify=idp.ca_cert)
    try:
        token = await shared.get().get_token(SCOPE)
    finally:
        await shared.aclose()
    assert token.token == idp.issued[0]
    (req,) = idp.requests
    assert req.path == "/tenant-1/oauth2/v2.0/token"
    assert req.form["client_assertion"] == "federated-jwt-from-kubernetes"
    assert req.form["client_id"] == "client-2"
    assert req.form["scope"] == SCOPE


def keyless_pair(tmp_path: Path) -> BrokerConfig:
    """Namespaces that accept any token (a JWT from the local endpoint), with management."""
    return BrokerConfig(
        namespaces=(
            NamespaceConfig("primary", keys=(), queues=(QueueConfig("orders"),)),
            NamespaceConfig("secondary", keys=()),
        ),
        cert_dir=tmp_path / "broker-certs",
    )


async def test_one_credential_for_every_client_and_the_admin_closed_at_shutdown(
    managed_env: TokenEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalBroker(keyless_pair(tmp_path)) as broker:
        admins: list[Any] = []
        mgmt = f"localhost:{broker.management_port('secondary')}"

        class LocalAdmin(ServiceBusAdministrationClient):
            # The namespace's name points at its AMQP port; its management API listens on
            # another one here, with a development certificate.
            def __init__(self, namespace: str, credential: Any, **kwargs: Any) -> None:
                admins.append((namespace, credential))
                kwargs["connection_verify"] = broker.ca_cert
                super().__init__(mgmt, credential, **kwargs)

        monkeypatch.setattr(admin_module, "ServiceBusAdministrationClient", LocalAdmin)
        settings = load_settings(
            {
                "SBGATE_PRIMARY_NAMESPACE": f"localhost:{broker.amqp_port('primary')}",
                "SBGATE_PRIMARY_NAME": "primary",
                "SBGATE_SECONDARY_NAMESPACE": f"localhost:{broker.amqp_port('secondary')}",
                "SBGATE_SECONDARY_NAME": "secondary",
                "SBGATE_ENTITIES": "queue:orders",
                "SBGATE_AZURE_CREDENTIAL": "managed",
                "SBGATE_AZURE_CLIENT_ID": "client-9",
                "SBGATE_BACKLOG_QUEUE_COUNT": "2",
                "SBGATE_ENABLE_SYPHON": "false",
            }
        )
        shared = SharedCredential(settings.azure_credential, settings.azure_client_id)
        app = create_app(
            settings,
            credential=shared,
            client_factory=default_client_factory(settings, shared, use_tls=False),
        )
        client: TestClient[Any, Any] = TestClient(
            HardenedTestServer(app, settings=settings, host="127.0.0.1")
        )
        await client.start_server()
        try:
            credential = shared.get()
            closes = spy_close(credential)
            assert app[CREDENTIAL] is shared
            sdk_clients = list(app[CLIENTS].values())
            assert len(sdk_clients) == 2
            assert all(isinstance(c, SdkNamespaceClient) for c in sdk_clients)
            assert all(c.credential is credential for c in sdk_clients)  # type: ignore[attr-defined]
            assert admins and all(cred is credential for _, cred in admins)
            # The admin client created the backlog queues with a token from the endpoint.
            queues = {e["path"] for e in await broker_entities(broker, "secondary")}
            assert {"primary/x-servicebus-transfer/0", "primary/x-servicebus-transfer/1"} <= queues
            resp = await client.post("/queues/orders/messages", data=b"hello")
            assert resp.status == 201, await resp.text()
        finally:
            await client.close()
        assert closes == [True] and shared.closed
        # Every token came from the one credential: one request per scope it was asked for.
        resources = [r.params["resource"] for r in managed_env.requests]
        assert len(resources) == len(set(resources)) and resources
        assert all(r.params["client_id"] == "client-9" for r in managed_env.requests)


async def broker_entities(broker: LocalBroker, ns: str) -> list[dict[str, Any]]:
    from sblocal.testing import ControlClient

    return await ControlClient(broker.control_url).entities(ns)


async def test_drain_by_namespace_with_a_managed_identity(
    managed_env: TokenEndpoint, tmp_path: Path
) -> None:
    async with LocalBroker(keyless_pair(tmp_path)) as broker:
        from azure.servicebus import ServiceBusMessage
        from azure.servicebus.aio import ServiceBusClient

        async with ServiceBusClient.from_connection_string(
            broker.connection_string("primary")
        ) as sb:
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages([ServiceBusMessage(b"x", message_id="m-1")])
        shared = SharedCredential("managed")
        try:
            summary = await drain(
                None,
                ["orders"],
                tmp_path / "delivered.jsonl",
                fully_qualified_namespace=f"localhost:{broker.amqp_port('primary')}",
                credential=shared.get(),
                idle_timeout=0.5,
                client_kwargs={"use_tls": False, "retry_total": 0},
            )
        finally:
            await shared.aclose()
    assert summary.total == 1 and not summary.errors
    assert b'"m-1"' in (tmp_path / "delivered.jsonl").read_bytes()
    assert managed_env.requests  # the token came from the local endpoint


def test_drain_cli_credential_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "d.jsonl")
    cs = "Endpoint=sb://localhost:1/;SharedAccessKeyName=a;SharedAccessKey=b"
    # A credential without --namespace is a usage error, as are both kinds of namespace.
    assert drain_main(["--connection-string", cs, "--credential", "managed", "--entity", "q",
                       "--out", out]) == 2  # fmt: skip
    assert "--namespace" in capsys.readouterr().err
    assert drain_main(["--connection-string", cs, "--namespace", "x.servicebus.windows.net",
                       "--entity", "q", "--out", out]) == 2  # fmt: skip
    # Workload identity without the webhook's environment: one clear line, exit 2.
    assert drain_main(["--namespace", "x.servicebus.windows.net", "--credential", "workload",
                       "--entity", "q", "--out", out]) == 2  # fmt: skip
    assert "WorkloadIdentityCredential" in capsys.readouterr().err


def test_syphon_accepts_namespaces_and_credential_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from gateway.cli import _load

    for name in list(__import__("os").environ):
        if name.startswith("SBGATE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SBGATE_ENTITIES", "queue:orders")
    args = argparse.Namespace(
        config=None,
        namespace="contoso.servicebus.windows.net",
        secondary_namespace="contoso-dr.servicebus.windows.net",
        credential="workload",
        client_id=None,
    )
    settings = _load(args)
    (pair,) = settings.pairs
    assert pair.primary.fully_qualified_namespace == "contoso.servicebus.windows.net"
    assert pair.secondary is not None and pair.secondary.name == "contoso-dr"
    assert settings.azure_credential == "workload"


def test_connection_strings_are_parsed_by_the_sdk() -> None:
    from azure.servicebus import parse_connection_string

    bad = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=send"
    with pytest.raises(ValueError) as sdk_error:
        parse_connection_string(bad)
    with pytest.raises(ConfigError) as ours:
        load_settings({"SBGATE_PRIMARY_CONNECTION_STRING": bad, "SBGATE_ENTITIES": "q"})
    assert str(sdk_error.value) in str(ours.value)
    assert "SharedAccessKeyName and SharedAccessKey" in str(ours.value)
