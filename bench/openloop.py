"""An open-loop HTTP/1.1 load generator: requests arrive at a fixed rate, answered or not.

Where a native generator can do the job, the benchmarks use one (`bench.native`: h2load
costs a fraction of this module's CPU per request). This one stays where h2load cannot: the
outage benchmark reads each answer's JSON (the ``route`` of a 2xx: primary or backlog) over
time, and measures latency from when a request was *due*, not when it was sent.

`bench.loadgen` is closed-loop (N connections, the next request only after the last answer),
so it never offers more than the server takes. Here arrivals follow the clock: every
``1/rate`` seconds a request is due and goes out on an idle keep-alive connection, or on a
new one. The client is **bounded**: at most ``--max-connections`` connections (so at most as
many requests in flight); an arrival that finds them all busy is counted as ``shed`` and
never sent. Every request has a deadline (``--timeout``): unanswered by then, it counts as
``timeout`` and its connection is closed.

    python -m bench.openloop --url http://127.0.0.1:8080/queues/orders/messages \\
        --rate 20000 --duration 60 --max-connections 4000 --limit 2

Protocol on stdout (see `bench.harness`): ``START`` (the first arrival is due now; the
``t0`` in RESULT is that moment on ``time.monotonic()``, the same clock in every process of
the machine), ``END`` (no more arrivals; answers still in flight are awaited up to the
deadline, and the drain as a whole at most ``--timeout`` + 5 s: whatever is still
unanswered then counts as ``unfinished``, so the child always reports), ``RESULT <json>``:
requests due, sent and shed, answers by status (and the
non-2xx ones by the ``error`` code of their JSON, ``error_codes``), ``503`` answers
with and without ``Retry-After``, latency percentiles (from the moment a request was due) of
every status, the ``503``s slower than ``--limit``, the ``503``s and the connection failures
(refused, closed or reset without an answer) within ``--fast`` seconds of when they were due
(they "failed fast"), and ``series``: answers per status (2xx
split by the ``route`` of the answer's JSON) in ``--bucket`` second steps of answer time,
from ``t0``. Only 127.0.0.1 is accepted as a target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import time
from array import array
from collections import Counter
from typing import Any, cast

import orjson

from bench.harness import emit, pin_self_from_env, run_fast
from bench.loadgen import build_request, make_body

_RETRY_AFTER = b"\r\nretry-after:"
# Seconds the drain may run past the per-request deadline before what is left is abandoned.
DRAIN_SLACK = 5.0
_ROUTE = b'"route":"'
_ERROR = b'"error":"'


class _Stats:
    def __init__(self, t0: float, bucket: float) -> None:
        self.t0 = t0
        self.bucket = bucket
        self.statuses: Counter[int] = Counter()
        self.codes: Counter[str] = Counter()  # non-2xx answers by their JSON error code
        self.errors: Counter[str] = Counter()
        self.latency: dict[int, array[float]] = {}
        self.unavailable_with_retry_after = 0
        self.series: dict[int, Counter[str]] = {}
        self.total_ok = 0
        # Failures without an answer (connection refused, closed or reset), by kind, that
        # came within --fast seconds of when their request was due: the client did not wait.
        self.failed_fast: Counter[str] = Counter()
        self.fast = 1.0

    def answer(self, status: int, latency: float, kind: str, retry_after: bool) -> None:
        self.statuses[status] += 1
        lat = self.latency.get(status)
        if lat is None:
            lat = self.latency[status] = array("d")
        lat.append(latency)
        if 200 <= status < 300:
            self.total_ok += 1
        if status == 503 and retry_after:
            self.unavailable_with_retry_after += 1
        self.mark(kind)

    def mark(self, kind: str) -> None:
        slot = int((time.monotonic() - self.t0) / self.bucket)
        counts = self.series.get(slot)
        if counts is None:
            counts = self.series[slot] = Counter()
        counts[kind] += 1

    def fail(self, kind: str, latency: float | None = None) -> None:
        self.errors[kind] += 1
        if latency is not None and latency <= self.fast:
            self.failed_fast[kind] += 1
        self.mark(kind)


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, gen: OpenLoop, due: float) -> None:
        self._gen = gen
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self.due = due  # when the request on this connection was due (perf_counter)
        self.busy = True  # a new connection is opened for a request
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._transport.write(self._gen.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self._gen.lost(self)
        if self.busy:
            self.busy = False
            self._gen.stats.fail("connection_lost", time.perf_counter() - self.due)
            self._gen.settled()
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, due: float) -> bool:
        if self._transport is None or self._transport.is_closing():
            return False
        self.busy = True
        self.due = due
        self._transport.write(self._gen.request)
        return True

    def expire(self) -> None:
        """Past the deadline: count it and drop the connection (its answer may still come)."""
        self.busy = False
        self._gen.stats.fail("timeout")
        self._gen.settled()
        self.close()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            length = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                return
            status = int(head[9:12])
            kind = str(status)
            body = bytes(buf[end + 4 : total])
            if 200 <= status < 300:
                k = body.find(_ROUTE)
                if k >= 0:
                    kind += "/" + body[k + 9 : body.find(b'"', k + 9)].decode()
            elif self.busy:
                k = body.find(_ERROR)
                code = body[k + 9 : body.find(b'"', k + 9)].decode() if k >= 0 else "?"
                self._gen.stats.codes[f"{status} {code}"] += 1
            del buf[:total]
            if not self.busy:
                continue  # an answer after its deadline: already counted as a timeout
            self.busy = False
            latency = time.perf_counter() - self.due
            self._gen.stats.answer(status, latency, kind, _RETRY_AFTER in head)
            self._gen.settled()
            if b"\r\nconnection: close" in head:
                self.close()
            else:
                self._gen.idle.append(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class OpenLoop:
    def __init__(
        self,
        url: str,
        request: bytes,
        *,
        max_connections: int,
        timeout: float,
        stats: _Stats,
    ) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.request = request
        self.max_connections = max_connections
        self.timeout = timeout
        self.stats = stats
        self.conns: set[_Connection] = set()
        self.idle: list[_Connection] = []
        self.opening: set[asyncio.Task[None]] = set()
        self.due = 0
        self.sent = 0
        self.shed = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._idle_event = asyncio.Event()

    def arrive(self, due: float) -> None:
        self.due += 1
        while self.idle:
            conn = self.idle.pop()
            if conn.send(due):
                self._started()
                return
        if len(self.conns) + len(self.opening) >= self.max_connections:
            self.shed += 1
            self.stats.mark("shed")
            return
        task = asyncio.get_running_loop().create_task(self._open(due))
        self.opening.add(task)
        task.add_done_callback(self.opening.discard)
        self._started()

    def _started(self) -> None:
        self.sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._idle_event.clear()

    async def _open(self, due: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(0.001, due + self.timeout - time.perf_counter())):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, due), self.host, self.port
                )
        except TimeoutError:
            self.stats.fail("timeout")
            self.settled()
        except OSError as exc:
            latency = time.perf_counter() - due
            self.stats.fail(f"connect: {exc.strerror or type(exc).__name__}", latency)
            self.settled()
        else:
            self.conns.add(conn)

    def lost(self, conn: _Connection) -> None:
        self.conns.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def settled(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self._idle_event.set()

    def sweep(self) -> None:
        """Expire requests past their deadline."""
        limit = time.perf_counter() - self.timeout
        for conn in [c for c in self.conns if c.busy and c.due < limit]:
            conn.expire()

    async def run(self, rate: float, duration: float) -> float:
        """Arrivals at `rate` for `duration` seconds; returns the wall time they took."""
        started = time.perf_counter()
        next_sweep = started + 0.25
        end = started + duration
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            due_now = int((now - started) * rate)
            step = 1.0 / rate
            burst = 0
            while self.due < due_now:
                self.arrive(started + self.due * step)
                burst += 1
                # A starved process catching up must still end on time: look at the clock
                # every thousand arrivals.
                if burst % 1000 == 0 and time.perf_counter() >= end:
                    break
            if now >= next_sweep:
                self.sweep()
                next_sweep = now + 0.25
            await asyncio.sleep(0.001)
        return time.perf_counter() - started

    async def drain(self) -> None:
        """Wait for the answers still in flight (each is bounded by its deadline)."""
        while self.in_flight > 0 or self.opening:
            self.sweep()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.25):
                    await self._idle_event.wait()

    async def close(self) -> None:
        for task in list(self.opening):
            task.cancel()
        await asyncio.gather(*self.opening, return_exceptions=True)
        for conn in list(self.conns):
            conn.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.gather(*(c.closed for c in list(self.conns)))


def percentiles(values: array[float]) -> dict[str, float]:
    """p50/p90/p99/max of `values` (seconds) in milliseconds."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000.0

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1] * 1000.0}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = dict(h.split(":", 1) for h in args.header)
    request = build_request(args.url, make_body(args.body_size), headers)
    t0 = time.monotonic()
    stats = _Stats(t0, args.bucket)
    stats.fast = args.fast
    gen = OpenLoop(
        args.url, request, max_connections=args.max_connections, timeout=args.timeout, stats=stats
    )
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        emit("START")
        wall = await gen.run(args.rate, args.duration)
        emit("END")
        try:
            # Each request has its deadline, but a starved generator sweeps late: the drain
            # as a whole is bounded too, and what is left is counted, not waited for.
            async with asyncio.timeout(args.timeout + DRAIN_SLACK):
                await gen.drain()
        except TimeoutError:
            stats.errors["unfinished"] += max(0, gen.in_flight)
    finally:
        await gen.close()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    slow = [x for x in stats.latency.get(503, array("d")) if x > args.limit]
    return {
        "t0": t0,
        "bucket": args.bucket,
        "rate": args.rate,
        "wall": wall,
        "due": gen.due,
        "sent": gen.sent,
        "shed": gen.shed,
        "max_in_flight": gen.max_in_flight,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "error_codes": dict(stats.codes.most_common()),
        "errors": dict(stats.errors),
        "total_ok": stats.total_ok,
        "unavailable_with_retry_after": stats.unavailable_with_retry_after,
        "latency_ms": {str(k): percentiles(v) for k, v in sorted(stats.latency.items())},
        "limit": args.limit,
        "unavailable_over_limit": len(slow),
        "unavailable_over_limit_max_ms": max(slow) * 1000.0 if slow else None,
        "unavailable_fast": sum(1 for x in stats.latency.get(503, array("d")) if x <= args.fast),
        "failed_fast": dict(stats.failed_fast),
        "fast": args.fast,
        "series": {str(k): dict(v) for k, v in sorted(stats.series.items())},
        "cpu_s": (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime),
    }


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="arrivals per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    parser.add_argument("--max-connections", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline per request")
    parser.add_argument("--limit", type=float, default=2.0, help="503s slower than this count")
    parser.add_argument("--bucket", type=float, default=0.5, help="seconds per series step")
    parser.add_argument(
        "--fast", type=float, default=1.0, help="a 503 or a refusal this soon 'failed fast'"
    )
    parser.add_argument("--body-size", type=int, default=1024)
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    args = parser.parse_args(argv)
    result = run_fast(lambda: run(args))
    emit("RESULT " + orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
