"""Prometheus metrics. One registry per app (tests run several apps in one process).

Every metric is listed in docs/metrics.md, rendered from these declarations (their help text
is the meaning there); names follow Prometheus conventions (`sbgate_` prefix, base units,
`_total` for counters). Each registry also carries the standard process, platform and GC
collectors that dashboards assume; the `_created` series are off.
"""

from __future__ import annotations

import contextlib
import math
import platform
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway import __version__
from gateway.core.dispatcher import DispatchObserver
from gateway.core.failover import FailoverObserver
from gateway.core.limiter import GradientLimiter
from gateway.ledger import EventLedger
from gateway.state.base import INVALID_VALUE_SOURCES, SEVERITY, Status
from gateway.state.memory import StoreStats
from gateway.syphon.syphon import SyphonObserver
from gateway.web.observer import EdgeObserver
from gateway.web.overload import (
    PAUSE_REASONS,
    SHED_REASONS,
    ListenerStats,
    PauseReason,
    Shedder,
    ShedReason,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# 202 -> home: from a second (a failback racing the writes) to a day (a long outage).
_DWELL_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
STATES: tuple[Status, ...] = ("healthy", "failing", "failed_over")

# `_created` series double every counter and histogram for a value no dashboard reads.
disable_created_metrics()  # type: ignore[no-untyped-call]


class Metrics(DispatchObserver, FailoverObserver, SyphonObserver, EdgeObserver):
    """All of the gateway's metrics, and the observer of the dispatcher, failover, the syphon
    and the HTTP edge."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The standard collectors (process_*, python_info, python_gc_*): the default
        # registry's instances describe this process, whichever app registry exports them.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        # One declaration per metric, a family per method; docs/metrics.md lists them in
        # the order they are registered.
        self._requests(self.registry)
        self._sending(self.registry)
        self._edge_load(self.registry)
        self._amqp(self.registry)
        self._links(self.registry)
        self._failover(self.registry)
        self._syphon(self.registry)
        self._sessions(self.registry)
        self._health(self.registry)
        self._fenced: dict[str, set[str]] = {}  # entity -> fenced sessions (the gauge)

    def _requests(self, r: CollectorRegistry) -> None:
        """Build information, and what each message request was answered."""
        self.build_info = Info("sbgate_build", "Version of the running gateway.", registry=r)
        self.build_info.info({"version": __version__, "python": platform.python_version()})
        # The per-request series are plain numbers, counted on the event loop and exported
        # at scrape time (`_RequestTable`): a request costs a dict lookup and a few integer
        # additions instead of four locked prometheus_client updates.
        self.requests_table = _RequestTable()
        # `IngestObserver.request_answered`, called by every edge once per request
        # (gateway.ingest): the table's own method, no call of ours around it.
        self.request_answered = self.requests_table.count  # type: ignore[method-assign]
        self.http_requests = _AnsweredCollector(self.requests_table)
        self.http_duration = _DurationCollector(
            "sbgate_http_request_duration_seconds",
            _DURATION_DOC,
            ("route", "protocol"),
            self.requests_table.timings,
        )
        self.messages = _MessagesCollector(self.requests_table)
        for collector in (self.http_requests, self.http_duration, self.messages):
            r.register(collector)

    def _sending(self, r: CollectorRegistry) -> None:
        """Broker send operations, and admission (waiting for room to send)."""
        # Per broker operation, plain numbers too (`_SendTable`): a lone request is an
        # operation of its own, and three locked prometheus_client updates were a tenth of
        # what the dispatcher spent on it.
        self.send_table = _SendTable()
        self.broker_duration = _DurationCollector(
            "sbgate_broker_send_duration_seconds",
            _SEND_DURATION_DOC,
            ("namespace", "outcome"),
            self.send_table.timings,
        )
        self.batch_size = _BatchCollector(self.send_table)
        for collector in (self.broker_duration, self.batch_size):
            r.register(collector)
        self.sends_in_flight = Gauge(
            "sbgate_broker_sends_in_flight",
            "Broker send operations in flight.",
            registry=r,
        )
        table = self.send_table
        self.sends_in_flight.set_function(lambda: float(table.in_flight))
        self.admission_rejected = Counter(
            "sbgate_admission_rejected_total",
            "Requests answered 503 saturated: no room freed up within admission_timeout, or "
            "their namespace was at its adaptive limit.",
            registry=r,
        )
        self.admission_limit = Gauge(
            "sbgate_admission_limit",
            "Requests a namespace may hold now, set from its measured send latency (adaptive "
            "admission; from the namespace's first send).",
            ["namespace"],
            registry=r,
        )
        self.admission_limit_baseline = Gauge(
            "sbgate_admission_limit_baseline_seconds",
            "The send latency without the gateway's own queueing (each window's least "
            "sample, averaged), learned from live traffic: the adaptive limit aims at "
            "adaptive_tolerance times it, or 50 ms when higher (NaN until measured).",
            ["namespace"],
            registry=r,
        )
        self.admission_limit_broker_floor = Gauge(
            "sbgate_admission_limit_broker_floor_seconds",
            "The fastest broker send of the last few measurement windows (the send alone, "
            "no queueing in the gateway): the adaptive limit never aims below "
            "adaptive_tolerance times it (0 until measured).",
            ["namespace"],
            registry=r,
        )
        self.admission_limit_refused = Counter(
            "sbgate_admission_limit_refused_total",
            "Requests refused at once (503 saturated) because their namespace was at its "
            "adaptive limit.",
            ["namespace"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "sbgate_admission_waiting_requests",
            "Requests waiting for room (admission).",
            registry=r,
        )

    def _edge_load(self, r: CollectorRegistry) -> None:
        """What the HTTP edge holds and sheds: connections, requests, bytes."""
        self.http_shed = Counter(
            "sbgate_http_shed_total",
            "Requests and connections answered 503 overloaded before any work, by reason: "
            "connections (over http.max_connections), in_progress (over "
            "http.max_requests_in_progress), head_wait (waited over http.max_head_wait).",
            ["reason"],
            registry=r,
        )
        for reason in SHED_REASONS:
            self.http_shed.labels(reason)
        self.http_connections = Gauge(
            "sbgate_http_open_connections",
            "Open client connections (counted against http.max_connections).",
            registry=r,
        )
        self.http_in_progress = Gauge(
            "sbgate_http_requests_in_progress",
            "Requests being handled (counted against http.max_requests_in_progress).",
            registry=r,
        )
        self.http_in_progress_limit = Gauge(
            "sbgate_http_requests_in_progress_limit",
            "Requests admitted at once now: http.max_requests_in_progress, or the adaptive "
            "limit (docs/admission.md); 0: none.",
            registry=r,
        )
        self.http_request_latency = Gauge(
            "sbgate_http_request_latency_seconds",
            "Mean seconds from a request's head to its answer over the last quarter second "
            "(0 while too few were answered to tell): the adaptive in-progress limit is cut "
            "while it is over sbgate_http_request_latency_goal_seconds (docs/admission.md).",
            registry=r,
        )
        self.http_request_latency_goal = Gauge(
            "sbgate_http_request_latency_goal_seconds",
            "The mean request latency the adaptive in-progress limit holds to: "
            "limits.adaptive_latency_goal, or adaptive_tolerance x the broker's measured "
            "latency when that is higher (0: the rule is off).",
            registry=r,
        )
        self.http_listening = Gauge(
            "sbgate_http_listening",
            "1 while the listen port accepts connections; 0 while it does not (paused under "
            "overload: the kernel refuses new connections, never counted in "
            "sbgate_http_shed_total; or not listening yet).",
            registry=r,
        )
        # The kernel's refusals never reach the process: the listener's pauses stand for them.
        self.http_listener_pauses, self.http_listener_paused = (
            _ListenerCollector(name, doc, read, registry=r)
            for name, read, doc in (
                (
                    "sbgate_http_listener_pauses",
                    "pauses",
                    "Times the listen port stopped listening under overload, by the reason "
                    "that began the pause: connections (at http.max_connections), loop_lag "
                    "(the event loop behind), accept_queue (connections piling up in the "
                    "kernel's accept queue).",
                ),
                (
                    "sbgate_http_listener_paused_seconds",
                    "paused_seconds",
                    "Seconds the listen port spent not listening under overload (the current "
                    "pause included), by the reason that began each pause.",
                ),
            )
        )
        self.pending_bytes = Gauge(
            "sbgate_pending_bytes",
            "Bytes of accepted-but-unsettled messages held in memory.",
            registry=r,
        )

    def _amqp(self, r: CollectorRegistry) -> None:
        """The AMQP edge (gateway.amqp): its connections, tokens and refusals. Its deliveries
        are counted with the HTTP requests, `protocol="amqp"`."""
        self.amqp_connections = Gauge(
            "sbgate_amqp_open_connections",
            "Open AMQP client connections (counted against amqp.max_connections).",
            registry=r,
        )
        self.amqp_put_tokens = Counter(
            "sbgate_amqp_put_tokens_total",
            "$cbs put-token requests, by result: granted, or refused (status 401).",
            ["result"],
            registry=r,
        )
        self.amqp_refusals = Counter(
            "sbgate_amqp_refused_total",
            "What the AMQP edge refused before any send, by kind: connection (over "
            "amqp.max_connections or draining), link (a receiver or a transaction "
            "coordinator), management (a management operation), delivery (past the "
            "link's credit, over the bytes held in flight, or on a closing connection).",
            ["kind"],
            registry=r,
        )
        for result in ("granted", "refused"):
            self.amqp_put_tokens.labels(result)
        for kind in ("connection", "link", "management", "delivery"):
            self.amqp_refusals.labels(kind)

    def _links(self, r: CollectorRegistry) -> None:
        """Sender links and AMQP connections, restarted loops, readiness."""
        self.senders_recreated = Counter(
            "sbgate_senders_recreated_total",
            "Senders closed after a failure made their link suspect.",
            ["namespace"],
            registry=r,
        )
        self.batch_splits = Counter(
            "sbgate_batch_splits_total",
            "Extra broker sends made to isolate a message the broker refused for its own sake "
            "from the other requests of its micro-batch (bisection).",
            registry=r,
        )
        self.task_restarts = Counter(
            "sbgate_task_restarts_total",
            "Background loops (syphon queues and supervisor, pingers, state writer and "
            "supervisor, ledger writer, AMQP connection readers; sender workers end and a new "
            "one starts with the next request) that raised and were restarted, by kind of loop.",
            ["task"],
            registry=r,
        )
        self.senders_open = Gauge(
            "sbgate_senders_open",
            "Sender links open now, all entities (at most max_open_senders while idle ones "
            "can be closed).",
            registry=r,
        )
        self.connections_open = Gauge(
            "sbgate_amqp_connections_open",
            "AMQP connections open now, all namespaces (at most connections_per_namespace each).",
            registry=r,
        )
        self.ready = Gauge("sbgate_ready", "1 when /readyz answers 200, 0 otherwise.", registry=r)

    def _failover(self, r: CollectorRegistry) -> None:
        """Failover state per entity, backlog sends and pings."""
        self.failover_state = Gauge(
            "sbgate_failover_state",
            "Failover state per entity: 0 healthy, 1 failing, 2 failed over "
            "(sbgate_failover_status says the same by name).",
            ["entity"],
            registry=r,
        )
        self.failover_status = Enum(
            "sbgate_failover_status",
            "Failover state per entity, one series per state (1 for the current one).",
            ["entity"],
            states=list(STATES),
            registry=r,
        )
        self.entity_missing_gauge = Gauge(
            "sbgate_entity_missing",
            "1 while a configured entity does not exist at its primary namespace (checked at "
            "start-up, then every 30 s while missing; GET /admin/entities says why), else 0.",
            ["entity"],
            registry=r,
        )
        self.failover_transitions = Counter(
            "sbgate_failover_transitions_total",
            "Failover state changes applied on this replica, by entity and new state.",
            ["entity", "state"],
            registry=r,
        )
        self.backlog_sends = Counter(
            "sbgate_backlog_sends_total",
            "Send operations to backlog queues, by queue and outcome (ok, failed).",
            ["queue", "outcome"],
            registry=r,
        )
        self.backlog_out_of_rotation = Gauge(
            "sbgate_backlog_queues_out_of_rotation",
            "Backlog queues currently out of rotation (cluster-wide view of this replica).",
            registry=r,
        )
        self.pings = Counter(
            "sbgate_pings_total",
            "Pings sent to failed-over primary entities, by entity and outcome.",
            ["entity", "outcome"],
            registry=r,
        )

    def _syphon(self, r: CollectorRegistry) -> None:
        """The syphon's moves and the backlog queues' contents."""
        self.syphon_moved = Counter(
            "sbgate_syphon_moved_total",
            "Messages the syphon moved from a backlog queue to their entity, by entity.",
            ["entity"],
            registry=r,
        )
        self.syphon_expired = Counter(
            "sbgate_syphon_expired_total",
            "Backlogged messages whose TTL ran out, dead-lettered in the backlog, by entity.",
            ["entity"],
            registry=r,
        )
        self.syphon_abandoned = Counter(
            "sbgate_syphon_abandoned_total",
            "Backlogged messages abandoned because their move failed (retried later).",
            registry=r,
        )
        self.syphon_dead_lettered = Counter(
            "sbgate_syphon_dead_lettered_total",
            "Backlogged messages dead-lettered by the syphon, by reason.",
            ["reason"],
            registry=r,
        )
        self.syphon_operations = Counter(
            "sbgate_syphon_broker_operations_total",
            "Broker operations made by the syphon, by kind (receive, send, complete, "
            "abandon, dead_letter, renew_lock, depth_check).",
            ["kind"],
            registry=r,
        )
        self.backlog_dwell = Histogram(
            "sbgate_backlog_dwell_seconds",
            "Time from the 202 answer to the message's arrival home (moved by the syphon).",
            ["entity"],
            buckets=_DWELL_BUCKETS,
            registry=r,
        )
        self.backlog_messages = Gauge(
            "sbgate_backlog_messages",
            "Active messages per backlog queue, as of the syphon's last depth check (every "
            "minute while a backlog may hold messages).",
            ["queue"],
            registry=r,
        )
        self.backlog_oldest_ts = Gauge(
            "sbgate_backlog_oldest_message_timestamp_seconds",
            "When the oldest message the syphon last found at the head of a backlog queue "
            "was accepted (unix time); absent while the queue is empty.",
            ["queue"],
            registry=r,
        )

    def _sessions(self, r: CollectorRegistry) -> None:
        """What the syphon costs (billed or not), and the session fences."""
        self.billed_operations = Counter(
            "sbgate_syphon_billed_operations_total",
            "Messaging operations Service Bus bills, made by the syphon and the pinger, by "
            "kind (receive, send, complete, abandon, dead_letter, renew_lock, ping, peek: the "
            "peeks that rebuild a session fence Redis lost).",
            ["kind"],
            registry=r,
        )
        self.management_reads = Counter(
            "sbgate_syphon_management_reads_total",
            "Management reads made by the syphon (depth checks: one for every backlog "
            "queue), not billed as messaging operations.",
            registry=r,
        )
        self.session_moves = Counter(
            "sbgate_syphon_session_moves_total",
            "One session's messages of one receive, moved home in order (moved), held back "
            "by the session's fence (waited), or stopped by a failed move (failed).",
            ["outcome"],
            registry=r,
        )
        self.session_fences = Gauge(
            "sbgate_session_fences",
            "Sessions fenced now (their new messages take the backlog path until their "
            "backlogged ones are home), by entity.",
            ["entity"],
            registry=r,
        )
        self.session_fence_seconds = Histogram(
            "sbgate_session_fence_seconds",
            "How long a session fence stood, observed when it lifts.",
            buckets=_DWELL_BUCKETS,
            registry=r,
        )

    def _health(self, r: CollectorRegistry) -> None:
        """The shared state backend and this replica's event loop."""
        self.redis_connected = Gauge(
            "sbgate_redis_connected",
            "1 while the shared state backend (Redis) is reachable; 1 without Redis.",
            registry=r,
        )
        self.event_loop_lag = Gauge(
            "sbgate_event_loop_lag_seconds",
            "How late the event loop ran a callback scheduled every 0.1 s, at the latest "
            "sample: this replica's own delay (a send timeout during a lag over "
            "loop_lag_tolerance does not count toward failover).",
            registry=r,
        )
        self.state_invalid_values = _StateCollector()
        r.register(self.state_invalid_values)

    def bind_state(self, stats: StoreStats) -> None:
        """Export the state store's counts of invalid values (by source) and of times Redis
        lost its data (read at scrape)."""
        self.state_invalid_values.stats = stats

    def bind_ledger(self, ledger: EventLedger) -> None:
        """Export the ledger's own counters (read at scrape time)."""
        self.registry.register(_LedgerCollector(ledger))

    def shed(self, reason: ShedReason) -> None:
        self.http_shed.labels(reason).inc()

    def admission_refused(self) -> None:
        self.admission_rejected.inc()

    def watch_http(self, shedder: Shedder) -> None:
        """Read the open connections and requests in progress from the server's shedder."""
        self.http_connections.set_function(lambda: shedder.connections)
        self.http_in_progress.set_function(lambda: shedder.in_progress)
        self.http_in_progress_limit.set_function(lambda: shedder.limit)
        self.http_request_latency.set_function(lambda: shedder.latency or 0.0)
        self.http_request_latency_goal.set_function(lambda: shedder.latency_goal)

    def watch_listener(self, stats: ListenerStats) -> None:
        """Read the listen port's state and pauses from its site (read at scrape)."""
        self.http_listening.set_function(lambda: 1.0 if stats.listening else 0.0)
        self.http_listener_pauses.stats = stats
        self.http_listener_paused.stats = stats

    def amqp_put_token(self, result: str) -> None:
        self.amqp_put_tokens.labels(result).inc()

    def amqp_refused(self, kind: str) -> None:
        self.amqp_refusals.labels(kind).inc()

    def bind_amqp(self, connections: Callable[[], int]) -> None:
        self.amqp_connections.set_function(lambda: float(connections()))

    def bind_admission(self, waiting: Callable[[], int], used: Callable[[], int]) -> None:
        self.admission_waiting.set_function(lambda: float(waiting()))
        self.pending_bytes.set_function(lambda: float(used()))

    def bind_links(self, senders: Callable[[], int], connections: Callable[[], int]) -> None:
        self.senders_open.set_function(lambda: float(senders()))
        self.connections_open.set_function(lambda: float(connections()))

    # DispatchObserver
    def batch_sent(self, dest: str, messages: int, seconds: float, outcome: str) -> None:
        self.send_table.sent(dest.split("/", 1)[0], outcome, seconds, messages)

    def in_flight(self, delta: int) -> None:
        self.send_table.in_flight += delta

    def sender_recreated(self, dest: str) -> None:
        self.senders_recreated.labels(dest.split("/", 1)[0]).inc()

    def limiter_created(self, namespace: str, limiter: GradientLimiter) -> None:
        # Read at scrape time: the request path only counts.
        self.admission_limit.labels(namespace).set_function(lambda: float(limiter.limit))
        self.admission_limit_baseline.labels(namespace).set_function(
            lambda: math.nan if limiter.baseline is None else limiter.baseline
        )
        self.admission_limit_broker_floor.labels(namespace).set_function(
            lambda: limiter.broker_floor
        )

    def limit_refused(self, namespace: str) -> None:
        self.admission_limit_refused.labels(namespace).inc()

    def batch_split(self, dest: str) -> None:
        self.batch_splits.inc()

    # TaskObserver (gateway.lifetimes): every component's loops
    def task_restarted(self, task: str) -> None:
        self.task_restarts.labels(task).inc()

    # FailoverObserver
    def entity_declared(self, entity: str) -> None:
        # The gauge only: one series per declared entity. The state set's three appear at
        # the entity's first transition (its alert looks for failed_over alone).
        self.failover_state.labels(entity).set(SEVERITY["healthy"])

    def entity_state(self, entity: str, status: Status) -> None:
        self.failover_state.labels(entity).set(SEVERITY[status])
        self.failover_status.labels(entity).state(status)
        self.failover_transitions.labels(entity, status).inc()

    def entity_missing(self, entity: str, missing: bool) -> None:
        self.entity_missing_gauge.labels(entity).set(1 if missing else 0)

    def backlog_send(self, queue: str, ok: bool) -> None:
        self.backlog_sends.labels(queue, "ok" if ok else "failed").inc()

    def backlog_disabled(self, count: int) -> None:
        self.backlog_out_of_rotation.set(count)

    def ping(self, entity: str, ok: bool) -> None:
        self.pings.labels(entity, "ok" if ok else "failed").inc()
        self.billed_operations.labels("ping").inc()

    def fence_changed(self, key: tuple[str, str], on: bool, age: float) -> None:
        """A session fence was set or lifted (`gateway.state.fence.FenceListener`)."""
        entity, session = key
        fenced = self._fenced.setdefault(entity, set())
        if on:
            fenced.add(session)
        elif session in fenced:
            fenced.discard(session)
            if age > 0:
                self.session_fence_seconds.observe(age)
        self.session_fences.labels(entity).set(len(fenced))

    # SyphonObserver
    def moved(self, entity: str, n: int) -> None:
        self.syphon_moved.labels(entity).inc(n)

    def expired(self, entity: str) -> None:
        self.syphon_expired.labels(entity).inc()

    def abandoned(self, n: int) -> None:
        self.syphon_abandoned.inc(n)

    def dead_lettered(self, reason: str) -> None:
        self.syphon_dead_lettered.labels(reason).inc()

    def operation(self, kind: str) -> None:
        self.syphon_operations.labels(kind).inc()
        if kind == "depth_check":
            self.management_reads.inc()
        else:
            self.billed_operations.labels(kind).inc()

    def session_move(self, outcome: str) -> None:
        self.session_moves.labels(outcome).inc()

    def dwell(self, entity: str, seconds: float) -> None:
        self.backlog_dwell.labels(entity).observe(seconds)

    def backlog_depths(self, depths: Mapping[str, int]) -> None:
        for queue, n in depths.items():
            self.backlog_messages.labels(queue).set(n)
            if n == 0:
                self.backlog_oldest(queue, None)

    def backlog_oldest(self, queue: str, accepted_at: float | None) -> None:
        if accepted_at is None:
            with contextlib.suppress(KeyError):
                self.backlog_oldest_ts.remove(queue)
        else:
            self.backlog_oldest_ts.labels(queue).set(accepted_at)


class _StateCollector(Collector):
    """`sbgate_state_invalid_values_total`, one series per source, each from the start, and
    `sbgate_redis_data_lost_total`."""

    # Read by tests/support/doc_tables.py, as for the metrics declared with labels.
    _name = "sbgate_state_invalid_values"
    _labelnames = ("source",)

    def __init__(self) -> None:
        self.stats = StoreStats()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            self._name,
            "Values read from Redis (a hash a resync read, a pub/sub event, a script's reply, "
            "a lease key) that did not parse, were skipped or written over, and were logged "
            "with their key.",
            labels=self._labelnames,
        )
        counts = self.stats.invalid_values
        for source in INVALID_VALUE_SOURCES:
            family.add_metric([source], counts.get(source, 0))
        yield family
        yield CounterMetricFamily(
            "sbgate_redis_data_lost",
            "Times this replica found that Redis had lost its data under a live connection "
            "(the dataset mark gone: a restart, a failover to an empty replica, a FLUSHALL) "
            "and resynced, writing its state and session fences back.",
            value=self.stats.data_losses,
        )


class _ListenerCollector(Collector):
    """A counter per listener pause reason, each from the start (0 until a site is bound),
    read from the bound `ListenerStats` method named `read` at scrape time."""

    _labelnames = ("reason",)  # read by tests/support/doc_tables.py, with _name

    def __init__(
        self, name: str, documentation: str, read: str, *, registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read
        self.stats: ListenerStats | None = None
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        stats = self.stats
        read: Callable[[PauseReason], float] | None = (
            getattr(stats, self._read) if stats is not None else None
        )
        for reason in PAUSE_REASONS:
            family.add_metric([reason], read(reason) if read is not None else 0)
        yield family


class _LedgerCollector(Collector):
    def __init__(self, ledger: EventLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        lg = self._ledger
        yield CounterMetricFamily(
            "sbgate_ledger_events_written", "Ledger events written.", value=lg.written
        )
        yield CounterMetricFamily(
            "sbgate_ledger_events_dropped",
            "Ledger events dropped because the buffer was full or the sink failing.",
            value=lg.dropped,
        )
        yield CounterMetricFamily(
            "sbgate_ledger_write_errors", "Failed ledger sink writes.", value=lg.write_errors
        )
        yield GaugeMetricFamily(
            "sbgate_ledger_queue_depth", "Ledger events buffered in memory.", value=lg.queue_depth
        )


# -- the per-request series: plain numbers, exported at scrape time ----------------------------

_REQUESTS_DOC = (
    "Send requests answered, by entity, status code, route and protocol (`http`, or `amqp`: "
    "one per delivery, with the status code an HTTP request would have had)."
)
_DURATION_DOC = (
    "Time from request received to answer, for message requests (an AMQP delivery: from its "
    "last frame to its settlement), by route and protocol."
)
_MESSAGES_DOC = "Messages accepted (stored by Service Bus), by entity and route."
# The buckets' upper bounds, +Inf last, and their `le` labels as prometheus_client writes them.
_LATENCY_BOUNDS = (*(float(b) for b in _LATENCY_BUCKETS), math.inf)
_LATENCY_LE = tuple(floatToGoString(b) for b in _LATENCY_BOUNDS)  # type: ignore[no-untyped-call]


class _Timing:
    """One series of the duration histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * len(_LATENCY_BOUNDS)
        self.sum = 0.0


class _Answered:
    """One label set of `sbgate_http_requests_total`: its count, the messages its requests
    had accepted, and the duration series (route, protocol) it also counts in."""

    __slots__ = ("count", "messages", "timing")

    def __init__(self, timing: _Timing) -> None:
        self.count = 0
        self.messages = 0
        self.timing = timing


class _RequestTable:
    """The numbers behind `sbgate_http_requests_total`, `sbgate_http_request_duration_seconds`
    and `sbgate_messages_total`, counted once per request on the event loop and read by the
    collectors below at scrape time (in a worker thread: `gateway.app`).

    The values are those prometheus_client's `Counter` and `Histogram` would hold for the same
    calls, series for series and in the same order (tests/gateway/test_metrics_table.py holds
    the exposition to theirs): a request's duration goes to the first bucket whose bound is
    not below it, and each series' sum adds its durations in the order they came. A scrape
    copies each container with one C-level call (`list(...)`), which no other thread can
    interleave with under the GIL; a count read a moment early is what any scrape sees."""

    __slots__ = ("answered", "timings")

    def __init__(self) -> None:
        # The label sets are bounded: declared entities and "_unknown" x status codes x routes
        # x protocols; insertion order is the series' order.
        self.answered: dict[tuple[str, int, str, str], _Answered] = {}
        self.timings: dict[tuple[str, str], _Timing] = {}

    def count(
        self,
        entity: str,
        status: int,
        route: str,
        seconds: float,
        protocol: str = "http",
        messages: int = 0,
    ) -> None:
        """One request answered `status` after `seconds`; `messages` of them accepted (a
        refusal's route is ``none``, and it adds no `sbgate_messages_total` series)."""
        row = self.answered.get((entity, status, route, protocol))
        if row is None:
            row = self._new(entity, status, route, protocol)
        row.count += 1
        row.messages += messages
        timing = row.timing
        timing.buckets[bisect_left(_LATENCY_BOUNDS, seconds)] += 1
        timing.sum += seconds

    def _new(self, entity: str, status: int, route: str, protocol: str) -> _Answered:
        timing = self.timings.get((route, protocol))
        if timing is None:
            timing = self.timings[(route, protocol)] = _Timing()
        row = self.answered[(entity, status, route, protocol)] = _Answered(timing)
        return row


_SEND_DURATION_DOC = (
    "Duration of one broker send operation (one batch), by destination and outcome."
)
_BATCH_DOC = "Messages per broker send operation."
_BATCH_BOUNDS = (*(float(b) for b in _BATCH_BUCKETS), math.inf)
_BATCH_LE = tuple(floatToGoString(b) for b in _BATCH_BOUNDS)  # type: ignore[no-untyped-call]


class _SendTable:
    """The numbers behind `sbgate_broker_send_duration_seconds`, `sbgate_broker_batch_messages`
    and `sbgate_broker_sends_in_flight`: counted once per broker operation on the event loop,
    read at scrape time, as `_RequestTable`'s are (and held, the same way, to what
    prometheus_client's `Histogram` and `Gauge` show: tests/gateway/test_metrics_table.py)."""

    __slots__ = ("batch_sum", "batches", "in_flight", "timings")

    def __init__(self) -> None:
        self.timings: dict[tuple[str, str], _Timing] = {}  # by (namespace, outcome)
        self.batches = [0] * len(_BATCH_BOUNDS)
        self.batch_sum = 0.0
        self.in_flight = 0

    def sent(self, namespace: str, outcome: str, seconds: float, messages: int) -> None:
        timing = self.timings.get((namespace, outcome))
        if timing is None:
            timing = self.timings[(namespace, outcome)] = _Timing()
        timing.buckets[bisect_left(_LATENCY_BOUNDS, seconds)] += 1
        timing.sum += seconds
        self.batches[bisect_left(_BATCH_BOUNDS, messages)] += 1
        self.batch_sum += messages


def _cumulative(les: tuple[str, ...], counts: list[int]) -> list[tuple[str, float]]:
    """A histogram's buckets as the exposition has them: cumulative, by `le`."""
    out: list[tuple[str, float]] = []
    acc = 0
    for le, n in zip(les, counts, strict=True):
        acc += n
        out.append((le, acc))
    return out


class _BatchCollector(Collector):
    """`sbgate_broker_batch_messages`, from the `_SendTable` (one series, there from the
    start, as an unlabelled `Histogram`'s is)."""

    _name = "sbgate_broker_batch_messages"
    _labelnames = ()

    def __init__(self, table: _SendTable) -> None:
        self._table = table

    def collect(self) -> Iterator[HistogramMetricFamily]:
        table = self._table
        total = table.batch_sum
        family = HistogramMetricFamily(self._name, _BATCH_DOC, labels=())
        family.add_metric([], _cumulative(_BATCH_LE, list(table.batches)), total)
        yield family


class _AnsweredCollector(Collector):
    """`sbgate_http_requests_total`, from the `_RequestTable`."""

    _name = "sbgate_http_requests"  # read by tests/support/doc_tables.py, with _labelnames
    _labelnames = ("entity", "status", "route", "protocol")

    def __init__(self, table: _RequestTable) -> None:
        self._table = table

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, _REQUESTS_DOC, labels=self._labelnames)
        for (entity, status, route, protocol), row in list(self._table.answered.items()):
            family.add_metric([entity, str(status), route, protocol], row.count)
        yield family


class _DurationCollector(Collector):
    """A duration histogram from a table's `_Timing`s by their label values:
    `sbgate_http_request_duration_seconds` (the `_RequestTable`'s, by route and protocol) and
    `sbgate_broker_send_duration_seconds` (the `_SendTable`'s, by namespace and outcome)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: tuple[str, str],
        timings: dict[tuple[str, str], _Timing],
    ) -> None:
        self._name = name  # read by tests/support/doc_tables.py, with _labelnames
        self._doc = doc
        self._labelnames = labelnames
        self._timings = timings

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for labels, timing in list(self._timings.items()):
            total = timing.sum
            family.add_metric(list(labels), _cumulative(_LATENCY_LE, list(timing.buckets)), total)
        yield family


class _MessagesCollector(Collector):
    """`sbgate_messages_total`: the accepted requests' messages, by entity and route."""

    _name = "sbgate_messages"
    _labelnames = ("entity", "route")

    def __init__(self, table: _RequestTable) -> None:
        self._table = table

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, _MESSAGES_DOC, labels=self._labelnames)
        sums: dict[tuple[str, str], int] = {}
        for (entity, _status, route, _protocol), row in list(self._table.answered.items()):
            if route != "none":  # a refusal: nothing accepted
                sums[(entity, route)] = sums.get((entity, route), 0) + row.messages
        for labels, n in sums.items():
            family.add_metric(list(labels), n)
        yield family
