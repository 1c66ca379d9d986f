"""The chaos scenarios' load generator: asyncio + aiohttp, in the runner's own loop so that
faults can be timed against it. Each request's ids and outcome go to an `AckWriter`; an
unanswered request (or a 503) is retried **with the same MessageIds** on another ready
replica, as a client behind a Kubernetes Service would.

`Endpoints` plays the Service: it polls each replica's ``/readyz`` and hands out only ready
ones (all of them when none is ready, so that outages are seen).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from loadtests.acks import AckWriter, Outcome, classify

log = logging.getLogger(__name__)

BATCH_CONTENT_TYPE = "application/vnd.microsoft.servicebus.json"
# (entity path, URL path): two queues and the topic.
TARGETS: tuple[tuple[str, str], ...] = (
    ("orders", "/queues/orders/messages"),
    ("payments", "/queues/payments/messages"),
    ("events", "/topics/events/messages"),
)


class Endpoints:
    """The ready replicas, refreshed every `interval` s by an owned polling task."""

    def __init__(self, urls: Sequence[str], interval: float = 0.2) -> None:
        self.urls = list(urls)
        self.interval = interval
        self.ready: list[str] = list(urls)
        self._rr = itertools.count()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Endpoints:
        self._task = asyncio.create_task(self._poll(), name="endpoints")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def pick(self, avoid: str | None = None) -> str:
        pool = self.ready or self.urls
        if avoid is not None and len(pool) > 1:
            pool = [u for u in pool if u != avoid] or pool
        return pool[next(self._rr) % len(pool)]

    async def _poll(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                ready = []
                for url in self.urls:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                        async with asyncio.timeout(1.0):
                            async with session.get(url + "/readyz") as resp:
                                if resp.status == 200:
                                    ready.append(url)
                self.ready = ready
                await asyncio.sleep(self.interval)


@dataclass(slots=True)
class RequestRecord:
    """One HTTP attempt (monotonic times)."""

    start: float
    end: float
    status: int | None
    outcome: Outcome
    route: str | None
    messages: int
    url: str
    error: str | None
    attempt: int


@dataclass
class LoadProfile:
    """What the generator sends."""

    concurrency: int = 16
    rate: float | None = None  # requests/s for all workers together; None = as fast as possible
    batch_ratio: float = 0.2  # share of requests that are batches
    batch_size: tuple[int, int] = (2, 20)
    large_ratio: float = 0.03  # share of single messages between 16 KB and 200 KB
    medium_ratio: float = 0.2  # share between 1 KB and 16 KB (the rest: 100 B - 1 KB)
    ttl: float | None = None  # TimeToLive (s) on every message
    retry: bool = True  # retry unanswered / 503 requests with the same ids
    retry_for: float = 60.0  # give up retrying one request after this long
    retry_backoff: float = 0.25  # first back-off; doubles, capped at 1 s (Retry-After ignored)
    request_timeout: float = 15.0
    targets: tuple[tuple[str, str], ...] = TARGETS
    id_prefix: str = "m"
    authorization: str | None = None


@dataclass
class LoadStats:
    records: list[RequestRecord] = field(default_factory=list)
    messages_acked: int = 0
    requests: int = 0

    def window(self, start: float, end: float) -> list[RequestRecord]:
        """Attempts that started within [start, end)."""
        return [r for r in self.records if start <= r.start < end]


class LoadClient:
    """Sends until `stop` is set (then finishes retries in flight, bounded by `retry_for`)."""

    def __init__(self, endpoints: Endpoints, acks: AckWriter, profile: LoadProfile) -> None:
        self.endpoints = endpoints
        self.acks = acks
        self.profile = profile
        self.stats = LoadStats()
        self.stop = asyncio.Event()
        self._seq = itertools.count()
        self._rng = random.Random(1234)
        self._next_slot = time.monotonic()

    async def run(self, duration: float | None = None, messages: int | None = None) -> LoadStats:
        """Run for `duration` seconds, or until `messages` were sent, or until `stop`."""
        p = self.profile
        connector = aiohttp.TCPConnector(limit=p.concurrency * 2, force_close=False)
        timeout = aiohttp.ClientTimeout(total=p.request_timeout)
        deadline = None if duration is None else time.monotonic() + duration
        budget = [messages]
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with asyncio.TaskGroup() as tg:
                for w in range(p.concurrency):
                    tg.create_task(self._worker(session, w, deadline, budget))
        self.acks.flush()
        return self.stats

    async def _pace(self) -> None:
        rate = self.profile.rate
        if not rate:
            return
        now = time.monotonic()
        slot = max(self._next_slot, now)
        self._next_slot = slot + 1.0 / rate
        if slot > now:
            await asyncio.sleep(slot - now)

    async def _worker(
        self,
        session: aiohttp.ClientSession,
        w: int,
        deadline: float | None,
        budget: list[int | None],
    ) -> None:
        while not self.stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return
            if budget[0] is not None and budget[0] <= 0:
                return
            await self._pace()
            if self.stop.is_set():
                return
            entity, path, body, headers, ids = self._make_request(w)
            if budget[0] is not None:
                budget[0] -= len(ids)
            await self._send_with_retries(session, entity, path, body, headers, ids)

    def _body(self) -> bytes:
        p = self.profile
        r = self._rng.random()
        if r < p.large_ratio:
            n = self._rng.randint(16 * 1024, 200 * 1024)
        elif r < p.large_ratio + p.medium_ratio:
            n = self._rng.randint(1024, 16 * 1024)
        else:
            n = self._rng.randint(100, 1024)
        return (b"x" * 64 + b"\n") * (n // 65) + b"y" * (n % 65)

    def _make_request(self, w: int) -> tuple[str, str, bytes, dict[str, str], list[str]]:
        p = self.profile
        entity, path = p.targets[self._rng.randrange(len(p.targets))]
        headers: dict[str, str] = {}
        if p.authorization:
            headers["Authorization"] = p.authorization
        broker_props: dict[str, object] = {}
        if p.ttl is not None:
            broker_props["TimeToLive"] = p.ttl
        if self._rng.random() < p.batch_ratio:
            n = self._rng.randint(*p.batch_size)
            ids = [f"{p.id_prefix}-{next(self._seq)}" for _ in range(n)]
            items = [
                {
                    "Body": "b" * self._rng.randint(100, 2048),
                    "BrokerProperties": {"MessageId": mid, **broker_props},
                    "UserProperties": {"worker": w},
                }
                for mid in ids
            ]
            headers["Content-Type"] = BATCH_CONTENT_TYPE
            return entity, path, orjson.dumps(items), headers, ids
        mid = f"{p.id_prefix}-{next(self._seq)}"
        headers["Content-Type"] = "application/octet-stream"
        headers["BrokerProperties"] = orjson.dumps({"MessageId": mid, **broker_props}).decode()
        headers["worker"] = str(w)
        return entity, path, self._body(), headers, [mid]

    async def _send_with_retries(
        self,
        session: aiohttp.ClientSession,
        entity: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        ids: list[str],
    ) -> None:
        p = self.profile
        first = time.monotonic()
        backoff = p.retry_backoff
        avoid: str | None = None
        for attempt in itertools.count():
            url = self.endpoints.pick(avoid)
            rec = await self.send_once(session, url, entity, path, body, headers, ids, attempt)
            if rec.outcome == "acked" or not p.retry:
                return
            if rec.status is not None and rec.status < 500:
                return  # a 4xx is final: the same request would be refused again
            if time.monotonic() - first + backoff > p.retry_for:
                return
            avoid = url
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def send_once(
        self,
        session: aiohttp.ClientSession,
        url: str,
        entity: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        ids: list[str],
        attempt: int = 0,
    ) -> RequestRecord:
        """One attempt; records it (acks file and stats) and returns it."""
        start = time.monotonic()
        status: int | None = None
        route: str | None = None
        error: str | None = None
        outcome: Outcome
        try:
            async with session.post(url + path, data=body, headers=headers) as resp:
                status = resp.status
                raw = await resp.read()
            payload = orjson.loads(raw) if raw[:1] == b"{" else {}
            if 200 <= status < 300:
                route = payload.get("route")
            else:
                error = payload.get("error")
            outcome = classify(status, error)
        except aiohttp.ClientConnectorError as exc:
            # Refused before anything was sent: nothing can have been stored.
            error = f"connect: {type(exc).__name__}"
            outcome = "rejected"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = type(exc).__name__
            outcome = "indeterminate"
        end = time.monotonic()
        latency = (end - start) * 1000 if status is not None else None
        self.acks.write(ids, entity, status, outcome, route, latency)
        rec = RequestRecord(start, end, status, outcome, route, len(ids), url, error, attempt)
        self.stats.records.append(rec)
        self.stats.requests += 1
        if outcome == "acked":
            self.stats.messages_acked += len(ids)
        return rec
