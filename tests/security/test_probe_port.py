"""The probe port (`gateway.web.probes`): probes answered while the listen port is paused.

Over real sockets, served as `gateway serve` serves (`ShedSite` plus `serving_probes`); the
listener is paused as the shedder pauses it. Nothing here times anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from gateway.app import create_app, edge_runner
from gateway.config import load_settings
from gateway.web.handlers import EDGE
from gateway.web.listener import ShedSite
from gateway.web.probes import PROBE_PATHS, probe_app, serving_probes
from gateway.web.runner import HardenedAppRunner
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import broker_env
from tests.support.processes import GatewayProcess, free_port
from tests.support.waiting import eventually

from .test_slow_clients import open_raw, read_response, request_head

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def serving(
    broker: BrokerProcess, **env: str
) -> AsyncIterator[tuple[HardenedAppRunner, ShedSite, int]]:
    """The app on a `ShedSite` (free port) and its probe port: (runner, site, probe port)."""
    probe_port = free_port()
    settings = load_settings(broker_env(broker, SBGATE_PROBE_PORT=str(probe_port), **env))
    runner = edge_runner(create_app(settings), settings)
    await runner.setup()
    try:
        site = ShedSite(runner, "127.0.0.1", 0)
        await site.start()
        async with serving_probes(runner.app, settings) as probes:
            assert probes is not None
            yield runner, site, probe_port
    finally:
        await runner.cleanup()


async def get(
    port: int, path: str, method: str = "GET", host: str = "127.0.0.1"
) -> tuple[int, bytes]:
    reader, writer = await open_raw(port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1\r\n\r\nx"
        writer.write(head.encode())
        return await read_response(reader)
    finally:
        writer.close()


def sample(text: bytes, series: str) -> float:
    for line in text.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in /metrics")


async def test_probes_are_answered_on_the_probe_port_while_the_listen_port_is_paused(
    broker: BrokerProcess, control: ControlClient
) -> None:
    async with serving(broker) as (_runner, site, probe_port):
        _, metrics = await get(probe_port, "/metrics")
        assert sample(metrics, "sbgate_http_listening") == 1
        site.pause("connections")  # as the shedder pauses it at the connection cap
        assert not site.listening
        with pytest.raises(ConnectionRefusedError):
            await open_raw(site.port)
        assert (await get(probe_port, "/healthz"))[0] == 200
        status, body = await get(probe_port, "/readyz")
        assert status == 200, body
        status, metrics = await get(probe_port, "/metrics")
        assert status == 200
        assert sample(metrics, "sbgate_http_listening") == 0
        assert sample(metrics, 'sbgate_http_listener_pauses_total{reason="connections"}') == 1
        assert sample(metrics, 'sbgate_http_listener_pauses_total{reason="loop_lag"}') == 0
        # Only the probes: a send on the probe port is a JSON 404, and nothing is sent.
        reader, writer = await open_raw(probe_port)
        writer.write(request_head() + b"x")
        status, body = await read_response(reader)
        writer.close()
        assert status == 404 and orjson.loads(body)["error"] == "not_found", body
        assert (await get(probe_port, "/healthz", "POST"))[0] == 405
        # Open mode (no rules, loopback): the main app's Host check applies here too.
        status, body = await get(probe_port, "/metrics", host="rebound.example")
        assert status == 421, body
        site.resume()
        await eventually(lambda: site.listening, what="listening again")
        assert site.pauses("connections") == 1
        assert site.paused_seconds("connections") >= 0
        assert await control.messages("primary", "orders") == []


async def test_readiness_fails_on_the_probe_port_while_draining_and_leaving_closes_it(
    broker: BrokerProcess,
) -> None:
    async with serving(broker) as (runner, _site, probe_port):
        runner.app[EDGE].lifecycle.draining = True
        status, body = await get(probe_port, "/readyz")
        assert status == 503 and orjson.loads(body)["status"] == "draining"
        assert (await get(probe_port, "/healthz"))[0] == 200
    with pytest.raises(ConnectionRefusedError):
        await open_raw(probe_port)


async def test_the_loop_lag_and_accept_queue_pauses_are_counted_apart(
    broker: BrokerProcess,
) -> None:
    async with serving(broker) as (runner, site, _):
        shedder = runner.shedder
        assert shedder is not None
        shedder.loop_sampled(1.0)
        shedder.loop_sampled(1.0)  # over the bound twice in a row: the listener pauses
        assert not site.listening
        assert site.pauses("loop_lag") == 1 and site.pauses("connections") == 0
        shedder.loop_sampled(0.0)
        assert site.pauses("loop_lag") == 1


async def test_the_probe_port_is_off_by_default_and_serves_the_syphon_mode_too(
    broker: BrokerProcess,
) -> None:
    settings = load_settings(broker_env(broker))
    assert settings.probe_port == 0
    async with serving_probes(create_app(settings), settings) as site:
        assert site is None
    syphon = probe_app(create_app(settings, mode="syphon"))
    paths = {r.resource.canonical for r in syphon.router.routes() if r.resource is not None}
    assert paths == set(PROBE_PATHS)


@pytest.mark.parametrize("command", ["serve", "syphon"])
async def test_gateway_serve_and_syphon_answer_on_the_probe_port_until_they_exit(
    broker: BrokerProcess, tmp_path: Path, command: str
) -> None:
    """The commands as the chart runs them: probes answered on the probe port, readiness 503
    there during the drain (a second signal ends it), the port closed at exit."""
    probe_port = free_port()
    env = broker_env(broker, SBGATE_PROBE_PORT=str(probe_port), SBGATE_DRAIN_DELAY="60")
    async with GatewayProcess(
        command, env, port=free_port(), log_dir=tmp_path, command=command
    ) as gw:
        assert (await get(probe_port, "/healthz"))[0] == 200
        assert (await get(probe_port, "/readyz"))[0] == 200
        gw.terminate()

        async def draining() -> bool:
            return (await get(probe_port, "/readyz"))[0] == 503

        await eventually(draining, what="readiness 503 on the probe port while draining")
        gw.terminate()  # a second signal ends the drain
        assert await gw.wait(30) == 0
    with pytest.raises(ConnectionRefusedError):
        await open_raw(probe_port)
