"""The settings: one frozen dataclass per TOML table, each field one setting.

This is the file to edit to add a setting. Declare it once, on its field (`setting(...)`): its
default, the parser that checks its value (with its bounds), a one-line description and, where
it is not the field's name in capitals, its environment variable. The loader
(gateway.config.loading) and docs/configuration.md's table (rendered by
tests/support/doc_tables.py, checked by tests/test_docs.py) are derived from it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Final, Literal, get_args

# The declarations' vocabulary, under the short names the fields below read best with.
from gateway.config.declare import namespace_field as _ns_field
from gateway.config.declare import section, setting
from gateway.config.values import Bool as _Bool
from gateway.config.values import Choice as _Choice
from gateway.config.values import StrList as _StrList
from gateway.config.values import Text as _Text
from gateway.config.values import float_between as _float
from gateway.config.values import int_between as _int
from gateway.config.values import sdk_connection_string
from gateway.secret import Secret

EntityKind = Literal["queue", "topic"]
LogFormat = Literal["json", "text"]
CredentialKind = Literal["workload", "managed", "default"]
RedisMode = Literal["standalone", "cluster", "sentinel"]
RedisCredential = Literal["none", "workload", "managed", "default"]
SessionOrder = Literal["strict", "availability"]
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, slots=True)
class NamespaceSettings:
    """One Service Bus namespace: a connection string, or a namespace + azure-identity."""

    name: str = _ns_field(
        "NAME",
        "the short namespace name used in backlog paths: `<name>/x-servicebus-transfer/<i>`",
        "first DNS label",
    )
    connection_string: Secret | None = _ns_field(
        "CONNECTION_STRING", "the namespace's connection string", default=None
    )
    fully_qualified_namespace: str | None = _ns_field(
        "NAMESPACE",
        "or its fully qualified name, with the Entra ID credential (`azure_credential`)",
        default=None,
    )
    admin_connection_string: Secret | None = _ns_field(
        "ADMIN_CONNECTION_STRING",
        "management endpoint override (the local broker serves it on another port)",
        default=None,
    )
    admin_ca_cert: str | None = _ns_field(
        "ADMIN_CA_CERT", "the management endpoint's CA file", default=None
    )

    @property
    def endpoint_host(self) -> str:
        if self.fully_qualified_namespace:
            return self.fully_qualified_namespace
        assert self.connection_string is not None
        return str(sdk_connection_string(self.connection_string.get()).fully_qualified_namespace)


@dataclass(frozen=True, slots=True)
class PairSettings:
    """A primary namespace and the secondary one that holds its backlog queues."""

    name: str
    primary: NamespaceSettings
    secondary: NamespaceSettings | None = None


@dataclass(frozen=True, slots=True)
class EntitySettings:
    """An entity clients may send to."""

    path: str
    kind: EntityKind
    pair: str = "default"
    # `[failover] session_order` for this entity only (None: that setting).
    session_order: SessionOrder | None = None


_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """``[limits]``: backpressure and sizes."""

    max_in_flight: int = setting(
        64, parse=_int(1, 100_000), doc="broker send operations in flight, all entities"
    )
    senders_per_entity: int = setting(
        8,
        parse=_int(1, 64),
        doc="most senders (concurrent batch sends) per entity; opened as its load grows",
    )
    connections_per_namespace: int = setting(
        4,
        parse=_int(1, 100),
        doc="AMQP connections per namespace, shared by every sender link "
        "([sizing](deploy.md#sizing))",
    )
    max_open_senders: int = setting(
        2000,
        parse=_int(1, 1_000_000),
        doc="open sender links, all entities; the least recently used idle one is closed "
        "to open another",
    )
    sender_idle_timeout: float = setting(
        60.0,
        parse=_float(0.1, 86400.0),
        doc="seconds a sender link may stay unused before it is closed",
    )
    admission_timeout: float = setting(
        2.0, parse=_float(0.0, 600.0), doc="seconds a request may wait for room before `503`"
    )
    max_pending_bytes: int = setting(
        64 * _MiB, parse=_int(1024), doc="bytes of accepted-but-unsent messages held in memory"
    )
    max_message_bytes: int = setting(
        256 * 1024,
        parse=_int(1024, 100 * _MiB),
        doc="one message, body + properties (Standard tier)",
    )
    max_batch_bytes: int = setting(
        256 * 1024, parse=_int(1024, 100 * _MiB), doc="one broker batch / one request"
    )
    max_batch_messages: int = setting(
        100, parse=_int(1, 4500), doc="messages per broker batch and per REST batch"
    )
    max_body_bytes: int = setting(_MiB, parse=_int(1024, 200 * _MiB), doc="HTTP request body")
    max_header_bytes: int = setting(
        64 * 1024,
        parse=_int(1024, _MiB),
        doc="one header line, and the whole request head (else `431`)",
    )
    adaptive_admission: bool = setting(
        False,
        parse=_Bool(),
        doc="limit the requests each namespace may hold by its measured send latency, and "
        "answer one over the limit `503 saturated` at once ([admission.md](admission.md))",
    )
    adaptive_initial_limit: int = setting(
        256,
        parse=_int(1, 1_000_000),
        doc="a namespace's adaptive limit before anything is measured (requests)",
    )
    adaptive_min_limit: int = setting(
        8, parse=_int(1, 1_000_000), doc="the adaptive limit never falls below this"
    )
    adaptive_max_limit: int = setting(
        4096, parse=_int(1, 1_000_000), doc="the adaptive limit never grows above this"
    )
    adaptive_backoff: float = setting(
        0.7,
        parse=_float(0.1, 0.99),
        doc="share of the adaptive limit kept when the broker pushes back (busy, timeout, "
        "quota, no sender in time)",
    )
    adaptive_tolerance: float = setting(
        1.5,
        parse=_float(1.0, 10.0),
        doc="send latency up to this many times the learned baseline (or 50 ms, when "
        "higher) does not shrink the adaptive limit",
    )
    adaptive_latency_goal: float = setting(
        0.0,
        parse=_float(0.0, 10.0),
        doc="seconds; 0: off. A mean request latency (head to answer) over this, or over "
        "adaptive_tolerance x the broker's when higher, lowers the in-progress limit at the "
        "head: a lower median under overload for less goodput ([admission.md](admission.md))",
    )


@dataclass(frozen=True, slots=True)
class TimeoutSettings:
    """``[timeouts]``: our deadlines on the broker, and the back-off we ask of clients."""

    send_timeout: float = setting(
        10.0, parse=_float(0.01, 600.0), doc="our deadline on each broker operation"
    )
    connect_timeout: float = setting(
        15.0, parse=_float(0.01, 600.0), doc="opening a sender; management calls at start-up"
    )
    retry_after: float = setting(
        10.0,
        parse=_float(0.0, 3600.0),
        doc="`Retry-After` on upstream failures (every `503` of the [error table](errors.md) "
        "but shutdown's)",
    )
    sdk_retry_total: int = setting(
        1, parse=_int(0, 10), doc="the SDK's own retries, inside `send_timeout`"
    )


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    """``[failover]``: send availability (docs/design.md#paired-namespaces)."""

    enabled: bool = setting(
        True, parse=_Bool(), env="ENABLE_FAILOVER", doc="failover, when a secondary is configured"
    )
    failover_interval: float = setting(
        10.0,
        parse=_float(0.0, 86400.0),
        doc="seconds of failure before failover (0: the first counting failure)",
    )
    ping_primary_interval: float = setting(
        60.0, parse=_float(0.05, 86400.0), doc="seconds between pings of a failed-over entity"
    )
    backlog_queue_count: int = setting(
        10, parse=_int(1, 100), doc="backlog queues per primary namespace"
    )
    strict_primary: bool = setting(
        False, parse=_Bool(), doc="while failing, `503` instead of the backlog"
    )
    create_backlog_queues: bool = setting(
        True, parse=_Bool(), doc="`false`: verify-only (no Manage right)"
    )
    session_order: SessionOrder = setting(
        "strict",
        parse=_Choice(get_args(SessionOrder)),
        doc="messages with a SessionId: `strict` keeps each session's order through a "
        "failover (a fence per session), `availability` does not "
        "(docs/failover.md#sessions-keep-their-order)",
    )
    backlog_reprobe_interval: float = setting(
        30.0,
        parse=_float(0.05, 86400.0),
        doc="seconds a failed backlog queue stays out of rotation",
    )
    loop_lag_tolerance: float = setting(
        1.0,
        parse=_float(0.0, 600.0),
        doc="a send timeout during which this replica's event loop ran late by more than "
        "this many seconds in all does not count toward failover",
    )


@dataclass(frozen=True, slots=True)
class SyphonSettings:
    """``[syphon]``: the worker pool that moves backlogs home."""

    enabled: bool = setting(
        True, parse=_Bool(), env="ENABLE_SYPHON", doc="run the syphon in `gateway serve`"
    )
    workers: int = setting(
        4,
        parse=_int(1, 256),
        doc="backlog queues moving messages at once (receives: one per queue)",
    )
    max_batch: int = setting(50, parse=_int(1, 1000), doc="messages per syphon receive")
    receive_wait: float = setting(
        5.0, parse=_float(0.05, 3600.0), doc="seconds a syphon receive waits for a first message"
    )
    idle_check_interval: float = setting(
        900.0, parse=_float(0.05, 86400.0), doc="seconds between idle safety checks"
    )
    fault_unready_seconds: float = setting(
        30.0, parse=_float(0.0, 3600.0), doc="`gateway syphon` not ready this long after a fault"
    )
    exit_on_fault: bool = setting(
        False,
        parse=_Bool(),
        doc="`gateway syphon` exits 3 on a namespace fault (the pod restarts)",
    )


@dataclass(frozen=True, slots=True)
class ShutdownSettings:
    """``[shutdown]``: draining on SIGTERM."""

    drain_delay: float = setting(
        5.0,
        parse=_float(0.0, 600.0),
        doc="seconds `/readyz` is 503 while still serving after SIGTERM (endpoints drop the pod)",
    )
    shutdown_timeout: float = setting(
        20.0,
        parse=_float(0.0, 3600.0),
        doc="seconds to wait for in-flight requests "
        "(keep < `terminationGracePeriodSeconds` - drain delay - preStop)",
    )


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """``[http]``: deadlines and caps for slow or greedy clients (gateway.web.protocol)."""

    header_timeout: float = setting(
        10.0,
        parse=_float(0.05, 3600.0),
        doc="seconds for a complete request head, from connect or its first byte "
        "(slow clients are closed)",
    )
    body_timeout: float = setting(
        30.0,
        parse=_float(0.05, 3600.0),
        doc="seconds for the whole body after the head, else `408`",
    )
    keepalive_timeout: float = setting(
        75.0,
        parse=_float(0.05, 3600.0),
        doc="idle keep-alive connection; keep it *above* the ingress's upstream keep-alive "
        "(ingress-nginx: 60 s), or the ingress reuses connections the gateway just closed",
    )
    max_headers: int = setting(100, parse=_int(8, 10_000), doc="request header count")
    max_connections: int = setting(
        4096,
        parse=_int(0, 1_000_000),
        doc="open client connections; at it, `gateway serve` stops listening (new connections "
        "are refused) until a tenth are closed, and one accepted over it all the same is "
        "answered `503 overloaded` and closed before its request is read (0: no cap)",
    )
    max_requests_in_progress: int = setting(
        512,
        parse=_int(0, 1_000_000),
        doc="requests handled at once; one over it is answered `503 overloaded` before its "
        "body is read or its token checked (0: no cap)",
    )
    max_head_wait: float = setting(
        1.0,
        parse=_float(0.0, 600.0),
        doc="seconds a complete request head may wait for its handler (the event loop is "
        "behind); older: `503 overloaded` (0: no bound)",
    )


@dataclass(frozen=True, slots=True)
class AmqpSettings:
    """``[amqp]``: the AMQP 1.0 edge for Service Bus SDK senders (gateway.amqp, docs/amqp.md).

    Off unless a listener is configured: TLS when a certificate is given, plain when a plain
    port is."""

    port: int = setting(
        5671,
        parse=_int(0, 65535),
        env="AMQP_PORT",
        doc="the TLS listener's port (the Python SDK always dials 5671 with TLS); it runs when "
        "`amqp.tls_cert_file` is set",
    )
    host: str | None = setting(
        None,
        parse=_Text(),
        env="AMQP_HOST",
        shown_default="listen_host",
        doc="the TLS listener's address",
    )
    tls_cert_file: str | None = setting(
        None,
        parse=_Text(),
        env="AMQP_TLS_CERT_FILE",
        doc="PEM certificate chain of the TLS listener (reloaded when the file changes)",
    )
    tls_key_file: str | None = setting(
        None,
        parse=_Text(),
        env="AMQP_TLS_KEY_FILE",
        doc="PEM private key of that certificate (reloaded with it)",
    )
    plain_port: int = setting(
        0,
        parse=_int(0, 65535),
        env="AMQP_PLAIN_PORT",
        doc="a plain-TCP listener for development and sidecars (clients set "
        "`UseDevelopmentEmulator=true`); 0: none",
    )
    plain_host: str = setting(
        "127.0.0.1",
        parse=_Text(),
        env="AMQP_PLAIN_HOST",
        doc="the plain listener's address; beyond loopback only with `allow_open`",
    )
    link_credit: int = setting(
        1000,
        parse=_int(1, 10_000),
        env="AMQP_LINK_CREDIT",
        doc="deliveries a sender link may have in flight (Service Bus grants 1000: the Python "
        "SDK, out of credit, stalls); while the dispatcher's admission is full, links are left one",
    )
    max_connections: int = setting(
        1024, parse=_int(1, 1_000_000), env="AMQP_MAX_CONNECTIONS", doc="open AMQP connections"
    )
    max_sessions: int = setting(
        32,
        parse=_int(1, 65535),
        env="AMQP_MAX_SESSIONS",
        doc="sessions per connection (the SDKs open one to three per sender)",
    )
    max_links: int = setting(
        64, parse=_int(2, 65535), env="AMQP_MAX_LINKS", doc="links per connection"
    )
    max_frame_size: int = setting(
        65536,
        parse=_int(512, 16 * _MiB),
        env="AMQP_MAX_FRAME_SIZE",
        doc="the largest frame accepted (larger messages come in several frames)",
    )
    handshake_timeout: float = setting(
        10.0,
        parse=_float(0.1, 600.0),
        env="AMQP_HANDSHAKE_TIMEOUT",
        doc="seconds from connect to an open connection (TLS, SASL, open); else it is closed",
    )
    idle_timeout: float = setting(
        0.0,
        parse=_float(0.0, 3600.0),
        env="AMQP_IDLE_TIMEOUT",
        doc="seconds of silence after which a connection is closed, advertised to clients (0: "
        "none; the Python SDK only talks when it sends)",
    )
    max_connection_age: float = setting(
        0.0,
        parse=_float(0.0, 30 * 86400.0),
        env="AMQP_MAX_CONNECTION_AGE",
        doc="seconds after which an idle connection is closed (`amqp:connection:forced`) so "
        "that clients reconnect, through the load balancer, to any replica; 0: never",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert_file) or self.plain_port > 0


TracesExporter = Literal["none", "otlp", "console"]
Sampler = Literal[
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
    "always_on",
    "always_off",
    "traceidratio",
]


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """OpenTelemetry tracing (gateway.tracing), from the standard ``OTEL_*`` variables only.

    Off unless ``OTEL_TRACES_EXPORTER`` names an exporter. The trace context a client sends
    is put on its messages with tracing off too."""

    exporter: TracesExporter = setting(
        "none",
        parse=_Choice(get_args(TracesExporter)),
        env="OTEL_TRACES_EXPORTER",
        standard=True,
        doc="tracing: `otlp` (OTLP over HTTP; needs the `otel` extra, which the image has), "
        "`console` (spans on stdout), or `none` (off)",
    )
    disabled: bool = setting(
        False, parse=_Bool(), env="OTEL_SDK_DISABLED", standard=True, doc="`true`: tracing off"
    )
    service_name: str = setting(
        "sbgate", parse=_Text(), env="OTEL_SERVICE_NAME", standard=True, doc="`service.name`"
    )
    resource_attributes: str | None = setting(
        None,
        parse=_Text(),
        env="OTEL_RESOURCE_ATTRIBUTES",
        standard=True,
        doc="more resource attributes, `key=value,key2=value2`",
    )
    sampler: Sampler = setting(
        "parentbased_always_on",
        parse=_Choice(get_args(Sampler)),
        env="OTEL_TRACES_SAMPLER",
        standard=True,
        doc="which traces are recorded (`parentbased_*`: as the client's `traceparent` says)",
    )
    sampler_arg: float = setting(
        1.0,
        parse=_float(0.0, 1.0),
        env="OTEL_TRACES_SAMPLER_ARG",
        standard=True,
        doc="the ratio of the `*traceidratio` samplers",
    )
    otlp_endpoint: str = setting(
        "http://localhost:4318",
        parse=_Text(),
        env="OTEL_EXPORTER_OTLP_ENDPOINT",
        standard=True,
        doc="the collector's OTLP/HTTP base URL (spans go to its `/v1/traces`)",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        parse=_Text(),
        env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        standard=True,
        doc="the whole URL spans go to, instead",
    )
    otlp_headers: Secret | None = setting(
        None,
        parse=_Text(secret=True),
        env="OTEL_EXPORTER_OTLP_HEADERS",
        standard=True,
        doc="headers on each export, `key=value,...` (URL-encoded values)",
    )
    otlp_timeout: float = setting(
        10_000.0,
        parse=_float(1.0, 600_000.0),
        env="OTEL_EXPORTER_OTLP_TIMEOUT",
        standard=True,
        doc="the deadline on each export, in milliseconds",
    )

    @property
    def enabled(self) -> bool:
        return self.exporter != "none" and not self.disabled


@dataclass(frozen=True, slots=True)
class Settings:
    listen_host: str = setting("127.0.0.1", parse=_Text(), doc="listen address")
    listen_port: int = setting(8080, parse=_int(0, 65535), doc="listen port")
    probe_port: int = setting(
        0,
        parse=_int(0, 65535),
        doc="a second port, on `listen_host`, serving only `/healthz`, `/readyz` and `/metrics` "
        "and never closed when the listen port stops listening under overload (for the "
        "Kubernetes probes); 0: none",
    )
    replica_id: str = setting(
        default_factory=socket.gethostname,
        parse=_Text(),
        shown_default="hostname",
        doc="this replica's name (the pod's) in state and logs",
    )
    # The namespace pairs and the entities have their own forms (NamespaceField, ENTITIES).
    pairs: tuple[PairSettings, ...] = ()
    entities: tuple[EntitySettings, ...] = ()
    redis_url: Secret | None = setting(
        None,
        parse=_Text(secret=True),
        doc="shared failover state; without it, in-process (one replica)",
    )
    redis_mode: RedisMode = setting(
        "standalone",
        parse=_Choice(get_args(RedisMode)),
        doc="`standalone`: one endpoint (a server, Azure Cache for Redis non-clustered, Azure "
        "Managed Redis Enterprise policy); `cluster`: the Redis Cluster protocol (Premium "
        "clustered, Azure Managed Redis OSS policy, a self-hosted cluster); `sentinel`: the "
        "master that Sentinel names (`redis+sentinel://h1:26379,h2:26379/<master>/0`)",
    )
    redis_ca_file: str | None = setting(
        None,
        parse=_Text(),
        doc="PEM CA bundle trusted for `rediss://` in addition to the system store",
    )
    redis_credential: RedisCredential = setting(
        "none",
        parse=_Choice(get_args(RedisCredential)),
        doc="`none`: the URL's password (access key), if any; `workload`, `managed`, "
        "`default`: a Microsoft Entra ID token (as `azure_credential`, with "
        "`azure_client_id`), user name = the identity's object id, renewed before expiry",
    )
    log_format: LogFormat = setting(
        "json", parse=_Choice(get_args(LogFormat)), doc="log lines as JSON, or text to read"
    )
    log_level: str = setting(
        "INFO",
        parse=_Choice(LOG_LEVELS, upper=True),
        doc="`INFO` logs one line per request; `WARNING` only failures",
    )
    ledger: str = setting("off", parse=_Text(), doc="event ledger: `off`, `stdout` or a directory")
    ledger_compress: bool = setting(False, parse=_Bool(), doc="gzip the ledger files")
    allow_open: bool = setting(
        False, parse=_Bool(), doc="allow listening beyond loopback without auth rules"
    )
    auth_rules_file: str | None = setting(
        None, parse=_Text(), doc="SAS rules file (TOML or JSON), e.g. a mounted Secret"
    )
    auth_rules: Secret | None = setting(
        None, parse=_Text(secret=True), doc="the same rules as JSON in a variable"
    )
    public_hosts: tuple[str, ...] = setting(
        (),
        parse=_StrList(),
        shown_default="localhost,127.0.0.1,<listen_host>",
        doc="host names a token's `sr` may name; in open mode (no rules, loopback), the "
        "`Host` names answered besides loopback ones (others: `421`)",
    )
    auth_clock_skew: float = setting(
        300.0, parse=_float(0.0, 3600.0), doc="seconds of clock skew allowed on token expiry"
    )
    # A leaked long-lived token is then useless, and clients must re-sign at least this often.
    auth_max_token_lifetime: float = setting(
        0.0,
        parse=_float(0.0, 10 * 365 * 86400.0),
        doc="refuse tokens expiring further than this many seconds ahead "
        "(`401 token_lifetime_too_long`); 0: no limit",
    )
    auth_token_cache_size: int = setting(
        10_000,
        parse=_int(0, 10_000_000),
        doc="verified tokens remembered (LRU, keyed on what the token means, whatever its "
        "spelling) so that a reused token skips the signature check; 0: verify every request",
    )
    # The entry count alone does not bound memory: an entry's size follows its `sr` (up to
    # the 4 KiB header limit).
    auth_token_cache_bytes: int = setting(
        16 * _MiB,
        parse=_int(0, 1024 * _MiB),
        doc="memory the verified-token cache may use (bytes, estimated; about 1 KB per "
        "typical token); 0: verify every request",
    )
    azure_credential: CredentialKind = setting(
        "default",
        parse=_Choice(get_args(CredentialKind)),
        doc="the one Entra ID credential of the process, for namespaces given by name, shared "
        "by every client and the admin client (gateway.servicebus.identity): `workload` "
        "(AKS workload identity; the chart sets it), `managed` (managed identity), `default` "
        "(`DefaultAzureCredential`, for development)",
    )
    azure_client_id: str | None = setting(
        None,
        parse=_Text(),
        doc="a user-assigned managed identity's client id (workload identity reads "
        "`AZURE_CLIENT_ID` from the webhook)",
    )
    limits: LimitSettings = section(LimitSettings)
    timeouts: TimeoutSettings = section(TimeoutSettings)
    failover: FailoverSettings = section(FailoverSettings)
    syphon: SyphonSettings = section(SyphonSettings)
    shutdown: ShutdownSettings = section(ShutdownSettings)
    http: HttpSettings = section(HttpSettings)
    amqp: AmqpSettings = section(AmqpSettings)
    tracing: TracingSettings = section(TracingSettings)

    @property
    def embedded(self) -> bool:
        """No namespace configured: `gateway serve` starts the local broker pair itself."""
        return not self.pairs

    def pair(self, name: str) -> PairSettings:
        for p in self.pairs:
            if p.name == name:
                return p
        raise KeyError(name)
