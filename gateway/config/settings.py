"""Configuration: read once at start-up into frozen dataclasses, validated with clear messages.

Sources, later ones winning: built-in defaults → the TOML file (``SBGATE_CONFIG`` or
``--config``) → environment variables ``SBGATE_*``. Nothing else in the gateway reads
``os.environ``: `load_settings` receives the environment as a mapping.

Each setting is declared once, on its dataclass field (`setting(...)`): its default, the
parser that checks its value (with its bounds), a one-line description and, where it is not
the field's name in capitals, its environment variable. The loader's tables (`SETTINGS`) and
the documentation's table (docs/configuration.md, checked against `SETTINGS` by the tests)
are derived from those declarations.
"""

from __future__ import annotations

import difflib
import math
import re
import socket
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final, Literal, Protocol, cast, get_args

from gateway.core.entities import validate_entity_path
from gateway.errors import InvalidEntityPath
from gateway.secret import Secret as Secret  # re-exported: settings hold secrets

ENV_PREFIX = "SBGATE_"
EntityKind = Literal["queue", "topic"]
LogFormat = Literal["json", "text"]
CredentialKind = Literal["workload", "managed", "default"]
RedisMode = Literal["standalone", "cluster", "sentinel"]
RedisCredential = Literal["none", "workload", "managed", "default"]
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it."""


def _sdk_parse(value: str) -> Any:
    """azure-servicebus's `parse_connection_string` (ValueError with the SDK's message)."""
    from azure.servicebus import parse_connection_string as sdk_parse

    return sdk_parse(value)


_CS_PART = re.compile(r"\s*([^=;]+?)\s*=\s*(.*?)\s*$")


def parse_connection_string(value: str) -> dict[str, str]:
    """Split a Service Bus connection string into its (case-preserved) parts."""
    parts: dict[str, str] = {}
    for piece in value.split(";"):
        if not piece.strip():
            continue
        m = _CS_PART.match(piece)
        if not m:
            raise ConfigError("connection string has a part without '='")
        parts[m.group(1)] = m.group(2)
    return parts


# --- values: a raw TOML or environment value → a setting's value ------------------------


class Parser(Protocol):
    """Checks and converts one raw value (a TOML value, or an environment variable's text);
    raises `ConfigError` starting with `name`. `accepts` says what it takes, for the docs."""

    def __call__(self, name: str, value: Any, /) -> Any: ...

    def accepts(self) -> str: ...


@dataclass(frozen=True, slots=True)
class _Bool:
    def __call__(self, name: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in {"1", "true", "yes", "on"}:
            return True
        if s in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")

    def accepts(self) -> str:
        return "`true` or `false`"


def _plain(n: float) -> str:
    """A bound as the docs show it: 600, 0.05, 2147483647."""
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


@dataclass(frozen=True, slots=True)
class _Number:
    kind: type[int] | type[float]
    minimum: float
    maximum: float

    def __call__(self, name: str, value: Any) -> Any:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            n = self.kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(n, float) and not math.isfinite(n):
            raise ConfigError(f"{name}: must be finite, got {value!r}")
        if not self.minimum <= n <= self.maximum:
            raise ConfigError(
                f"{name}: must be between {self.minimum:g} and {self.maximum:g}, got {n!r}"
            )
        return n

    def accepts(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        return f"{what}, {_plain(self.minimum)} to {_plain(self.maximum)}"


def _int(minimum: int, maximum: int = 2**31 - 1) -> _Number:
    return _Number(int, minimum, maximum)


def _float(minimum: float, maximum: float = 365 * 86400.0) -> _Number:
    return _Number(float, minimum, maximum)


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected a non-empty string")
    return value


@dataclass(frozen=True, slots=True)
class _Text:
    secret: bool = False  # held as a `Secret`: never shown in logs or errors

    def __call__(self, name: str, value: Any) -> str | Secret:
        text = _str(name, value)
        return Secret(text) if self.secret else text

    def accepts(self) -> str:
        return "a secret string" if self.secret else "a string"


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}: must be one of {sorted(allowed)}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Choice:
    allowed: tuple[str, ...]
    upper: bool = False  # compared in capitals (log levels)

    def __call__(self, name: str, value: Any) -> str:
        return _choice(name, str(value).upper() if self.upper else value, self.allowed)

    def accepts(self) -> str:
        return ", ".join(f"`{a}`" for a in self.allowed)


@dataclass(frozen=True, slots=True)
class _StrList:
    def __call__(self, name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name}: expected a list of strings")

    def accepts(self) -> str:
        return "comma-separated (TOML: a list of strings)"


# --- declaring a setting -----------------------------------------------------------------

_SETTING: Final = "sbgate.setting"
_SECTION: Final = "sbgate.section"


@dataclass(frozen=True, slots=True)
class Setting:
    """How one setting is read and documented; declared on its field with `setting`."""

    parse: Parser
    doc: str  # one line, for docs/configuration.md
    env: str | None = None  # the variable after SBGATE_; None: the field's name in capitals
    shown_default: str | None = None  # the documented default, when the value cannot say it
    # `env` is a standard variable's whole name (OTEL_*): read from the environment only,
    # never from the TOML file, and not under SBGATE_.
    standard: bool = False


def setting(
    default: Any = MISSING,
    *,
    parse: Parser,
    doc: str,
    env: str | None = None,
    shown_default: str | None = None,
    default_factory: Any = MISSING,
    standard: bool = False,
) -> Any:
    """A dataclass field that is a setting (see the module docstring)."""
    meta = {_SETTING: Setting(parse, doc, env, shown_default, standard)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type[Any]) -> Any:
    """A field holding a TOML table of settings (``[limits]``...): its own dataclass."""
    return field(default_factory=cls, metadata={_SECTION: True})


@dataclass(frozen=True, slots=True)
class NamespaceField:
    """A namespace setting: ``SBGATE_{PRIMARY,SECONDARY}_<env>`` for the default pair, or
    the field's name in a ``[pairs.<name>.primary]`` / ``.secondary`` table."""

    env: str
    doc: str
    shown_default: str | None = None


def _ns_field(env: str, doc: str, shown_default: str | None = None, **kw: Any) -> Any:
    return field(metadata={_SETTING: NamespaceField(env, doc, shown_default)}, **kw)


# --- the settings ------------------------------------------------------------------------


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
        return str(_sdk_parse(self.connection_string.get()).fully_qualified_namespace)


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


_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """``[limits]``: backpressure and sizes."""

    max_in_flight: int = setting(
        64, parse=_int(1, 100_000), doc="broker send operations in flight, all entities"
    )
    senders_per_entity: int = setting(
        4,
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
    """``[http]``: deadlines and caps for slow or greedy clients (gateway.web.hardening)."""

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
        doc="open client connections; one accepted over it is answered `503 overloaded` and "
        "closed before its request is read (0: no cap)",
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


# --- derived from the declarations: what the loader reads, and the docs list -------------


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """A declared setting as the loader and the docs see it."""

    section: str | None  # its TOML table (``limits``...), None at the top level
    name: str  # the field's name: its TOML key
    env: str  # its environment variable
    spec: Setting
    default: Any

    @property
    def where(self) -> str:
        """How error messages name it."""
        if self.spec.standard:
            return self.env
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def toml(self) -> str:
        return f"[{self.section}] {self.name}" if self.section else self.name


def _default(f: Any) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _declared(cls: type[Any], section_name: str | None) -> Iterator[SettingInfo]:
    for f in fields(cls):
        spec = f.metadata.get(_SETTING)
        if isinstance(spec, Setting):
            env = (
                spec.env
                if spec.standard and spec.env
                else ENV_PREFIX + (spec.env or f.name.upper())
            )
            yield SettingInfo(section_name, f.name, env, spec, _default(f))


SECTIONS: Final[Mapping[str, type[Any]]] = {
    f.name: cast("type[Any]", f.default_factory)
    for f in fields(Settings)
    if f.metadata.get(_SECTION)
}
SETTINGS: Final[tuple[SettingInfo, ...]] = (
    *_declared(Settings, None),
    *(info for name, cls in SECTIONS.items() for info in _declared(cls, name)),
)
# SBGATE_{PRIMARY,SECONDARY}_<env>: the default pair's namespaces.
NAMESPACE_ROLES: Final = ("PRIMARY", "SECONDARY")
NAMESPACE_FIELDS: Final[Mapping[str, tuple[str, NamespaceField]]] = {
    f.metadata[_SETTING].env: (f.name, f.metadata[_SETTING]) for f in fields(NamespaceSettings)
}
CONFIG_FILE_ENV: Final = f"{ENV_PREFIX}CONFIG"  # the TOML file (or --config)
ENTITIES_ENV: Final = f"{ENV_PREFIX}ENTITIES"  # queue:orders,topic:events@pair; TOML [[entities]]

_TOP: Final = {i.name: i for i in SETTINGS if i.section is None}
_BY_SECTION: Final = {s: {i.name: i for i in SETTINGS if i.section == s} for s in SECTIONS}
_BY_ENV: Final = {i.env: i for i in SETTINGS}
_STANDARD_ENV: Final = {i.env: i for i in SETTINGS if i.spec.standard}
# Sections read only from standard variables: not a table of the TOML file.
_ENV_ONLY: Final = {i.section for i in _STANDARD_ENV.values()}
if len(_BY_ENV) != len(SETTINGS):  # two sections' fields of one name need their own `env`
    raise AssertionError("two settings share an environment variable")


def env_names() -> set[str]:
    """Every variable `load_settings` accepts: SBGATE_*, and the standard OTEL_* ones."""
    return {name for row in documentation() for name in row.env}


@dataclass(frozen=True, slots=True)
class DocRow:
    """One row of the settings' documentation (docs/configuration.md)."""

    env: tuple[str, ...]
    toml: tuple[str, ...]
    default: str
    accepts: str
    doc: str


def _shown(value: Any) -> str:
    if value is None or value == ():
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return _plain(value) if isinstance(value, float) else str(value)


def documentation() -> list[DocRow]:
    """Every setting, in the order the docs list them: derived from the declarations."""
    rows = [DocRow((CONFIG_FILE_ENV,), (), "", "a file path", "the TOML file (or `--config`)")]
    for info in SETTINGS:
        if info.section is None:
            rows.append(_doc_row(info))
    rows.append(
        DocRow(
            (ENTITIES_ENV,),
            ("[[entities]] path, kind, pair",),
            "",
            "`queue:orders,topic:events@pair`",
            "the entities clients may send to (`kind` defaults to `queue`, `pair` to "
            "`default`); required with a namespace",
        )
    )
    for suffix, (name, ns) in NAMESPACE_FIELDS.items():
        env = tuple(f"{ENV_PREFIX}{role}_{suffix}" for role in NAMESPACE_ROLES)
        toml = tuple(f"[pairs.<pair>.{role.lower()}] {name}" for role in NAMESPACE_ROLES)
        rows.append(DocRow(env, toml, ns.shown_default or "", "", ns.doc))
    rows += [_doc_row(info) for info in SETTINGS if info.section is not None]
    return rows


def _doc_row(info: SettingInfo) -> DocRow:
    spec = info.spec
    default = spec.shown_default if spec.shown_default is not None else _shown(info.default)
    toml = () if spec.standard else (info.toml,)
    return DocRow((info.env,), toml, default, spec.parse.accepts(), spec.doc)


# --- the loader --------------------------------------------------------------------------


@dataclass(slots=True)
class _Raw:
    """The raw values from the file and the environment, before parsing."""

    top: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, dict[str, Any]] = field(default_factory=lambda: {s: {} for s in SECTIONS})
    pairs: dict[str, dict[str, Any]] = field(default_factory=dict)
    entities: list[dict[str, Any]] = field(default_factory=list)
    # How an error names a value that came from the environment: the setting's name (as
    # errors say it) -> the variable the user set.
    from_env: dict[str, str] = field(default_factory=dict)

    def add_file(self, doc: Mapping[str, Any]) -> None:
        """A parsed TOML document: unknown keys and tables of the wrong shape are errors."""
        for key, value in doc.items():
            if key in _TOP:
                self.top[key] = value
            elif key in SECTIONS and key not in _ENV_ONLY:
                if not isinstance(value, dict):
                    raise ConfigError(f"[{key}] must be a table")
                self.sections[key].update(value)
            elif key == "pairs":
                if not isinstance(value, dict):
                    raise ConfigError("[pairs.<name>] must be tables")
                self.pairs = {k: dict(v) for k, v in value.items()}
            elif key == "entities":
                if not isinstance(value, list):
                    raise ConfigError("[[entities]] must be an array of tables")
                self.entities = [dict(e) for e in value]
            else:
                known = [*_TOP, *(k for k in SECTIONS if k not in _ENV_ONLY), "pairs", "entities"]
                raise ConfigError(f"config file: unknown setting {key!r}{_nearest(key, known)}")

    def add_env(self, env: Mapping[str, str]) -> None:
        """The SBGATE_* variables, over the file's values; an unknown one is an error."""
        for env_key, value in env.items():
            if (standard := _STANDARD_ENV.get(env_key)) is not None:
                self.sections[cast(str, standard.section)][standard.name] = value
                continue
            if not env_key.startswith(ENV_PREFIX) or env_key == CONFIG_FILE_ENV:
                continue
            role, _, suffix = env_key.removeprefix(ENV_PREFIX).partition("_")
            if info := _BY_ENV.get(env_key):
                values = self.top if info.section is None else self.sections[info.section]
                values[info.name] = value
                self.from_env[info.where] = env_key
            elif env_key == ENTITIES_ENV:
                self.entities = _entities_from_env(value)
                self.from_env["entities"] = env_key
            elif role in NAMESPACE_ROLES and suffix in NAMESPACE_FIELDS:
                attr = NAMESPACE_FIELDS[suffix][0]
                self._set_namespace(role.lower(), attr, value)
                self.from_env[f"pairs.default.{role.lower()}.{attr}"] = env_key
            else:
                raise ConfigError(
                    f"{env_key}: unknown setting{_nearest(env_key, env_names(), key=False)}"
                )

    def named(self, exc: ConfigError) -> ConfigError:
        """`exc` with the variable the user set in front of the setting it names (errors
        name settings as the TOML file does: ``failover.ping_primary_interval: ...``)."""
        text = str(exc)
        for where, env_key in sorted(self.from_env.items(), key=lambda kv: -len(kv[0])):
            if text.startswith(where) and text[len(where) : len(where) + 1] in (":", " "):
                return ConfigError(f"{env_key} ({where}){text[len(where) :]}")
        return exc

    def _set_namespace(self, role: str, attr: str, value: str) -> None:
        """One field of the default pair's primary or secondary namespace."""
        table = self.pairs.setdefault("default", {}).setdefault(role, {})
        if isinstance(table, str):  # the file gave a connection string
            table = self.pairs["default"][role] = {"connection_string": table}
        table[attr] = value


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def load_settings(env: Mapping[str, str], config_file: str | Path | None = None) -> Settings:
    """Build the one `Settings` object from a TOML file and the environment.

    Raises `ConfigError` naming the bad setting. Pure: reads only `config_file` and `env`.
    """
    raw = _Raw()
    path = config_file or env.get(CONFIG_FILE_ENV)
    if path:
        raw.add_file(_read_toml(path))
    raw.add_env(env)
    try:
        kwargs: dict[str, Any] = {key: _TOP[key].spec.parse(key, v) for key, v in raw.top.items()}
        for name, cls in SECTIONS.items():
            kwargs[name] = cls(**_section_values(name, raw.sections[name]))
        pairs = tuple(_pair(name, table) for name, table in raw.pairs.items())
        settings = Settings(**kwargs, pairs=pairs, entities=_entities(raw.entities, pairs))
        _cross_check(settings)
    except ConfigError as exc:
        raise raw.named(exc) from None
    return settings


def _nearest(name: str, known: Iterable[str], *, key: bool = True) -> str:
    """``; did you mean 'x'?`` for the closest known TOML key (a variable: unquoted), or
    nothing when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {close[0]!r}?" if key else f"; did you mean {close[0]}?"


def _section_values(section_name: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    declared = _BY_SECTION[section_name]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in declared:
            raise ConfigError(f"[{section_name}]: unknown setting {key!r}{_nearest(key, declared)}")
        values[key] = declared[key].spec.parse(declared[key].where, value)
    return values


def _pair(name: str, raw: Mapping[str, Any]) -> PairSettings:
    where = f"pairs.{name}"
    extra = set(raw) - {"primary", "secondary"}
    if extra:
        hint = _nearest(sorted(extra)[0], ("primary", "secondary"))
        raise ConfigError(f"{where}: unknown setting(s) {sorted(extra)}{hint}")
    if "primary" not in raw:
        raise ConfigError(f"{where}: a primary namespace is required")
    primary = _namespace(f"{where}.primary", _ns_table(raw["primary"]))
    secondary = (
        _namespace(f"{where}.secondary", _ns_table(raw["secondary"]))
        if raw.get("secondary")
        else None
    )
    return PairSettings(name=name, primary=primary, secondary=secondary)


def _ns_table(value: Any) -> Mapping[str, Any]:
    if isinstance(value, str):
        return {"connection_string": value}
    if isinstance(value, dict):
        return value
    raise ConfigError("a namespace must be a connection string or a table")


def _namespace(where: str, raw: Mapping[str, Any]) -> NamespaceSettings:
    known = {f.name for f in fields(NamespaceSettings)}
    extra = set(raw) - known
    if extra:
        hint = _nearest(sorted(extra)[0], known)
        raise ConfigError(f"{where}: unknown setting(s) {sorted(extra)}{hint}")
    cs = raw.get("connection_string")
    fqns = raw.get("fully_qualified_namespace")
    if bool(cs) == bool(fqns):
        raise ConfigError(
            f"{where}: set exactly one of connection_string or fully_qualified_namespace"
        )
    host = ""
    if cs:
        # The SDK's own parser: what it refuses is refused here, with its words.
        try:
            host = _sdk_parse(_str(f"{where}.connection_string", cs)).fully_qualified_namespace
        except ValueError as exc:
            raise ConfigError(f"{where}.connection_string: {exc}") from None
    else:
        host = _str(f"{where}.fully_qualified_namespace", fqns)
    name = raw.get("name") or host.split(".")[0].split(":")[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9\-]*", name):
        raise ConfigError(f"{where}.name: {name!r} is not a valid namespace name")
    admin = raw.get("admin_connection_string")
    return NamespaceSettings(
        name=name,
        connection_string=Secret(cs) if cs else None,
        fully_qualified_namespace=fqns or None,
        admin_connection_string=Secret(_str(f"{where}.admin_connection_string", admin))
        if admin
        else None,
        admin_ca_cert=raw.get("admin_ca_cert"),
    )


def _entities_from_env(value: str) -> list[dict[str, str]]:
    """``queue:orders,topic:events@pair2`` → entity tables."""
    out: list[dict[str, str]] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        kind, sep, rest = item.partition(":")
        if not sep:
            kind, rest = "queue", item
        path, _, pair = rest.partition("@")
        out.append({"kind": kind, "path": path, "pair": pair or "default"})
    return out


def _entities(
    raw: list[dict[str, Any]], pairs: tuple[PairSettings, ...]
) -> tuple[EntitySettings, ...]:
    entities = tuple(_entity(f"entities[{i}]", e) for i, e in enumerate(raw))
    seen: set[str] = set()
    pair_names = {p.name for p in pairs}
    for e in entities:
        if e.path.lower() in seen:
            raise ConfigError(f"entities: {e.path!r} is declared twice")
        seen.add(e.path.lower())
        if pairs and e.pair not in pair_names:
            raise ConfigError(f"entities: {e.path!r} names unknown pair {e.pair!r}")
    return entities


def _entity(where: str, raw: Mapping[str, Any]) -> EntitySettings:
    path = _str(f"{where}.path", raw.get("path") or raw.get("name"))
    kind = _choice(f"{where}.kind", raw.get("kind", "queue"), get_args(EntityKind))
    pair = str(raw.get("pair", "default"))
    try:
        validate_entity_path(path)  # the one rule, as clients' requests are held to it
    except InvalidEntityPath as exc:
        raise ConfigError(f"{where}.path: {path!r} is not a valid entity path: {exc}") from None
    return EntitySettings(path=path, kind=kind, pair=pair)  # type: ignore[arg-type]


def _cross_check(s: Settings) -> None:
    lim = s.limits
    if lim.max_message_bytes > lim.max_batch_bytes:
        raise ConfigError("limits.max_message_bytes must not exceed limits.max_batch_bytes")
    if lim.max_batch_bytes > lim.max_pending_bytes:
        raise ConfigError("limits.max_batch_bytes must not exceed limits.max_pending_bytes")
    if s.pairs and not s.entities:
        raise ConfigError("entities: declare at least one entity (SBGATE_ENTITIES)")
    endpoints: dict[str, str] = {}
    for p in s.pairs:
        for ns in (p.primary, p.secondary):
            if ns is None:
                continue
            seen = endpoints.setdefault(ns.name, ns.endpoint_host)
            if seen != ns.endpoint_host:
                raise ConfigError(
                    f"pairs.{p.name}: two different namespaces are both named {ns.name!r}; "
                    "give them distinct names (name = ..., or SBGATE_PRIMARY_NAME / "
                    "SBGATE_SECONDARY_NAME)"
                )
    for p in s.pairs:
        if p.secondary is not None and p.secondary.name == p.primary.name:
            raise ConfigError(f"pairs.{p.name}: the secondary must be another namespace")


def with_pairs(settings: Settings, pairs: tuple[PairSettings, ...]) -> Settings:
    """A copy of `settings` with namespace pairs filled in (the embedded broker's)."""
    return replace(settings, pairs=pairs)


def describe(settings: Settings) -> dict[str, Any]:
    """A loggable view of the settings: secrets masked."""

    def conv(v: Any) -> Any:
        if hasattr(v, "__dataclass_fields__"):
            return {f.name: conv(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, Secret):
            return "***"
        return v

    return dict(conv(settings))
