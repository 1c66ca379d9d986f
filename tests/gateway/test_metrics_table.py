"""The per-request metrics are plain numbers exported at scrape time (`gateway.metrics`
`_RequestTable`): what a scrape shows must be, line for line, what prometheus_client's own
`Counter` and `Histogram` would show for the same requests."""

from __future__ import annotations

import random
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.metrics import (
    _BATCH_BUCKETS,
    _BATCH_DOC,
    _DURATION_DOC,
    _LATENCY_BUCKETS,
    _MESSAGES_DOC,
    _REQUESTS_DOC,
    _SEND_DURATION_DOC,
    Metrics,
)

pytestmark = pytest.mark.unit


class _Reference:
    """The per-request metrics as they were declared before: prometheus_client's classes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sbgate_http_requests_total",
            _REQUESTS_DOC,
            ["entity", "status", "route", "protocol"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "sbgate_http_request_duration_seconds",
            _DURATION_DOC,
            ["route", "protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.messages = Counter(
            "sbgate_messages_total", _MESSAGES_DOC, ["entity", "route"], registry=self.registry
        )

    def answered(
        self, entity: str, status: int, route: str, seconds: float, protocol: str, n: int
    ) -> None:
        if route != "none":
            self.messages.labels(entity, route).inc(n)
        self.requests.labels(entity, str(status), route, protocol).inc()
        self.duration.labels(route, protocol).observe(seconds)


def _histogram(name: str) -> set[str]:
    return {f"{name}{s}" for s in ("", "_bucket", "_count", "_sum")}


# The three per-request families, and the three per-operation broker ones.
_REQUEST_NAMES = {
    "sbgate_http_requests_total",
    "sbgate_messages_total",
    *_histogram("sbgate_http_request_duration_seconds"),
}
_SEND_NAMES = {
    "sbgate_broker_sends_in_flight",
    *_histogram("sbgate_broker_send_duration_seconds"),
    *_histogram("sbgate_broker_batch_messages"),
}


def _lines(registry: CollectorRegistry, names: set[str] = _REQUEST_NAMES) -> list[str]:
    """The exposition's lines of the families `names`, in their order."""
    out = []
    for line in generate_latest(registry).decode().splitlines():
        name = line.split()[2] if line.startswith("#") else line.split("{")[0].split()[0]
        if name in names:
            out.append(line)
    return out


def _requests(rng: random.Random, count: int) -> list[tuple[str, int, str, float, str, int]]:
    """Send requests' outcomes: accepted (201 primary, 202 backlog, 1..100 messages) and
    refused (4xx, 5xx: route none, nothing accepted), durations on and between bucket bounds."""
    bounds = [float(b) for b in _LATENCY_BUCKETS]
    out = []
    for _ in range(count):
        entity = rng.choice(["orders", "events", "Orders/Sub", "_unknown"])
        protocol = rng.choice(["http", "http", "amqp"])
        kind = rng.random()
        if kind < 0.6:
            status, route, n = 201, "primary", rng.randint(1, 100)
        elif kind < 0.75:
            status, route, n = 202, "backlog", rng.randint(1, 5)
        else:
            status, route, n = rng.choice([400, 401, 404, 413, 503, 504]), "none", 0
        seconds = rng.choice(
            [rng.choice(bounds), rng.uniform(0, 0.2), rng.uniform(0, 60), 0.0, 1e-7]
        )
        out.append((entity, status, route, seconds, protocol, n))
    return out


def test_a_scrape_is_what_prometheus_clients_own_metrics_show_for_the_same_requests() -> None:
    metrics, reference = Metrics(), _Reference()
    assert _lines(metrics.registry) == _lines(reference.registry)  # before any request
    for i, request in enumerate(_requests(random.Random(38), 3000)):
        metrics.request_answered(*request)
        reference.answered(*request)
        if i in {0, 1, 17, 500}:  # series appear in the same order, at the same requests
            assert _lines(metrics.registry) == _lines(reference.registry)
    lines = _lines(metrics.registry)
    assert lines == _lines(reference.registry)
    assert any(
        line.startswith('sbgate_messages_total{entity="orders",route="backlog"}') for line in lines
    )
    assert any('route="none"' in line and "sbgate_http_requests_total" in line for line in lines)
    assert not any(
        line.startswith("sbgate_messages_total") and 'route="none"' in line for line in lines
    )


def test_a_scrape_in_another_thread_while_requests_are_counted_sees_every_one_at_the_end() -> None:
    """`/metrics` renders in a worker thread while the event loop counts: no scrape fails,
    and once counting stops the scrape is exact."""
    metrics, reference = Metrics(), _Reference()
    requests = _requests(random.Random(7), 20_000)
    failures: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        try:
            while not done.is_set():
                generate_latest(metrics.registry)
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for request in requests:
            metrics.request_answered(*request)
            reference.answered(*request)
    finally:
        done.set()
        scraper.join(timeout=60)
    assert not scraper.is_alive()
    assert failures == []
    assert _lines(metrics.registry) == _lines(reference.registry)


class _SendReference:
    """The per-operation broker metrics as they were declared before: prometheus_client's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.duration = Histogram(
            "sbgate_broker_send_duration_seconds",
            _SEND_DURATION_DOC,
            ["namespace", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch = Histogram(
            "sbgate_broker_batch_messages",
            _BATCH_DOC,
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "sbgate_broker_sends_in_flight",
            "Broker send operations in flight.",
            registry=self.registry,
        )

    def sent(self, dest: str, n: int, seconds: float, outcome: str) -> None:
        self.duration.labels(dest.split("/", 1)[0], outcome).observe(seconds)
        self.batch.observe(n)


def test_the_broker_send_series_are_what_prometheus_clients_own_metrics_show() -> None:
    metrics, reference = Metrics(), _SendReference()
    assert _lines(metrics.registry, _SEND_NAMES) == _lines(
        reference.registry, _SEND_NAMES
    )  # before any send
    rng = random.Random(11)
    bounds = [float(b) for b in _LATENCY_BUCKETS]
    sizes = [float(b) for b in _BATCH_BUCKETS]
    for i in range(3000):
        dest = rng.choice(["primary/orders", "secondary/sbgate-backlog-0", "primary/Events/x"])
        outcome = rng.choice(["ok", "ok", "ok", "timeout", "server_busy"])
        seconds = rng.choice([rng.choice(bounds), rng.uniform(0, 0.2), rng.uniform(0, 60), 0.0])
        n = rng.choice([int(rng.choice(sizes)), rng.randint(1, 100), rng.randint(1, 5000)])
        delta = rng.choice([1, -1])
        metrics.in_flight(delta)
        reference.in_flight.inc(delta)
        metrics.batch_sent(dest, n, seconds, outcome)
        reference.sent(dest, n, seconds, outcome)
        if i in {0, 1, 17, 500}:  # series appear in the same order, at the same sends
            assert _lines(metrics.registry, _SEND_NAMES) == _lines(reference.registry, _SEND_NAMES)
    lines = _lines(metrics.registry, _SEND_NAMES)
    assert lines == _lines(reference.registry, _SEND_NAMES)
    assert any('outcome="timeout"' in line for line in lines)
