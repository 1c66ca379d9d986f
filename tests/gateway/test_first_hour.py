"""What a newcomer and an operator in a first incident are told (issue #37): every state
change is a log line, an operator's with the admin key's rule; every request that is no send
gets an access line too; the development profile shows client errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from gateway.core import presence
from gateway.core.entities import EntityRef
from gateway.logs import ACCESS_LOGGER
from gateway.web import rest
from gateway.web.admin import PRESENCE
from gateway.web.handlers import EDGE
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_auth_http import ADMIN_KEY, ENV, token
from tests.gateway.test_failover import FAILOVER
from tests.support.processes import GatewayProcess, free_port
from tests.support.waiting import eventually


def admin() -> dict[str, str]:
    return {"Authorization": token(None, "admin", ADMIN_KEY)}


async def access_lines(capsys: pytest.CaptureFixture[str], seen: list[str], want: str) -> None:
    """Wait for an access line containing `want` on stderr (the buffer flushes per turn)."""

    def shown() -> bool:
        seen.append(capsys.readouterr().err)
        return any(want in line for line in "".join(seen).splitlines())

    await eventually(shown, what=f"an access line with {want}")


async def test_an_operators_failover_and_healthy_are_logged_with_the_admin_rule(
    gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.core.failover")
    gw = await gateway({**ENV, **FAILOVER, "SBGATE_PING_PRIMARY_INTERVAL": "60"})
    resp = await gw.post("/admin/entities/orders/failover", headers=admin())
    assert resp.status == 200
    resp = await gw.post("/admin/entities/orders/healthy", headers=admin())
    assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.core.failover"]
    assert "entity orders: healthy -> failed_over (operator: forced failover, by admin)" in lines
    assert "entity orders: failed_over -> healthy (operator: marked healthy, by admin)" in lines
    [forced] = [r for r in caplog.records if "forced failover" in r.getMessage()]
    assert forced.__dict__["operator"] == "admin" and forced.__dict__["to"] == "failed_over"


async def test_an_operators_action_in_open_mode_says_so(
    gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.core.failover")
    gw = await gateway({**FAILOVER, "SBGATE_PING_PRIMARY_INTERVAL": "60"})
    assert (await gw.post("/admin/entities/orders/failover")).status == 200
    assert any("by open mode" in r.getMessage() for r in caplog.records)


async def test_admin_requests_and_edge_refusals_get_an_access_line(
    gateway: GatewayFactory, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    gw = await gateway({**ENV, **FAILOVER, "SBGATE_LOG_FORMAT": "json"})
    seen: list[str] = []
    assert (await gw.get("/admin/entities", headers=admin())).status == 200
    await access_lines(capsys, seen, '"path":"/admin/entities","status":200,')
    [line] = [
        orjson.loads(x) for x in "".join(seen).splitlines() if '"path":"/admin/entities"' in x
    ]
    assert line["key_name"] == "admin" and line["method"] == "GET" and line["level"] == "INFO"
    assert (await gw.get("/")).status == 405
    await access_lines(capsys, seen, '"method":"GET","path":"/","status":405')
    assert (await gw.get("/healthz")).status == 200  # a probe's success: no line
    assert (await gw.get("/readyz")).status == 200
    assert (await gw.get("/admin/entities")).status == 401
    await access_lines(capsys, seen, '"path":"/admin/entities","status":401')
    assert not [x for x in "".join(seen).splitlines() if "/healthz" in x or "/readyz" in x]


async def test_the_development_profile_writes_client_errors_at_warning(
    gateway: GatewayFactory, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`gateway serve --dev` keeps the access logger at WARNING (failures only), and a client
    error is one of them: a 401 on a send, a 404, a 405 each print a line; a 201 does not."""
    caplog.set_level(logging.WARNING, logger=ACCESS_LOGGER)

    def as_dev(app: web.Application) -> None:
        app[EDGE].access_log.client_errors = logging.WARNING  # what `_serve(dev=True)` sets

    gw = await gateway({**ENV, "SBGATE_LOG_FORMAT": "json"}, prepare=as_dev)
    seen: list[str] = []
    assert (await gw.post("/orders/messages", data=b"x")).status == 401
    await access_lines(capsys, seen, '"status":401')
    send = {"Authorization": token("orders")}
    assert (
        await gw.post("/nope/messages", data=b"x", headers=send)
    ).status == 401  # sr does not cover it
    assert (await gw.get("/orders/messages/head")).status == 405
    await access_lines(capsys, seen, '"status":405')
    assert (await gw.post("/orders/messages", data=b"x", headers=send)).status == 201
    assert (await gw.post("/orders/messages", data=b"y" * 300_000, headers=send)).status == 413
    await access_lines(capsys, seen, '"status":413')
    lines = [
        orjson.loads(x) for x in "".join(seen).splitlines() if '"logger":"gateway.requests"' in x
    ]
    assert lines and all(x["level"] == "WARNING" for x in lines)
    assert not [x for x in lines if x["status"] == 201]


# -- start-up errors: one clear line (subprocesses: slow) -------------------------------------


async def run_gateway(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`gateway serve --dev ...` to its end (bounded); its exit code, stdout and stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SBGATE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--dev",
        *args,
        env={**clean, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.integration
@pytest.mark.slow
async def test_a_port_in_use_is_one_line_that_says_what_to_set() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await run_gateway("--port", str(port))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: the address is in use; another process "
        "listens there (a gateway already running?): stop it, or choose another port: "
        f"SBGATE_LISTEN_PORT={port + 1} (or --port {port + 1})"
    ]


@pytest.mark.integration
@pytest.mark.slow
async def test_a_certificate_file_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    code, out, err = await run_gateway(
        env={
            "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://localhost/;SharedAccessKeyName=a;"
            "SharedAccessKey=b;UseDevelopmentEmulator=true",
            "SBGATE_ENTITIES": "queue:orders",
            "SBGATE_PRIMARY_ADMIN_CA_CERT": str(tmp_path / "ca.pem"),
        }
    )
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "configuration error: SBGATE_PRIMARY_ADMIN_CA_CERT ([pairs.default.primary] "
        f"admin_ca_cert): cannot read {tmp_path / 'ca.pem'}: No such file or directory"
    ]


@pytest.mark.integration
@pytest.mark.slow
async def test_an_unreachable_secondary_is_one_line_and_ready_means_listening(
    tmp_path: Path,
) -> None:
    """Nothing listens at the secondary: one ERROR line for its ten backlog queues (without
    waiting for each), then `gateway ready` once the port accepts connections."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # bound, never listening: connections are refused
        port = free_port()

        def cs(p: int) -> str:
            return (
                f"Endpoint=sb://127.0.0.1:{p}/;SharedAccessKeyName=a;SharedAccessKey=b;"
                "UseDevelopmentEmulator=true"
            )

        env = {
            "SBGATE_PRIMARY_CONNECTION_STRING": cs(dead),
            "SBGATE_PRIMARY_NAME": "p",
            "SBGATE_SECONDARY_CONNECTION_STRING": cs(dead),
            "SBGATE_SECONDARY_NAME": "s",
            "SBGATE_ENTITIES": "queue:orders",
            "SBGATE_CONNECT_TIMEOUT": "3",
        }
        async with GatewayProcess(
            "unreachable", env, port=port, args=["--dev"], log_dir=tmp_path
        ) as gw:
            errors = [x for x in gw.output().decode().splitlines() if " ERROR " in x]
            assert len([x for x in errors if "backlog queues" in x]) == 1, errors
            assert (
                "10 backlog queues (p/x-servicebus-transfer/0 to p/x-servicebus-transfer/9)"
                in errors[0]
            )
            assert "the s namespace's management endpoint cannot be reached" in errors[0]
            assert "Traceback" not in gw.output().decode()
            assert " INFO    gateway: gateway ready" in gw.output().decode()


# -- a configured entity the primary lacks --------------------------------------------------


async def test_an_entity_the_primary_lacks_is_said_parked_and_home_once_created(
    gateway: GatewayFactory,
    control: ControlClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One WARNING line naming it and what to do, `sbgate_entity_missing`, the reason in
    `GET /admin/entities`; a send is parked in the backlog (202, never refused: the entity
    may have been deleted); once it is created the line clears and the message comes home."""
    monkeypatch.setattr(presence, "RECHECK_INTERVAL", 0.2)
    caplog.set_level(logging.INFO, logger="gateway.core.presence")
    name = f"payments-{uuid.uuid4().hex[:8]}"
    env = {
        **FAILOVER,
        "SBGATE_PING_PRIMARY_INTERVAL": "0.5",
        "SBGATE_ENABLE_SYPHON": "true",
        "SBGATE_ENTITIES": f"queue:orders,topic:events,queue:{name}",
    }
    gw = await gateway(env)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "gateway.core.presence"]

    await eventually(lambda: any(name in line for line in said()), what="the missing line")
    [line] = [x for x in said() if name in x]
    assert line.startswith(f"entity {name}: the queue does not exist at the primary namespace")
    assert f'curl -X POST $CTRL/namespaces/primary/entities -d \'{{"path": "{name}"' in line
    assert "parked in the backlog queues (202)" in line
    metrics = await (await gw.get("/metrics")).text()
    assert f'sbgate_entity_missing{{entity="{name}"}} 1.0' in metrics
    assert 'sbgate_entity_missing{entity="orders"} 0.0' in metrics
    rows = {r["entity"]: r for r in (await (await gw.get("/admin/entities")).json())["entities"]}
    assert rows[name]["missing"] == line.split(": ", 1)[1] and rows["orders"]["missing"] is None

    resp = await gw.post(f"/queues/{name}/messages", data=b"parked")
    assert resp.status == 202 and (await resp.json())["route"] == "backlog"
    await control.create_entity("primary", name, "queue")
    await eventually(lambda: f"entity {name} now exists at the primary" in said())
    assert len([x for x in said() if name in x and "does not exist" in x]) == 1  # said once
    metrics = await (await gw.get("/metrics")).text()
    assert f'sbgate_entity_missing{{entity="{name}"}} 0.0' in metrics

    async def home() -> bool:
        return (await control.entity("primary", name))["active"] == 1

    await eventually(home, within=30, what="the parked message moved home")


class _Check:
    """A check whose answers the test sets (the port: no management API)."""

    def __init__(self) -> None:
        self.answer: dict[str, str] | presence.CheckUnavailable = {}
        self.times: list[float] = []  # when each check ran (loop time)

    async def __call__(self, entities: Sequence[EntityRef]) -> dict[str, str]:
        self.times.append(asyncio.get_running_loop().time())
        if isinstance(self.answer, presence.CheckUnavailable):
            raise self.answer
        return dict(self.answer)


class _Gauge:
    def __init__(self) -> None:
        self.values: dict[str, bool] = {}

    def entity_missing(self, entity: str, missing: bool) -> None:
        self.values[entity] = missing


@pytest.mark.unit
async def test_each_change_is_one_line_and_a_check_it_may_not_run_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.core.presence")
    entities = [EntityRef("orders", "queue", "default"), EntityRef("Pay", "queue", "default")]
    check, gauge = _Check(), _Gauge()
    p = presence.EntityPresence(entities, check, gauge)
    for e in entities:
        gauge.entity_missing(e.path, False)
    check.answer = {"Pay": "the queue does not exist"}
    await p.check_once()
    await p.check_once()  # still missing: no second line
    assert p.reason("pay") == "the queue does not exist" and gauge.values["Pay"] is True
    check.answer = presence.CheckUnavailable("unreachable", retry=True)
    await p.check_once()
    assert p.unchecked == "unreachable" and p.reason("pay") is not None  # known facts stay
    check.answer = {}
    await p.check_once()
    assert p.unchecked is None and p.reason("pay") is None and gauge.values["Pay"] is False
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages == [
        ("WARNING", "entity Pay: the queue does not exist"),
        ("WARNING", "cannot check that the configured entities exist: unreachable"),
        ("INFO", "the configured entities can be checked again"),
        ("INFO", "entity Pay now exists at the primary"),
    ]
    # No right to list: said once (INFO: a Send-only key is a normal set-up), never retried.
    check.answer = presence.CheckUnavailable("no Manage right", retry=False)
    p.start()
    await asyncio.wait_for(p._task, 5)  # type: ignore[arg-type]  # it ends by itself
    await p.close()
    assert caplog.records[-1].levelname == "INFO" and p.unchecked == "no Manage right"


# -- the smaller surprises --------------------------------------------------------------------


@pytest.mark.unit
def test_a_broker_property_in_the_wrong_case_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`messageId` is ignored (as Service Bus ignores it), so a retry would store a second
    copy: one WARNING line says so, once per name."""
    monkeypatch.setattr(rest, "_SAID_NAMES", set())
    caplog.set_level(logging.WARNING, logger="gateway.web.rest")
    for _ in range(3):
        m = rest.parse_single(b"x", None, {}, '{"messageId": "m-1", "Label": "ok"}', None)
        assert m.message_id != "m-1" and m.subject == "ok"
    assert [r.getMessage() for r in caplog.records] == [
        "BrokerProperties 'messageId' is ignored: names are case-sensitive, as in Service Bus; "
        "did you mean 'MessageId'?"
    ]
    rest.parse_single(b"x", None, {}, '{"MessageId": "m-2", "Custom": 1}', None)
    assert len(caplog.records) == 1  # right names and unknown ones: nothing to say


@pytest.mark.unit
def test_serve_and_syphon_help_say_what_each_runs_and_drain_shows_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway.cli import main

    helps = []
    for command in ("serve", "syphon"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps.append(capsys.readouterr().out)
    assert "Run the HTTP ingestion gateway" in helps[0] and "Run only the syphon" in helps[1]
    with contextlib.suppress(SystemExit):  # `gateway drain` returns its code
        main(["drain", "--help"])
    drain = " ".join(capsys.readouterr().out.split())
    assert "(default: 2.0)" in drain and "(default: 100)" in drain and "(default: 8)" in drain


async def test_answers_name_the_server_without_versions(gateway: GatewayFactory) -> None:
    gw = await gateway()
    for resp in (await gw.get("/healthz"), await gw.post("/orders/messages", data=b"x")):
        assert resp.headers["Server"] == "sbgate"


async def test_credentials_that_may_not_list_entities_are_said_once_and_not_retried(
    gateway: GatewayFactory, broker: BrokerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A key the management API refuses (a Send-only key in production): one INFO line that
    the check cannot run, no alert series set to 1, `checkUnavailable` in the admin view."""
    caplog.set_level(logging.INFO, logger="gateway.core.presence")
    admin_cs = broker.management_connection_string("primary")
    assert admin_cs is not None
    wrong = re.sub(r"SharedAccessKey=[^;]+", "SharedAccessKey=d3Jvbmc=", admin_cs)
    gw = await gateway({"SBGATE_PRIMARY_ADMIN_CONNECTION_STRING": wrong})

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "gateway.core.presence"]

    await eventually(lambda: bool(said()), what="the cannot-check line")
    [line] = said()
    assert line.levelname == "INFO" and "may not list its entities" in line.getMessage()
    rows = (await (await gw.get("/admin/entities")).json())["entities"]
    assert all(r["missing"] is None and "Manage" in r["checkUnavailable"] for r in rows)
    assert 'sbgate_entity_missing{entity="orders"} 0.0' in await (await gw.get("/metrics")).text()


async def test_an_entity_deleted_while_serving_is_said_at_the_first_send_that_finds_it(
    gateway: GatewayFactory,
    broker: BrokerProcess,
    control: ControlClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Present at start-up, deleted later: the next check is minutes away, but the first
    send that meets "entity not found" asks for one at once."""
    monkeypatch.setattr(presence, "RECHECK_INTERVAL", 0.2)
    monkeypatch.setattr(presence, "CHECK_INTERVAL", 600.0)
    caplog.set_level(logging.INFO, logger="gateway.core.presence")
    name = f"gone-{uuid.uuid4().hex[:8]}"
    await control.create_entity("primary", name, "queue")
    env = {**FAILOVER, "SBGATE_ENTITIES": f"queue:orders,queue:{name}"}
    gw = await gateway(env)
    found = gw.app[PRESENCE]
    await eventually(lambda: found.checks >= 1, what="the start-up check")
    assert found.reason(name) is None
    cs = broker.management_connection_string("primary")
    assert cs is not None
    async with (
        asyncio.timeout(10),
        ServiceBusAdministrationClient.from_connection_string(
            cs, connection_verify=broker.ca_cert
        ) as admin,
    ):
        await admin.delete_queue(name)
    assert (await gw.post(f"/queues/{name}/messages", data=b"x")).status == 202
    await eventually(lambda: found.reason(name) is not None, what="the check the send asked for")
    assert any(f"entity {name}: the queue does not exist" in r.getMessage() for r in caplog.records)


@pytest.mark.unit
async def test_a_burst_of_rechecks_is_one_check_and_none_comes_sooner_than_the_interval() -> None:
    check = _Check()
    p = presence.EntityPresence(
        [EntityRef("orders", "queue", "default")], check, interval=0.2, quiet_interval=600
    )
    p.start()
    try:
        await eventually(lambda: p.checks == 1, what="the first check")
        for burst in (2, 3):
            for _ in range(100):
                p.recheck()
            await eventually(lambda n=burst: p.checks == n, what=f"check {burst}")  # type: ignore[misc]
        assert p.checks == 3  # each burst made one check
        gaps = [b - a for a, b in zip(check.times, check.times[1:], strict=False)]
        assert all(gap >= 0.2 for gap in gaps), gaps  # never sooner than the interval
    finally:
        await p.close()
