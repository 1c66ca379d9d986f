"""E1: one gateway in front of a whole namespace — 1, 100, 1,000 and 10,000 declared entities.

For each count, in one run: the local broker (its own process, second CPU) with that many
queues; one `gateway serve` (first CPU; failover and the syphon on, defaults) declaring every
one of them; then h2load (`bench.native`, pinned to the second CPU; 64 connections, 1 KB
bodies, each connection cycling through every entity's URL) POSTing over all of them
(``--generator python``: `bench.loadgen`, round-robin). Printed per count:

* time to ready — from starting the gateway process to its READY line (listening, every
  start-up resource up; Python's imports included);
* RSS after start and after the load;
* req/s, and the gateway's CPU per request, each also as a ratio to the 1-entity run;
* how busy the gateway was (its CPU seconds per second of load: near 100% it is the
  bottleneck, well under it waits on something else), and the broker's CPU per request;
* how long the gateway's listener was closed under overload during the window (it closes
  while its loop lags; the load starts only once it listens: a refused h2load client does
  not reconnect);
* what the gateway holds open at the broker (its census: connections and sender links),
  and how many `$cbs` put-tokens the broker answered (one per entity per connection);
* the 201 share;
* the first send to a cold entity (its sender opens) and the next one, one request each,
  before the load;

then the issue's goals (at 1,000: ready <= 5 s, RSS <= 250 MB, throughput >= 0.5x of one
entity, <= 16 connections per namespace, 100% 201; at 10,000: ready <= 30 s and serves).
The load includes every entity's first send (no warm-up): a cold entity's senders open on
demand. `--quick`: 3 s of load per count instead of 12.

    .venv/bin/python -m bench.entities_bench [--quick] [--counts 1,100,1000,10000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import (
    Cores,
    Server,
    Window,
    bench_env,
    cpu_seconds,
    pin,
    run_child,
    write_many_queues,
)
from bench.loadgen import make_body
from bench.native import H2Load, loadavg, parse_wrk, post_script, run_h2load, wrk_command
from tests.support.processes import rss_bytes

MiB = 1024 * 1024
_GOALS_AT = 1000


@dataclass
class Row:
    entities: int
    ready_s: float
    rss_start: float  # MiB
    rss_load: float
    rate: float
    cpu_per_req_us: float
    busy: float  # the gateway's CPU seconds per second of load (1.0: its CPU was saturated)
    broker_cpu_per_req_us: float
    connections: int
    send_links: int
    put_tokens: int  # `$cbs` put-tokens the broker answered, start-up and load
    links: int
    ok_share: float
    statuses: dict[str, int]
    cold_ms: float
    warm_ms: float
    errors: dict[str, int]
    paused_s: float  # the gateway's listener closed (under overload) during the window


async def _one(n: int, args: argparse.Namespace, cores: Cores, work: Path) -> Row:
    from sblocal.testing import BrokerProcess

    broker_cfg, gateway_cfg = work / f"broker-{n}.toml", work / f"gateway-{n}.toml"
    write_many_queues(broker_cfg, gateway_cfg, n)
    broker = BrokerProcess(config=broker_cfg, startup_timeout=120)
    await broker.astart()
    try:
        pin(broker.pid, cores.rest)
        env = bench_env(broker, {"SBGATE_CONFIG": str(gateway_cfg), "SBGATE_ENABLE_SYPHON": "true"})
        started = time.monotonic()
        gateway = await Server.start(
            "gateway", "gateway", env, cpus=cores.subject, sink="sdk", within=300
        )
        ready_s = time.monotonic() - started
        try:
            rss_start = (rss_bytes(gateway.pid) or 0) / MiB
            cold_ms, warm_ms = await _first_sends(gateway.url + f"/q{n - 1}/messages")
            await _until_listening(gateway.url)
            paused_before = await _paused_seconds(gateway.url)
            window = await _load(gateway, broker.pid, n, args, cores)
            paused = await _paused_seconds(gateway.url) - paused_before
            rss_load = (rss_bytes(gateway.pid) or 0) / MiB
            census = await broker.control.connections("primary")
            counters = await broker.control.counters("primary")
        finally:
            await gateway.close()
    finally:
        await broker.astop()
    result = window.result
    requests = max(1, int(result["requests"]))
    statuses = {str(k): int(v) for k, v in result["statuses"].items()}
    return Row(
        entities=n,
        ready_s=ready_s,
        rss_start=rss_start,
        rss_load=rss_load,
        rate=float(result["rate"]),
        cpu_per_req_us=window.cpu["gateway"] / requests * 1e6,
        busy=window.cpu["gateway"] / window.wall if window.wall > 0 else 0.0,
        broker_cpu_per_req_us=window.cpu["broker"] / requests * 1e6,
        connections=int(census["connections"]),
        send_links=int(census["send_links"]),
        put_tokens=int(counters["cbs_tokens"]),
        links=int(census["links"]),
        ok_share=statuses.get("201", 0) / requests,
        statuses=statuses,
        cold_ms=cold_ms,
        warm_ms=warm_ms,
        errors={str(k): int(v) for k, v in result.get("errors", {}).items()},
        paused_s=paused,
    )


async def _load(
    gateway: Server, broker_pid: int | None, n: int, args: argparse.Namespace, cores: Cores
) -> Window:
    """POSTs round-robin over the `n` entities: h2load (each client cycles through the
    entities' URLs), or `bench.loadgen` with ``--generator python``."""
    watch = {"gateway": gateway.pid, "broker": broker_pid}
    if args.warmup > 0:  # the same load, not measured: the senders it needs are open
        await _load_for(gateway, n, args, cores, watch, args.warmup)
    return await _load_for(gateway, n, args, cores, watch, args.duration)


async def _load_for(
    gateway: Server,
    n: int,
    args: argparse.Namespace,
    cores: Cores,
    watch: dict[str, int | None],
    duration: float,
) -> Window:
    if args.generator == "wrk":
        return await _wrk(gateway.url, n, args.connections, duration, cores, watch)
    if args.generator == "h2load":
        urls = [gateway.url + f"/q{i}/messages" for i in range(n)]
        load = H2Load(urls, duration, connections=args.connections, body=make_body(1024))
        return await run_h2load(load, cpus=cores.rest, watch=watch)
    return await run_child(
        "loadgen",
        "bench.loadgen",
        [
            "--url",
            gateway.url + "/q{i}/messages",
            "--entities",
            str(n),
            "--connections",
            str(args.connections),
            "--warmup",
            "0",
            "--duration",
            str(duration),
            "--body-size",
            "1024",
        ],
        watch=watch,
        cpus=cores.rest,
        within=duration + 120,
    )


# wrk, one thread: `request` takes the next entity for every request, whichever connection
# sends it (traffic spread round-robin over all of them, as `bench.loadgen` spreads it),
# and `done` prints the answers' statuses.
_WRK_SPREAD = """
local n, i = %(n)d, 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) statuses = {} end
function request()
  local path = "/q" .. i .. "/messages"
  i = (i + 1) %% n
  return wrk.format(nil, path)
end
function response(status, headers, body) statuses[status] = (statuses[status] or 0) + 1 end
function done(summary, latency, requests)
  for _, t in ipairs(threads) do
    for status, count in pairs(t:get("statuses")) do
      io.write(string.format("STATUS %%d %%d\\n", status, count))
    end
  end
end
"""


async def _wrk(
    url: str,
    n: int,
    connections: int,
    duration: float,
    cores: Cores,
    watch: dict[str, int | None],
) -> Window:
    """wrk (pinned with the broker) POSTing 1 KB bodies round-robin over the `n` entities
    for `duration` seconds; within ``duration + 60`` s or it is killed."""
    with tempfile.TemporaryDirectory(prefix="entities-wrk-") as tmp:
        script = Path(tmp) / "spread.lua"
        script.write_text(post_script(make_body(1024)) + _WRK_SPREAD % {"n": n})
        cmd = wrk_command(url, connections=connections, duration=duration, script=script)
        if cores.rest:
            cmd = ["taskset", "-c", ",".join(str(c) for c in sorted(cores.rest)), *cmd]
        before = {k: cpu_seconds(p) for k, p in watch.items()}
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            async with asyncio.timeout(duration + 60):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        wall = time.monotonic() - started
        after = {k: cpu_seconds(p) for k, p in watch.items()}
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}:\n{text[-2000:]}")
    summary = parse_wrk(text)
    statuses: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("STATUS "):
            _, status, count = line.split()
            statuses[status] = statuses.get(status, 0) + int(count)
    result = {
        "requests": sum(statuses.values()) or summary["requests"],
        "rate": summary["rate"],
        "statuses": statuses,
    }
    return Window(result=result, cpu={k: after[k] - before[k] for k in watch}, wall=wall)


async def _metrics(url: str) -> dict[str, float]:
    """The gateway's Prometheus samples (name with labels -> value)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(10), session.get(url + "/metrics") as resp:
            text = await resp.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def _paused_seconds(url: str) -> float:
    """Seconds the gateway's listener has been closed under overload, every reason (read
    once it listens: closed, it refuses this request too)."""
    await _until_listening(url)
    samples = await _metrics(url)
    return sum(
        v for k, v in samples.items() if k.startswith("sbgate_http_listener_paused_seconds_total")
    )


async def _until_listening(url: str, within: float = 30.0) -> None:
    """Wait (at most `within` s) until the gateway's listener accepts connections: it closes
    while its event loop lags (gateway/web/listener.py), as after a cold send on a loaded
    machine, and h2load does not reconnect a client whose connection was refused — the whole
    window would measure the clients that got in."""
    import aiohttp

    deadline = time.monotonic() + within
    while True:
        try:
            if (await _metrics(url)).get("sbgate_http_listening", 0.0) == 1.0:
                return
        except aiohttp.ClientConnectionError:
            pass  # refused: not listening
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not listen again within {within:g} s")
        await asyncio.sleep(0.1)


async def _first_sends(url: str) -> tuple[float, float]:
    """Milliseconds for one POST to a cold entity (its sender opens), then for the next."""
    import aiohttp

    times: list[float] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            t0 = time.perf_counter()
            async with asyncio.timeout(30), session.post(url, data=b"{}") as resp:
                await resp.read()
                if resp.status != 201:
                    raise RuntimeError(f"the first sends got {resp.status}")
            times.append((time.perf_counter() - t0) * 1000)
    return times[0], times[1]


def _table(rows: list[Row]) -> list[str]:
    base = rows[0] if rows and rows[0].entities == 1 else None
    out = [
        "| entities | ready | RSS start | RSS after load | req/s | x 1 entity | CPU/req "
        "| x 1 entity | gateway busy | broker CPU/req | listener closed | connections "
        "| sender links (all links) | put-tokens | 201 share | cold / warm send |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate_x = f"{r.rate / base.rate:.2f}x" if base and base.rate else "—"
        cpu_x = f"{r.cpu_per_req_us / base.cpu_per_req_us:.2f}x" if base else "—"
        out.append(
            f"| {r.entities:,} | {r.ready_s:.1f} s | {r.rss_start:.0f} MB | {r.rss_load:.0f} MB "
            f"| {r.rate:,.0f} | {rate_x} | {r.cpu_per_req_us:,.0f} µs | {cpu_x} "
            f"| {r.busy:.0%} | {r.broker_cpu_per_req_us:,.0f} µs | {r.paused_s:.1f} s "
            f"| {r.connections} | {r.send_links:,} ({r.links:,}) | {r.put_tokens:,} "
            f"| {r.ok_share:.1%} "
            f"| {r.cold_ms:.0f} / {r.warm_ms:.0f} ms |"
        )
    return out


def _goals(rows: list[Row], pool: int) -> list[str]:
    by = {r.entities: r for r in rows}
    base = by.get(1)
    out: list[str] = []

    def check(ok: bool, what: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}  {what}")

    if (r := by.get(_GOALS_AT)) is not None:
        check(r.ready_s <= 5, f"1,000 entities: ready {r.ready_s:.1f} s <= 5 s")
        check(r.rss_load <= 250, f"1,000 entities: RSS {r.rss_load:.0f} MB <= 250 MB (after load)")
        if base is not None and base.rate:
            ratio = r.rate / base.rate
            closed = [f"{x.entities:,}: {x.paused_s:.1f} s" for x in (base, r) if x.paused_s]
            note = (
                f" (the gateway's listener closed under overload during the window, "
                f"{', '.join(closed)}: refused clients do not reconnect)"
                if closed
                else ""
            )
            check(
                ratio >= 0.5, f"1,000 entities: throughput {ratio:.2f}x of one entity >= 0.5x{note}"
            )
        check(
            r.connections <= 16,
            f"1,000 entities: {r.connections} connections to the namespace <= 16 (pool {pool})",
        )
        check(r.ok_share == 1.0, f"1,000 entities: {r.ok_share:.2%} answered 201 (100%)")
    if (r := by.get(10_000)) is not None:
        check(r.ready_s <= 30, f"10,000 entities: ready {r.ready_s:.1f} s <= 30 s")
        check(
            r.statuses.get("201", 0) > 0 and r.ok_share > 0.99,
            f"10,000 entities: serves ({r.rate:,.0f} req/s, {r.ok_share:.2%} 201)",
        )
    return out


async def _main(args: argparse.Namespace) -> list[Row]:
    cores = Cores.split()
    counts = [int(c) for c in args.counts.split(",")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="entities-bench-") as tmp:
        for n in counts:
            row = await _one(n, args, cores, Path(tmp))
            rows.append(row)
            print(
                f"  {n:>6,} entities: {row.rate:,.0f} req/s, statuses {row.statuses}"
                + (f", errors {row.errors}" if row.errors else ""),
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s of load per count")
    parser.add_argument("--counts", default="1,100,1000,10000")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument(
        "--generator",
        choices=("h2load", "wrk", "python"),
        default="h2load",
        help="h2load (make bench-tools; each connection cycles through the entities from the "
        "first), wrk (one request to each entity in turn, over all connections) or "
        "bench.loadgen (the same, in Python)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="seconds of the same load before the measured window (0: none, every entity's "
        "first send is measured)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 3.0
    cores = Cores.split()
    print(
        f"E1 entities: {args.connections} connections, 1 KB bodies, round-robin over every "
        f"entity, {args.duration:g} s each "
        f"({f'after {args.warmup:g} s of warm-up' if args.warmup else 'no warm-up'}), "
        f"load from {args.generator}; "
        f"{cores.describe}; {loadavg()}",
        flush=True,
    )
    rows = asyncio.run(_main(args))
    print()
    for line in _table(rows):
        print(line)
    print()
    for line in _goals(rows, pool=4):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
