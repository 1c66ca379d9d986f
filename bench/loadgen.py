"""A small, fast HTTP/1.1 load generator: N keep-alive connections, one request at a time each.

It speaks raw HTTP over asyncio protocols (under uvloop when installed) instead of using an
HTTP client library, so one core can drive well beyond what a Python server answers on
another core: the load generator must never be the bottleneck of a server benchmark.

    python -m bench.loadgen --url http://127.0.0.1:8080/queues/orders/messages \\
        --connections 64 --warmup 1 --duration 5
    python -m bench.loadgen --url ... --connections 100 --count 100   # one burst
    python -m bench.loadgen --url http://127.0.0.1:8080/q{i}/messages --entities 1000

With ``--entities N`` the URL's ``{i}`` takes the values 0..N-1 in turn, request after
request over all connections (traffic spread round-robin over N entities).

Protocol on stdout (see `bench.harness`): (with ``--sync``: ``READY``, then it waits for a
line on stdin), ``START``, ``END``, ``RESULT <json>`` with
``requests`` (answered inside the window), ``rate``, ``statuses``, ``errors`` and latency
percentiles in milliseconds. With ``--count``, the window runs from the first request sent
to the last answer received. Only 127.0.0.1 is accepted as a target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import time
from collections import Counter
from typing import Any, cast
from urllib.parse import urlsplit

import orjson

from bench.harness import emit, pin_self_from_env, run_fast


def make_body(size: int) -> bytes:
    """A JSON document of exactly `size` bytes (an order with padding)."""
    head = b'{"order":"o-1","items":[{"sku":"s1","qty":2}],"note":"'
    tail = b'"}'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


def build_request(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    parts = urlsplit(url)
    if parts.hostname not in {"127.0.0.1", "localhost"}:
        raise SystemExit(f"refusing to load anything but 127.0.0.1: {url}")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Stats:
    def __init__(self) -> None:
        self.recording = False
        self.statuses: Counter[int] = Counter()
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.total_ok = 0  # 2xx answers including warm-up and drain (to compare with a broker)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: send, wait for the whole answer, send again."""

    def __init__(self, gen: LoadGenerator) -> None:
        self._gen = gen
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._sent_at = 0.0
        self.busy = False
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self._gen.stats.errors["connection_lost"] += 1
            self.busy = False
            self._gen.answered()
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self) -> bool:
        if self._transport is None or self._transport.is_closing():
            return False
        self.busy = True
        self._sent_at = time.perf_counter()
        self._transport.write(self._gen.next_request())
        return True

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end])
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                return
            status = int(head[9:12])
            del buf[:total]
            stats = self._gen.stats
            if 200 <= status < 300:
                stats.total_ok += 1
            if stats.recording:
                stats.statuses[status] += 1
                stats.latencies.append(time.perf_counter() - self._sent_at)
            self.busy = False
            self._gen.answered()
            self._gen.next_on(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class LoadGenerator:
    """Keeps `connections` requests in flight until told to stop, or `count` are sent."""

    def __init__(self, url: str, request: bytes | list[bytes], connections: int) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.requests = request if isinstance(request, list) else [request]
        self._turn = 0
        self.n = connections
        self.stats = _Stats()
        self.conns: list[_Connection] = []
        self.sending = False
        self.budget: int | None = None  # requests still allowed (count mode)
        self.in_flight = 0
        self._idle = asyncio.Event()

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(self.n):
            _, proto = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
            self.conns.append(proto)

    def next_request(self) -> bytes:
        requests = self.requests
        if len(requests) == 1:
            return requests[0]
        self._turn = (self._turn + 1) % len(requests)
        return requests[self._turn]

    def may_send(self) -> bool:
        if not self.sending:
            return False
        if self.budget is not None:
            if self.budget <= 0:
                return False
            self.budget -= 1
        self.in_flight += 1
        return True

    def answered(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self._idle.set()

    def next_on(self, conn: _Connection) -> None:
        if self.may_send() and not conn.send():
            self.stats.errors["closed"] += 1
            self.answered()

    def go(self) -> None:
        self.sending = True
        self._idle.clear()
        for conn in self.conns:
            self.next_on(conn)

    async def drain(self, within: float) -> None:
        """Stop sending and wait (bounded) for the answers still in flight."""
        self.sending = False
        if self.in_flight > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await self._idle.wait()

    async def close(self) -> None:
        for conn in self.conns:
            conn.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await asyncio.gather(*(c.closed for c in self.conns))


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k] * 1000.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = dict(h.split(":", 1) for h in args.header)
    body = make_body(args.body_size)
    requests = [
        build_request(args.url.replace("{i}", str(i)), body, headers) for i in range(args.entities)
    ]
    gen = LoadGenerator(args.url, requests, args.connections)
    await gen.connect()
    try:
        if args.warmup > 0 and args.count is None:
            gen.go()
            await asyncio.sleep(args.warmup)
            await gen.drain(args.drain_timeout)
        if args.sync:
            # Several load generators start their windows together (see bench.harness).
            emit("READY")
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        stats = gen.stats
        stats.recording = True
        emit("START")
        started = time.perf_counter()
        if args.count is not None:
            gen.budget = args.count
            gen.go()
            try:
                async with asyncio.timeout(args.duration):
                    while gen.budget > 0 or gen.in_flight > 0:
                        gen._idle.clear()
                        if gen.in_flight <= 0:
                            break
                        await gen._idle.wait()
            except TimeoutError:
                stats.errors["unfinished"] += gen.in_flight
            elapsed = time.perf_counter() - started
            emit("END")
        else:
            gen.go()
            await asyncio.sleep(args.duration)
            stats.recording = False
            elapsed = time.perf_counter() - started
            emit("END")
            await gen.drain(args.drain_timeout)
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await gen.close()
    answered = sum(stats.statuses.values())
    lat = sorted(stats.latencies)
    return {
        "requests": answered,
        "elapsed": elapsed,
        "rate": answered / elapsed if elapsed > 0 else 0.0,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "errors": dict(stats.errors),
        "total_ok": stats.total_ok,
        "p50_ms": _percentile(lat, 0.50),
        "p99_ms": _percentile(lat, 0.99),
        "max_ms": _percentile(lat, 1.0),
        "cpu_s": (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime),
    }


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="window (or deadline)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--count", type=int, help="send exactly this many requests, then stop")
    parser.add_argument("--body-size", type=int, default=1024)
    parser.add_argument(
        "--entities", type=int, default=1, help="requests cycle {i} in the URL over 0..N-1"
    )
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    parser.add_argument("--drain-timeout", type=float, default=15.0)
    parser.add_argument(
        "--sync", action="store_true", help="after warm-up print READY, start on a stdin line"
    )
    args = parser.parse_args(argv)
    result = run_fast(lambda: run(args))
    emit("RESULT " + orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
