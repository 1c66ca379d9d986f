"""The native load generators' parsers read what the real tools print (`bench.native`).

Each test runs the real h2load or wrk (`make bench-tools`) for about a second against a
small aiohttp server on 127.0.0.1 that answers 201, or 503 with Retry-After for one path,
so a change in the tools' output format fails here, not in the middle of a benchmark.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from bench.harness import Window
from bench.native import (
    H2Load,
    parse_h2load,
    parse_h2load_log,
    parse_wrk,
    post_script,
    refused_connects,
    run_h2load,
    wrk_command,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("h2load") is None or shutil.which("wrk") is None,
        reason="h2load and wrk are not installed (make bench-tools)",
    ),
]


async def _answer(request: web.Request) -> web.Response:
    await request.read()
    if request.match_info["name"] == "busy":
        return web.json_response({"error": "saturated"}, status=503, headers={"Retry-After": "1"})
    return web.json_response({"route": "primary"}, status=201)


@pytest.fixture
async def served() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/queues/{name}/messages", _answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_h2load_closed_loop_is_read(served: str) -> None:
    urls = [served + "/queues/orders/messages", served + "/queues/busy/messages"]
    load = H2Load(urls, duration=1.0, connections=4, body=b'{"a":1}', fast=1.0)
    async with asyncio.timeout(60):
        window = await run_h2load(load, cpus=frozenset(), watch={})
    r = window.result
    # Each client cycles through both paths: about as many 503s as 201s.
    assert r["statuses"].get("201", 0) > 0 and r["statuses"].get("503", 0) > 0
    assert abs(r["statuses"]["201"] - r["statuses"]["503"]) <= load.connections
    assert r["summary"]["classes"]["2xx"] == r["statuses"]["201"]
    assert r["summary"]["classes"]["5xx"] == r["statuses"]["503"]
    assert r["unavailable_fast"] == r["statuses"]["503"]  # all within the 1 s `fast`
    assert set(r["latency_ms"]["201"]) == {"p50", "p90", "p99", "max"}
    assert r["total_ok"] == r["statuses"]["201"] and r["rate"] > 0
    assert window.cpu["h2load"] > 0  # its own CPU, from the reaped child's usage


async def test_h2load_open_loop_paces_the_rate(served: str) -> None:
    load = H2Load([served + "/queues/orders/messages"], duration=1.0, connections=4, rate=200)
    async with asyncio.timeout(60):
        window = await run_h2load(load, cpus=frozenset(), watch={})
    r = window.result
    assert r["due"] == 200
    # Paced, not flat out: about the rate asked for (a loaded machine may lag a little).
    assert 100 <= r["statuses"]["201"] <= 220
    assert r["shed"] == max(0, 200 - r["sent"])


async def test_h2load_open_loop_spread_over_processes_paces_the_rate_in_staggered_phases(
    served: str,
) -> None:
    load = H2Load(
        [served + "/queues/orders/messages"], duration=1.0, connections=8, rate=80, spread=4
    )
    parts = load.parts()
    # 8 clients at 10 req/s each: 4 processes of 2, started a quarter of 100 ms apart.
    assert [p.connections for _, p in parts] == [2, 2, 2, 2]
    assert [p.rate for _, p in parts] == [20, 20, 20, 20]
    assert [round(d, 3) for d, _ in parts] == [0.0, 0.025, 0.05, 0.075]
    async with asyncio.timeout(60):
        window = await run_h2load(load, cpus=frozenset(), watch={})
    r = window.result
    assert r["due"] == 80
    assert 40 <= r["statuses"]["201"] <= 90  # the four processes' answers, summed
    assert r["summary"]["classes"]["2xx"] == r["statuses"]["201"]
    assert r["summary"]["started"] == r["sent"] >= r["statuses"]["201"]


async def test_h2load_open_loop_with_a_ramp_sends_a_rate_not_bursts(served: str) -> None:
    # 8 clients at 10 req/s each. Run for a duration, h2load starts every client's timer at
    # once: their requests leave together, ten bursts a second. Connected over a ramp, each
    # client's timer has its own phase and the answers fall in many more 10 ms slots.
    url = served + "/queues/orders/messages"
    bursts = H2Load([url], duration=1.0, connections=8, rate=80, bucket=0.01)
    ramped = H2Load([url], duration=1.0, connections=8, rate=80, bucket=0.01, ramp=0.1)
    assert bursts.steady is None and ramped.steady == (0.1, 1.0)
    assert ramped.requests == 80 and ramped.bound > bursts.bound
    command = ramped.command(Path("body"), Path("log"), None)
    assert "-D" not in command and command[command.index("-n") + 1] == "80"
    # 8 clients over 100 ms: one every 12 ms, the pace h2load connects them at.
    assert command[command.index("-r") + 1] == "1"
    assert command[command.index("--rate-period") + 1] == "12ms"
    async with asyncio.timeout(60):
        unramped = (await run_h2load(bursts, cpus=frozenset(), watch={})).result
        r = (await run_h2load(ramped, cpus=frozenset(), watch={})).result
    assert r["due"] == 80 and r["statuses"]["201"] == 80  # every request, each answered
    assert r["unanswered_at_end"] == 0 and r["shed"] == 0
    # Slots holding answers: ~10 for the bursts (one a client interval), ~80 ramped.
    assert len(r["series"]) >= 2 * len(unramped["series"]), (r["series"], unramped["series"])


def _unused_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port: int = probe.getsockname()[1]
    probe.close()
    return port


async def _refused_then_served(load: H2Load, port: int) -> Window:
    """Run `load` against `port`, where nobody listens yet: every client's first connect is
    refused (a paused listener); a server starts there once a refusal is seen."""
    refused0 = refused_connects()
    app = web.Application()
    app.router.add_post("/queues/{name}/messages", _answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        async with asyncio.timeout(60):
            running = asyncio.create_task(run_h2load(load, cpus=frozenset(), watch={}))
            while refused_connects() == refused0 and not running.done():
                await asyncio.sleep(0.01)  # polling the kernel's counter, with the deadline
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return await running
    finally:
        await runner.cleanup()


async def test_h2load_open_loop_in_slices_brings_back_clients_whose_connect_was_refused() -> None:
    # The next slice connects to the server that started meanwhile.
    port = _unused_port()
    url = f"http://127.0.0.1:{port}/queues/orders/messages"
    load = H2Load([url], duration=2.0, connections=4, rate=40, slice=0.5)
    assert [s.duration for s in load.slices()] == [0.5, 0.5, 0.5, 0.5]
    r = (await _refused_then_served(load, port)).result
    assert r["refused_connects"] >= 1
    assert r["statuses"].get("201", 0) > 0  # the clients came back at a later slice


async def test_sbload_clients_come_back_on_their_own_after_a_refused_connect() -> None:
    # As above, with one sbload run: each client whose connect was refused reconnects after
    # its backoff, so every request is answered once a server listens.
    port = _unused_port()
    url = f"http://127.0.0.1:{port}/queues/orders/messages"
    load = H2Load([url], duration=2.0, connections=4, rate=40, ramp=0.1, generator="sbload")
    r = (await _refused_then_served(load, port)).result
    assert r["generator"] == "sbload" and r["refused_connects"] >= 1
    # Every request sent once its client was back, and answered: none lost, none pipelined.
    assert r["statuses"] == {"201": 80} and r["sent"] == 80 and r["unanswered_at_end"] == 0


async def test_sbload_sends_one_request_at_a_time_after_the_server_closes_a_connection() -> None:
    # The check h2load fails (bench.h2load_reconnect): each odd connection is answered 503 and
    # closed after 0.3 s, so its client falls behind; sbload's client reconnects and sends
    # what it owes one request at a time, and the run ends with every request answered.
    from bench.h2load_reconnect import _Server

    server = _Server()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/queues/orders/messages"
    load = H2Load([url], duration=2.0, connections=4, rate=100, ramp=0.1, generator="sbload")
    try:
        async with asyncio.timeout(60):
            r = (await run_h2load(load, cpus=frozenset(), watch={})).result
    finally:
        listening.close()
    assert set(server.per_read) == {1}, server.per_read  # never two requests in one read
    assert server.connections > 4  # the closed ones were reopened
    assert r["statuses"]["503"] == (server.connections + 1) // 2  # each odd one's first
    assert r["statuses"]["201"] + r["statuses"]["503"] == r["due"] == 200
    assert r["unanswered_at_end"] == 0 and r["failed"] == 0


def test_sbload_is_given_its_arguments() -> None:
    load = H2Load(
        ["http://127.0.0.1:8080/queues/orders/messages"],
        duration=6.0,
        connections=4_000,
        rate=100_000,
        ramp=2.0,
        timeout=10.0,
        generator="sbload",
        headers={"content-type": "application/json"},
    )
    cmd = load.command(Path("body"), Path("log"), None)
    assert cmd[1:] == [
        "127.0.0.1",
        "8080",
        "/queues/orders/messages",
        "body",
        "4000",
        "600000",
        "25.000000",
        "2",
        "10",
        f"{load.bound - 30.0:g}",
        "log",
        "content-type: application/json",
    ]
    assert load.slices() == [load]  # its clients reconnect themselves
    with pytest.raises(ValueError, match="ramp"):
        replace(load, ramp=0.0).command(Path("body"), Path("log"), None)


def test_the_steady_windows_latency_leaves_the_ramp_out() -> None:
    # h2load's log: start (µs since the epoch), status, µs until the end. A slow 201 sent
    # during the ramp (the first 0.5 s), fast ones after it, a 503 and a failure in it.
    t0 = 1_700_000_000_000_000
    rows = [(0, 201, 300_000), (600_000, 201, 2_000), (700_000, 201, 4_000)]
    rows += [(800_000, 503, 1_000), (900_000, -1, 5_000), (1_200_000, 201, 90_000)]
    text = "".join(f"{t0 + start}\t{status}\t{took}\n" for start, status, took in rows)
    parsed = parse_h2load_log(text, fast=0.05, bucket=0.1, steady=(0.5, 1.0))
    assert parsed["latency_ms"]["201"]["max"] == 300.0  # every 201
    assert parsed["latency_steady_ms"]["max"] == 4.0  # the 2xx sent within 0.5..1.0 s
    assert parse_h2load_log(text, fast=0.05, bucket=0.1)["latency_steady_ms"] == {}


def test_answers_are_slotted_from_the_first_start_of_every_process_log() -> None:
    # With --spread > 1 the logs of several h2load processes are concatenated: the second
    # process's lines may start before the first's. Every answer's slot counts from the
    # earliest start of all, not from the earliest seen so far.
    t0 = 1_700_000_000_000_000
    rows = [(500_000, 201, 10_000), (0, 201, 10_000)]  # process 1, then process 2
    text = "".join(f"{t0 + start}\t{status}\t{took}\n" for start, status, took in rows)
    parsed = parse_h2load_log(text, fast=0.05, bucket=0.1)
    assert parsed["series"] == {"0": {"201": 1}, "5": {"201": 1}}


def test_h2load_summary_without_a_run_is_refused() -> None:
    with pytest.raises(ValueError, match="h2load"):
        parse_h2load("connect refused\n")


async def test_wrk_output_is_read(served: str, tmp_path: Path) -> None:
    script = tmp_path / "post.lua"
    script.write_text(post_script(b'{"a":"b"}'))
    results = {}
    for name in ("orders", "busy"):
        cmd = wrk_command(
            f"{served}/queues/{name}/messages", connections=4, duration=1.0, script=script
        )
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            async with asyncio.timeout(30):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        results[name] = parse_wrk(out.decode())
    ok, busy = results["orders"], results["busy"]
    assert ok["requests"] > 0 and ok["non_2xx"] == 0 and ok["rate"] > 0
    assert busy["non_2xx"] == busy["requests"] > 0
    assert set(ok["latency_ms"]) == {"p50", "p75", "p90", "p99"}
    assert 0.5 < ok["wall"] < 5


def test_requests_on_connections_reset_in_the_listeners_queue_count_as_refused_fast() -> None:
    # A 10x phase as measured: the sent excess that got no answer is the requests h2load
    # counted started and never done, each on a connection the listener's pause reset.
    from bench.overload_bench import summarize

    result = {
        "statuses": {"201": 60_000, "503": 240},
        "latency_ms": {"201": {"p50": 40.0, "p99": 80.0}},
        "wall": 8.0,
        "due": 480_000,
        "sent": 61_740,
        "shed": 418_260,
        "unavailable_fast": 240,
        "failed_fast": {},
        "refused_connects": 2_300,
        "unanswered_at_end": 1_500,
        "reset_connections": 1_600,
        "errors": {},
        "series": {},
        "bucket": 0.5,
    }
    phase = {
        "factor": 10.0,
        "offered": 80_000.0,
        "connections": 4_000,
        "peak": 0,
        "result": result,
        "series": {},
        "cpu": {},
        "correctness": "",
        "adaptive": {},
        "adaptive_before": {},
        "shed": {},
    }
    row = summarize(phase, 8_000.0, 0)
    # excess 480,000 - 60,000; sent of it 1,740 (240 503s, 1,500 in flight at the end) and
    # 2,300 refused connects: all refused at once.
    assert (row["reset_in_queue"], row["refused_fast"]) == (1_500, 240 + 2_300 + 1_500)
    assert row["fast_share"] == 1.0 and row["met"]["fast"]
    # Fewer resets than requests left in flight: only those the resets account for.
    row = summarize({**phase, "result": {**result, "reset_connections": 500}}, 8_000.0, 0)
    assert row["reset_in_queue"] == 500
    assert row["fast_share"] == (240 + 2_300 + 500) / (240 + 1_500 + 2_300)
    assert not row["met"]["fast"]


def test_a_phase_whose_every_held_client_is_busy_is_flagged_client_bound() -> None:
    # The broker x10 10x phase as sampled (2026-11-30): ~500 clients left after the ramp,
    # each holding a request, under a head limit of 512.
    from bench.overload_bench import clients_held, table

    def sample(t: float, conns: float, busy: float) -> dict[str, float]:
        return {"t": t, "loop_open_connections": conns, "loop_in_progress": busy}

    ramp = [sample(0.5, 300, 232), sample(1.5, 3_000, 120)]  # outside the steady window
    steady = [sample(t, 514, b) for t, b in ((2.5, 512), (3.5, 506), (4.5, 512), (5.5, 380))]
    held = clients_held(ramp + steady, (2.0, 6.0))
    assert held == "clients held 514, in progress 509 (every client busy: client-bound)"
    # Clients with room to spare: a load the gateway could have taken more of.
    assert (
        clients_held([sample(3.0, 1_000, 400)], (2.0, 6.0)) == "clients held 1,000, in progress 400"
    )
    assert clients_held(ramp, (2.0, 6.0)) == ""  # nothing sampled in the window
    # sbload's clients reconnect: the same samples say the gateway took no more.
    assert "client-bound" not in clients_held(ramp + steady, (2.0, 6.0), "sbload")
    # The slow kind as sampled: clients that pipelined after the gateway closed their
    # connection hold more requests in progress than there are connections.
    pipelined = [sample(t, 329, 409) for t in (2.5, 3.5, 4.5)]
    assert clients_held(pipelined, (2.0, 6.0)) == (
        "clients held 329, in progress 409 (every client busy: client-bound; more in "
        "progress than connections: h2load pipelined)"
    )

    row = {
        "factor": 10.0,
        "offered": 100_000.0,
        "sent_rate": 12_000.0,
        "connections": 4_000,
        "goodput_share": 0.78,
        "met": {"goodput": False, "fast": True, "p99": True, "rss": True},
        "p50_ms": 62.0,
        "p99_ms": 99.0,
        "excess": 500_000,
        "fast_share": 1.0,
        "client_shed": 400_000,
        "shed_share": 0.8,
        "rss_growth": 0,
        "cpu": {},
        "adaptive": {},
        "adaptive_before": {},
        "held": held,
    }
    assert "| 78% NOT met client-bound | 62 / 99 met |" in table([row])[2]
    assert "client-bound" not in table([{**row, "held": ""}])[2]
    slow = {**row, "p99_ms": 602.0, "met": {**row["met"], "p99": False}}
    slow["held"] = clients_held(pipelined, (2.0, 6.0))
    assert "| 62 / 602 NOT met h2load pipelined |" in table([slow])[2]
    # Arrivals client-shed: h2load had too few clients; sbload's refused clients owed them.
    assert "| 400,000 (80%) generator-bound |" in table([row])[2]
    owed = table([{**row, "generator": "sbload"}])[2]
    assert "| 400,000 (80%) owed by refused clients |" in owed and "generator-bound" not in owed
    assert "(5%) |" in table([{**row, "client_shed": 25_000, "shed_share": 0.05}])[2]
