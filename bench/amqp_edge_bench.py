"""The AMQP edge's CPU per message against the HTTP edge's, in one run.

    .venv/bin/python -m bench.amqp_edge_bench            # 4,000 messages per workload
    .venv/bin/python -m bench.amqp_edge_bench --quick

The real app (`create_app`, the null sink: every send settles at once, so what is measured
is the edge, `gateway.ingest` and the dispatcher) in this process, on uvloop; the clients in
a child process, so that their CPU is not counted: `time.process_time()` of this process
over each workload, divided by its messages. Workloads:

* ``http`` — the HTTP edge, one message per request (`--senders` concurrent loops);
* ``amqp`` — the real Python SDK, one message per `send_messages` (`--senders` senders);
* ``amqp-node`` — the real Node SDK (`bench/node_senders.mjs`; `make node-deps` installs
  it), one message per `sendMessages`, `--senders` senders with `--node-in-flight` sends
  outstanding each: the same shape as ``amqp`` from a client cheap enough to keep the
  gateway as busy as the HTTP client does (the Python SDK cannot, below);
* ``amqp-batch`` — the SDK sending `ServiceBusMessageBatch`es of `--batch` messages.

Then, timed in this process, what raw passthrough saves the SDK sink per message: its encode
of a message that keeps the client's bytes against the same message encoded from its fields
(`gateway.servicebus.internals.encoding.encode`).

The workloads alternate for `--rounds` rounds. Printed: the median µs of gateway CPU per
message for each, and the AMQP ones as ratios of the HTTP one in the same round, their
median first (the issue's targets: at most 1x for single sends, 0.3x for batches of 100),
and the load average (`/proc/loadavg`) before and after. Beside each, how often the
gateway slept waiting for work, a message (voluntary context switches): each sleep is a
wakeup the kernel pays for, so a client that cannot keep the gateway busy (the Python SDK,
several times the gateway's CPU a send) raises its kernel time a message
(docs/amqp.md#cost).

* ``sblocal`` — end to end, not CPU: the local broker (`BrokerProcess`) and the gateway
  (`bench.gateway_server`, the SDK sink: it really sends to the broker) in processes of
  their own, and a Python SDK client in a third with one sender per route — to the broker
  directly, through the gateway's AMQP port, and through the two floors below — used in
  turn (in an order shuffled at every turn), one send at a time, so that every route meets
  the same moments of a shared machine's load (`--rounds` rounds): sequential single sends
  (`--e2e-messages` per route), then rounds of `--concurrency` single sends in flight at
  once on the one sender (an app whose tasks share a sender, as the SDKs allow; the
  gateway's dispatcher may batch them, the broker direct takes each alone), then sequential
  `ServiceBusMessageBatch`es of `--batch`. A
  send's time includes building its message or batch, as a sender's throughput does.
  Printed per shape: messages per second each way, their ratio (the issue's target: at least 0.8),
  and the latency of a send at p50 and p99 each way and what the gateway adds at p99; the
  gateway's CPU per message on that route (its process's user + system time over the
  windows). In the same rounds, two floors, each in a process of its own on the gateway's
  CPU: ``relay``, a byte relay between the sender and the broker that does nothing but
  copy (what any forwarding hop costs on this machine, on one event loop: the most a
  gateway could reach), and ``null``, the gateway with the null sink (its AMQP edge, its
  ingest and dispatcher, but no second hop: every send settles at once). With
  ``--baseline DIR`` (a checkout of another commit, say ``git worktree add /tmp/base main``),
  the gateway of that checkout too, beside this one on the same CPU: an A/B in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson

from bench.harness import (
    IN_MEMORY_ENV,
    Cores,
    child_output,
    emit,
    gateway_on_broker,
    parse_args,
    run_fast,
)

CPU_WORKLOADS = ("http", "amqp", "amqp-node", "amqp-batch")
NODE_SENDERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_senders.mjs")
WORKLOADS = (*CPU_WORKLOADS, "sblocal")
E2E_SHAPES = ("single", "concurrent", "batch")
CLIENT_DEADLINE = 600.0


async def _client(kind: str, http_port: int, amqp_port: int, messages: int, senders: int,
                  batch: int) -> None:  # fmt: skip
    """The load, in the child process: `messages` in all, over `senders` at once."""
    per = max(1, messages // senders)
    if kind == "http":
        import aiohttp

        async with aiohttp.ClientSession() as http:

            async def post_loop() -> None:
                for _ in range(per):
                    async with http.post(
                        f"http://127.0.0.1:{http_port}/queues/orders/messages", data=b"x" * 1024
                    ) as r:
                        assert r.status == 201, r.status

            await asyncio.gather(*(post_loop() for _ in range(senders)))
        return
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    conn = (
        f"Endpoint=sb://localhost:{amqp_port};SharedAccessKeyName=bench;"
        "SharedAccessKey=YmVuY2g=;UseDevelopmentEmulator=true"
    )
    async with ServiceBusClient.from_connection_string(conn) as sb:

        async def send_loop() -> None:
            async with sb.get_queue_sender("orders") as sender:
                if kind == "amqp":
                    for _ in range(per):
                        await sender.send_messages(ServiceBusMessage(b"x" * 1024))
                    return
                for _ in range(max(1, per // batch)):
                    b = await sender.create_message_batch()
                    for _ in range(batch):
                        b.add_message(ServiceBusMessage(b"x" * 1024))
                    await sender.send_messages(b)

        await asyncio.gather(*(send_loop() for _ in range(senders)))


async def _measure(
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    from aiohttp import web

    from bench.null_sink import NullNamespaceClient
    from gateway.app import create_app
    from gateway.config import NamespaceSettings, load_settings
    from tests.support.processes import free_port

    amqp_port = free_port()
    env = {
        **IN_MEMORY_ENV,
        "SBGATE_AMQP_PLAIN_PORT": str(amqp_port),
        "SBGATE_ENABLE_FAILOVER": "false",
        "SBGATE_ENABLE_SYPHON": "false",
        "SBGATE_MAX_HEAD_WAIT": "0",
    }

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        return list(paths)

    app = create_app(
        load_settings(env),
        client_factory=lambda ns: NullNamespaceClient(ns.name),
        provisioner=provision,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    http_port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", http_port)
    await site.start()
    costs: dict[str, list[float]] = {}
    sleeps: dict[str, list[float]] = {}  # voluntary context switches a message
    kinds = [w for w in args.workloads if w in CPU_WORKLOADS]
    try:
        # The workloads alternate, round after round: a shared machine's load moves in
        # minutes, and a ratio is only worth something between neighbouring windows.
        for kind in [k for _ in range(args.rounds) for k in kinds]:
            messages = args.messages
            started = time.process_time()
            waits = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            if kind == "amqp-node":
                job = {
                    "connectionString": f"Endpoint=sb://localhost:{amqp_port};"
                    "SharedAccessKeyName=bench;SharedAccessKey=YmVuY2g=;"
                    "UseDevelopmentEmulator=true",
                    "entity": "orders",
                    "messages": messages - args.senders,  # and one a sender to open it
                    "senders": args.senders,
                    "inFlight": args.node_in_flight,
                }
                proc = await asyncio.create_subprocess_exec(
                    "node", NODE_SENDERS, orjson.dumps(job).decode(),
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
            else:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.amqp_edge_bench", "--client", kind,
                    "--http-port", str(http_port), "--amqp-port", str(amqp_port),
                    "--messages", str(messages), "--senders", str(args.senders),
                    "--batch", str(args.batch),
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
            async with asyncio.timeout(CLIENT_DEADLINE):
                code = await proc.wait()
            if code != 0:
                raise RuntimeError(f"the {kind} client failed (exit {code})")
            costs.setdefault(kind, []).append((time.process_time() - started) / messages * 1e6)
            waits = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - waits
            sleeps.setdefault(kind, []).append(waits / messages)
    finally:
        await runner.cleanup()
    return costs, sleeps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument(
        "--node-in-flight",
        type=int,
        default=1,
        help="amqp-node: single sends each Node sender keeps outstanding at once",
    )
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--e2e-messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=20,
        help="sblocal, the concurrent shape: single sends in flight at once on one sender",
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="sblocal: also a gateway from the checkout DIR (another commit, with its own "
        "bench.gateway_server), on the same CPU and in the same rounds, for an A/B",
    )
    parser.add_argument("--client", choices=CPU_WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--e2e-client", choices=E2E_SHAPES, help=argparse.SUPPRESS)
    parser.add_argument("--conn", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--amqp-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--relay", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parse_args(parser, argv, {"messages": 400, "e2e_messages": 100, "rounds": 1})
    if args.relay:
        run_fast(lambda: _relay(*args.relay))
        return 0
    if args.e2e_client:
        result = asyncio.run(
            _e2e_client(args.e2e_client, args.conn, args.e2e_messages, args.batch, args.concurrency)
        )
        emit("RESULT " + orjson.dumps(result).decode())
        return 0
    if args.client:
        asyncio.run(
            _client(args.client, args.http_port, args.amqp_port, args.messages, args.senders,
                    args.batch)
        )  # fmt: skip
        return 0
    os.environ.setdefault("SBGATE_LOG_LEVEL", "WARNING")
    node_sdk = os.path.join(os.path.dirname(NODE_SENDERS), "..", "tests", "compat", "node",
                            "node_modules", "@azure", "service-bus")  # fmt: skip
    if "amqp-node" in args.workloads and not os.path.isdir(node_sdk):
        parser.error("the amqp-node workload needs the Node SDK: run `make node-deps` first")
    print(f"load average before: {_loadavg()}", flush=True)
    if set(args.workloads) & set(CPU_WORKLOADS):
        costs, sleeps = run_fast(lambda: _measure(args))
        http = costs.get("http")
        for kind, rounds in costs.items():
            ratio = ""
            if http and kind != "http":
                paired = sorted(c / h for c, h in zip(rounds, http, strict=True))
                ratio = f"  {statistics.median(paired):.2f}x the HTTP edge's (rounds " + (
                    ", ".join(f"{r:.2f}" for r in paired) + ")"
                )
            cost = statistics.median(rounds)
            slept = statistics.median(sleeps[kind])
            print(
                f"{kind:<11} {cost:8.1f} us of gateway CPU per message{ratio}; the gateway "
                f"slept {slept:.2f} times a message",
                flush=True,
            )
        for line in _encode_cost():
            print(line, flush=True)
        print(f"load average: {_loadavg()}", flush=True)
    if "sblocal" in args.workloads:
        for line in run_fast(lambda: _through_sblocal(args)):
            print(line, flush=True)
        print(f"load average: {_loadavg()}", flush=True)
    return 0


def _encode_cost() -> list[str]:
    """What raw passthrough saves the SDK sink per message: `encoding.encode` of the edge's
    message with the client's bytes and without (from its fields), timed in this process,
    for the workloads' message and for one with a TTL and six application properties."""
    import datetime as dt
    import timeit
    import uuid
    from dataclasses import replace

    from azure.servicebus import ServiceBusMessage
    from azure.servicebus._pyamqp._encode import encode_payload
    from azure.servicebus._transport._pyamqp_transport import PyamqpTransport

    from gateway.amqp.messages import to_outbound
    from gateway.servicebus.internals.encoding import encode

    now = dt.datetime.now(dt.UTC)
    props = {"n": 1, "s": "text", "f": 0.5, "b": True, "u": uuid.uuid4(), "t": now}
    shapes = {
        "1 KiB": ServiceBusMessage(b"x" * 1024),
        "1 KiB, TTL, 6 properties": ServiceBusMessage(
            b"x" * 1024, time_to_live=dt.timedelta(hours=1), application_properties=props
        ),
    }
    lines = []
    for name, sdk in shapes.items():
        outgoing = PyamqpTransport.to_outgoing_amqp_message(sdk.raw_amqp_message)
        m = to_outbound(bytes(encode_payload(bytearray(), outgoing)))
        fields = replace(m, encoded=None)
        n = 2000
        raw = min(timeit.repeat(lambda m=m: encode(m), number=n, repeat=5)) / n * 1e6
        full = min(timeit.repeat(lambda f=fields: encode(f), number=n, repeat=5)) / n * 1e6
        lines.append(
            f"sink encode, {name}: passed through {raw:.1f} us, from the fields {full:.1f} us "
            f"a message ({full / raw:.0f}x)"
        )
    return lines


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# -- end to end: an SDK sender to the local broker, directly and through the gateway -----


async def _e2e_client(
    shape: str, conns: Sequence[str], messages: int, batch: int, concurrency: int = 20
) -> list[dict[str, Any]]:
    """In the client process: one sender per connection string, used in turn, one send at
    a time (each route is a sequential sender, and every route sees the same moments of a
    shared machine's load); per route, the seconds each send took, the message (or batch)
    being built included, as a sender's throughput includes it. The routes' order changes
    at every turn (shuffled, the same for every run): in a fixed cycle each route always
    followed the same one, and a gateway sending right after the direct route met a broker
    still busy with that send (the same gateway in two slots measured 0.91x of itself)."""
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    body = b"x" * 1024
    clients = [ServiceBusClient.from_connection_string(conn) for conn in conns]
    senders = [sb.get_queue_sender("orders") for sb in clients]
    latencies: list[list[float]] = [[] for _ in conns]
    try:
        for sender in senders:
            await sender.__aenter__()
            await sender.send_messages(ServiceBusMessage(body))  # the link, before the clock
        per_unit = {"single": 1, "concurrent": concurrency, "batch": batch}[shape]
        units = max(1, messages // per_unit)
        rng = random.Random(35)  # nosec B311  # an order, not a secret
        order = list(range(len(senders)))
        for _ in range(units):
            rng.shuffle(order)
            for route in order:
                sender = senders[route]
                t0 = time.perf_counter()
                if shape == "single":
                    await sender.send_messages(ServiceBusMessage(body))
                elif shape == "concurrent":  # an app's tasks sharing one sender
                    await asyncio.gather(
                        *(sender.send_messages(ServiceBusMessage(body)) for _ in range(concurrency))
                    )
                else:
                    b = await sender.create_message_batch()
                    for _ in range(batch):
                        b.add_message(ServiceBusMessage(body))
                    await sender.send_messages(b)
                latencies[route].append(time.perf_counter() - t0)
        sent = units * per_unit
    finally:
        for sender, sb in zip(senders, clients, strict=True):
            await sender.close()
            await sb.close()
    return [{"sent": sent, "elapsed": sum(lat), "latencies": lat} for lat in latencies]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _relay(port: int, upstream: int) -> None:
    """In a child: copy bytes both ways between each client of 127.0.0.1:`port` and a
    connection of its own to 127.0.0.1:`upstream`, and nothing else (the floor)."""
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    class Upstream(asyncio.Protocol):
        def __init__(self, down: asyncio.Transport) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.down.close()

    class Downstream(asyncio.Protocol):
        up: asyncio.Transport | None = None

        def __init__(self) -> None:
            # What the client sent before the upstream connection was made: a paused read
            # is not always honoured that early (uvloop), and a loaded machine connects late.
            self.early: list[bytes] = []

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            down = cast(asyncio.Transport, transport)
            down.pause_reading()

            async def connect() -> None:
                up, _ = await loop.create_connection(lambda: Upstream(down), "127.0.0.1", upstream)
                self.up = cast(asyncio.Transport, up)
                self.up.write(b"".join(self.early))
                self.early.clear()
                down.resume_reading()

            task = loop.create_task(connect())
            connecting.add(task)
            task.add_done_callback(connecting.discard)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.early.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

    server = await loop.create_server(Downstream, "127.0.0.1", port)
    emit("READY {}")
    async with server:
        await server.serve_forever()


async def _through_sblocal(args: argparse.Namespace) -> list[str]:
    """Every route, alternately, in one run (see the module docstring); the printed lines."""
    import psutil

    from bench.harness import Child, Server, pin
    from tests.support.processes import free_port

    amqp_port, null_port, relay_port = free_port(), free_port(), free_port()
    cores = Cores.split()

    def endpoint(port: int, key_name: str = "bench", key: str = "YmVuY2g=") -> str:
        return (
            f"Endpoint=sb://localhost:{port};SharedAccessKeyName={key_name};"
            f"SharedAccessKey={key};UseDevelopmentEmulator=true"
        )

    totals: dict[tuple[str, str], dict[str, Any]] = {}
    async with gateway_on_broker(cores, {"SBGATE_AMQP_PLAIN_PORT": str(amqp_port)}) as e2e:
        broker_port = int(e2e.conn.split("sb://localhost:", 1)[1].split(";", 1)[0])
        wiring = dict(e2e.conn.removesuffix(";").split(";")[i].split("=", 1) for i in (1, 2))
        null = await Server.start(
            "gateway-null", "gateway", {**e2e.settings, "SBGATE_AMQP_PLAIN_PORT": str(null_port)},
            cpus=cores.subject, sink="null",
        )  # fmt: skip
        relay = await Child.start(
            "relay", "bench.amqp_edge_bench", ["--relay", str(relay_port), str(broker_port)],
            cpus=cores.subject,
        )  # fmt: skip
        baseline: _Baseline | None = None
        try:
            await relay.expect("READY", 30)
            pin(relay.pid, cores.subject)
            routes = {
                "direct": (e2e.conn, None),
                "gateway": (endpoint(amqp_port), e2e.gateway.pid),
                "relay": (
                    endpoint(relay_port, wiring["SharedAccessKeyName"], wiring["SharedAccessKey"]),
                    relay.pid,
                ),
                "null": (endpoint(null_port), null.pid),
            }
            if args.baseline:
                baseline = await _baseline(args.baseline, e2e.settings, free_port(), cores)
                routes["baseline"] = (endpoint(baseline.port), baseline.proc.pid)
            procs = {r: psutil.Process(pid) for r, (_, pid) in routes.items() if pid is not None}
            for _ in range(args.rounds):
                for shape in E2E_SHAPES:
                    await e2e.control.reset()  # an empty queue for every window
                    before = {r: sum(p.cpu_times()[:2]) for r, p in procs.items()}
                    out = await asyncio.to_thread(
                        child_output, "bench.amqp_edge_bench",
                        ["--e2e-client", shape, "--batch", str(args.batch),
                         "--e2e-messages", str(args.e2e_messages),
                         "--concurrency", str(args.concurrency),
                         "--conn", *(conn for conn, _ in routes.values())],
                        timeout=CLIENT_DEADLINE,
                    )  # fmt: skip
                    cpu = {r: sum(p.cpu_times()[:2]) - before[r] for r, p in procs.items()}
                    results = orjson.loads(out.split("RESULT ", 1)[1])
                    for route, result in zip(routes, results, strict=True):
                        total = totals.setdefault(
                            (shape, route),
                            {"sent": 0, "elapsed": 0.0, "latencies": [], "cpu": 0.0, "windows": 0},
                        )
                        total["sent"] += result["sent"]
                        total["windows"] += 1  # each window's one send before the clock
                        total["elapsed"] += result["elapsed"]
                        total["latencies"] += result["latencies"]
                        total["cpu"] += cpu.get(route, 0.0)
        finally:
            await relay.close()
            await null.close()
            if baseline is not None:
                await baseline.close()
    return _e2e_lines(totals, args.batch, args.concurrency, args.baseline)


def _e2e_lines(
    totals: dict[tuple[str, str], dict[str, Any]],
    batch: int,
    concurrency: int,
    baseline: str | None,
) -> list[str]:
    lines = []
    for shape in E2E_SHAPES:
        t = {route: v for (s, route), v in totals.items() if s == shape}
        rate = {r: v["sent"] / v["elapsed"] for r, v in t.items()}
        # CPU over the windows: the timed messages and each window's one send before.
        cpu = {r: v["cpu"] / (v["sent"] + v["windows"]) * 1e6 for r, v in t.items()}
        p50 = {r: _quantile(v["latencies"], 0.5) * 1e3 for r, v in t.items()}
        p99 = {r: _quantile(v["latencies"], 0.99) * 1e3 for r, v in t.items()}
        unit = {
            "single": "send",
            "concurrent": f"round of {concurrency} sends",
            "batch": f"batch of {batch}",
        }[shape]
        lines.append(
            f"sblocal {shape:<6} direct {rate['direct']:7.0f} msg/s, through the gateway "
            f"{rate['gateway']:7.0f} msg/s: {rate['gateway'] / rate['direct']:.2f}x; a {unit}: "
            f"p50 {p50['direct']:.2f} / {p50['gateway']:.2f} ms, p99 {p99['direct']:.2f} / "
            f"{p99['gateway']:.2f} ms (added p99 {p99['gateway'] - p99['direct']:+.2f} ms); "
            f"gateway CPU {cpu['gateway']:.0f} us a message"
        )
        for route, what in (("relay", "a byte relay (the floor)"), ("null", "the null sink")):
            lines.append(
                f"  floor {shape:<6} {what:<24} {rate[route]:7.0f} msg/s: "
                f"{rate[route] / rate['direct']:.2f}x direct; p99 {p99[route]:.2f} ms "
                f"(added {p99[route] - p99['direct']:+.2f} ms); its CPU "
                f"{cpu[route]:.0f} us a message; the gateway reaches "
                f"{rate['gateway'] / rate[route]:.2f}x of it"
            )
        if "baseline" in t:
            lines.append(
                f"  A/B   {shape:<6} the gateway of {baseline}: {rate['baseline']:7.0f} msg/s: "
                f"{rate['baseline'] / rate['direct']:.2f}x direct; p99 {p99['baseline']:.2f} ms; "
                f"its CPU {cpu['baseline']:.0f} us a message; this checkout's gateway reaches "
                f"{rate['gateway'] / rate['baseline']:.2f}x of its rate at "
                f"{cpu['gateway'] / cpu['baseline']:.2f}x its CPU a message"
            )
    return lines


@dataclass
class _Baseline:
    """A `bench.gateway_server` (SDK sink) run from another checkout."""

    proc: asyncio.subprocess.Process
    port: int

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _baseline(root: str, settings: dict[str, str], port: int, cores: Cores) -> _Baseline:
    """Start the gateway of the checkout `root` with `settings` on the gateway's CPU."""
    from bench.harness import pin

    env = {k: v for k, v in os.environ.items() if not k.startswith("SBGATE_")}
    env.update(settings, SBGATE_AMQP_PLAIN_PORT=str(port), PYTHONPATH=root, PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.gateway_server", "--mode", "gateway", "--sink", "sdk",
        cwd=root, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    baseline = _Baseline(proc, port)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            while not (await proc.stdout.readline()).startswith(b"READY"):
                if proc.stdout.at_eof():
                    raise RuntimeError(f"the gateway of {root} exited before READY")
    except BaseException:
        await baseline.close()
        raise
    pin(proc.pid, cores.subject)
    return baseline


if __name__ == "__main__":
    raise SystemExit(main())
