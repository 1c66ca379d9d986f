"""Configuration: read once at start-up into frozen dataclasses, validated with clear messages.

Sources, later ones winning: built-in defaults → the TOML file (``SBGATE_CONFIG`` or
``--config``) → environment variables ``SBGATE_*``. Nothing else in the gateway reads
``os.environ``: `load_settings` receives the environment as a mapping.

See the README's "Configuration" section for every setting.
"""

from __future__ import annotations

import math
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from gateway.core.entities import validate_entity_path
from gateway.errors import InvalidEntityPath
from gateway.secret import Secret as Secret  # re-exported: settings hold secrets

ENV_PREFIX = "SBGATE_"
EntityKind = Literal["queue", "topic"]


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


@dataclass(frozen=True, slots=True)
class NamespaceSettings:
    """One Service Bus namespace: a connection string, or a namespace + azure-identity."""

    name: str  # the short namespace name, used in backlog paths: <name>/x-servicebus-transfer/<i>
    connection_string: Secret | None = None
    fully_qualified_namespace: str | None = None
    # Management (ATOM/HTTPS) endpoint override: the local broker serves it on another port.
    admin_connection_string: Secret | None = None
    admin_ca_cert: str | None = None

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


@dataclass(frozen=True, slots=True)
class LimitSettings:
    max_in_flight: int = 64  # broker send operations in flight, all entities together
    senders_per_entity: int = 4  # open senders (and concurrent batch sends) per entity
    admission_timeout: float = 2.0  # how long a request may wait for room before 503
    max_pending_bytes: int = 64 * 1024 * 1024  # accepted-but-unsent bytes held in memory
    max_message_bytes: int = 256 * 1024  # one message, body + properties (Standard tier)
    max_batch_bytes: int = 256 * 1024  # one broker batch (Standard tier)
    max_batch_messages: int = 100  # messages per broker batch / per REST batch request
    max_body_bytes: int = 1024 * 1024  # HTTP request body
    max_header_bytes: int = 64 * 1024  # all request headers together


@dataclass(frozen=True, slots=True)
class TimeoutSettings:
    send_timeout: float = 10.0  # our deadline on each broker operation
    connect_timeout: float = 15.0  # opening a sender at start-up
    retry_after: float = 10.0  # Retry-After on upstream failures (docs/design.md#errors)
    sdk_retry_total: int = 1  # the SDK's own retries, inside send_timeout


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    enabled: bool = True
    failover_interval: float = 10.0
    ping_primary_interval: float = 60.0
    backlog_queue_count: int = 10
    strict_primary: bool = False
    create_backlog_queues: bool = True  # False: verify-only mode (no Manage right)
    backlog_reprobe_interval: float = 30.0


@dataclass(frozen=True, slots=True)
class SyphonSettings:
    enabled: bool = True
    workers: int = 4
    max_batch: int = 50
    receive_wait: float = 5.0
    idle_check_interval: float = 900.0
    fault_unready_seconds: float = 30.0  # `gateway syphon`: not ready this long after a fault
    exit_on_fault: bool = False  # `gateway syphon`: exit 3 on a namespace fault (pod restart)


@dataclass(frozen=True, slots=True)
class ShutdownSettings:
    drain_delay: float = 5.0  # readiness 503 while still serving, so endpoints drop the pod
    shutdown_timeout: float = 20.0  # wait for in-flight requests (< terminationGracePeriod)


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Deadlines and caps for slow or greedy clients (enforced by gateway.web.hardening)."""

    header_timeout: float = 10.0  # a complete request head, from connect or its first byte
    body_timeout: float = 30.0  # the whole body, from the end of the head; else 408
    keepalive_timeout: float = (
        75.0  # idle keep-alive: above the ingress's upstream one (nginx: 60 s)
    )
    max_headers: int = 100  # request header count


@dataclass(frozen=True, slots=True)
class Settings:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    replica_id: str = field(default_factory=socket.gethostname)
    pairs: tuple[PairSettings, ...] = ()
    entities: tuple[EntitySettings, ...] = ()
    redis_url: Secret | None = None
    log_format: Literal["json", "text"] = "json"
    log_level: str = "INFO"
    ledger: str = "off"  # off | stdout | a directory
    ledger_compress: bool = False
    allow_open: bool = False
    auth_rules_file: str | None = None
    auth_rules: Secret | None = None
    public_hosts: tuple[str, ...] = ()
    auth_clock_skew: float = 300.0
    # Refuse tokens that expire further than this in the future (seconds; 0 = no limit): a
    # leaked long-lived token is then useless, and clients must re-sign at least this often.
    auth_max_token_lifetime: float = 0.0
    # The one Entra ID credential of the process, for namespaces given by name
    # (gateway.servicebus.identity): workload | managed | default.
    azure_credential: Literal["workload", "managed", "default"] = "default"
    azure_client_id: str | None = None  # a user-assigned identity's client id
    limits: LimitSettings = field(default_factory=LimitSettings)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    failover: FailoverSettings = field(default_factory=FailoverSettings)
    syphon: SyphonSettings = field(default_factory=SyphonSettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)
    http: HttpSettings = field(default_factory=HttpSettings)

    @property
    def embedded(self) -> bool:
        """No namespace configured: `gateway serve` starts the local broker pair itself."""
        return not self.pairs

    def pair(self, name: str) -> PairSettings:
        for p in self.pairs:
            if p.name == name:
                return p
        raise KeyError(name)


# --- parsing helpers --------------------------------------------------------------------


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in {"1", "true", "yes", "on"}:
        return True
    if s in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def _number(name: str, value: Any, kind: type, minimum: float, maximum: float) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        n = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if isinstance(n, float) and not math.isfinite(n):
        raise ConfigError(f"{name}: must be finite, got {value!r}")
    if not minimum <= n <= maximum:
        raise ConfigError(f"{name}: must be between {minimum:g} and {maximum:g}, got {n!r}")
    return n


def _int(minimum: int, maximum: int = 2**31 - 1) -> Callable[[str, Any], int]:
    return lambda name, v: int(_number(name, v, int, minimum, maximum))


def _float(minimum: float, maximum: float = 365 * 86400.0) -> Callable[[str, Any], float]:
    return lambda name, v: float(_number(name, v, float, minimum, maximum))


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected a non-empty string")
    return value


_SECTION_FIELDS: dict[str, tuple[type, dict[str, Callable[[str, Any], Any]]]] = {
    "limits": (
        LimitSettings,
        {
            "max_in_flight": _int(1, 100_000),
            "senders_per_entity": _int(1, 64),
            "admission_timeout": _float(0.0, 600.0),
            "max_pending_bytes": _int(1024),
            "max_message_bytes": _int(1024, 100 * 1024 * 1024),
            "max_batch_bytes": _int(1024, 100 * 1024 * 1024),
            "max_batch_messages": _int(1, 4500),
            "max_body_bytes": _int(1024, 200 * 1024 * 1024),
            "max_header_bytes": _int(1024, 1024 * 1024),
        },
    ),
    "timeouts": (
        TimeoutSettings,
        {
            "send_timeout": _float(0.01, 600.0),
            "connect_timeout": _float(0.01, 600.0),
            "retry_after": _float(0.0, 3600.0),
            "sdk_retry_total": _int(0, 10),
        },
    ),
    "failover": (
        FailoverSettings,
        {
            "enabled": _bool,
            "failover_interval": _float(0.0, 86400.0),
            "ping_primary_interval": _float(0.05, 86400.0),
            "backlog_queue_count": _int(1, 100),
            "strict_primary": _bool,
            "create_backlog_queues": _bool,
            "backlog_reprobe_interval": _float(0.05, 86400.0),
        },
    ),
    "syphon": (
        SyphonSettings,
        {
            "enabled": _bool,
            "workers": _int(1, 256),
            "max_batch": _int(1, 1000),
            "receive_wait": _float(0.05, 3600.0),
            "idle_check_interval": _float(0.05, 86400.0),
            "fault_unready_seconds": _float(0.0, 3600.0),
            "exit_on_fault": _bool,
        },
    ),
    "shutdown": (
        ShutdownSettings,
        {"drain_delay": _float(0.0, 600.0), "shutdown_timeout": _float(0.0, 3600.0)},
    ),
    "http": (
        HttpSettings,
        {
            "header_timeout": _float(0.05, 3600.0),
            "body_timeout": _float(0.05, 3600.0),
            "keepalive_timeout": _float(0.05, 3600.0),
            "max_headers": _int(8, 10_000),
        },
    ),
}

_LOG_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}

_TOP_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "listen_host": _str,
    "listen_port": _int(0, 65535),
    "replica_id": _str,
    "redis_url": lambda n, v: Secret(_str(n, v)),
    "log_format": lambda n, v: _choice(n, v, {"json", "text"}),
    "log_level": lambda n, v: _choice(n, str(v).upper(), _LOG_LEVELS),
    "ledger": _str,
    "ledger_compress": _bool,
    "allow_open": _bool,
    "auth_rules_file": _str,
    "auth_rules": lambda n, v: Secret(_str(n, v)),
    "public_hosts": lambda n, v: _str_list(n, v),
    "auth_clock_skew": _float(0.0, 3600.0),
    "auth_max_token_lifetime": _float(0.0, 10 * 365 * 86400.0),
    "azure_credential": lambda n, v: _choice(n, v, {"workload", "managed", "default"}),
    "azure_client_id": _str,
}

# Settings a flat environment variable may set: SBGATE_<FIELD> for top-level fields and
# SBGATE_<FIELD> for section fields too (their names are unique across sections).
_SECTION_OF_FIELD = {f: s for s, (_, fs) in _SECTION_FIELDS.items() for f in fs}
_ENV_ALIASES = {"ENABLE_SYPHON": ("syphon", "enabled"), "ENABLE_FAILOVER": ("failover", "enabled")}


# SBGATE_{PRIMARY,SECONDARY}_<FIELD>: the default pair's namespaces.
_NS_ENV = re.compile(
    r"^(PRIMARY|SECONDARY)_(CONNECTION_STRING|NAMESPACE|NAME|ADMIN_CONNECTION_STRING|ADMIN_CA_CERT)$"
)
_NS_ENV_FIELDS = {
    "CONNECTION_STRING": "connection_string",
    "NAMESPACE": "fully_qualified_namespace",
    "NAME": "name",
    "ADMIN_CONNECTION_STRING": "admin_connection_string",
    "ADMIN_CA_CERT": "admin_ca_cert",
}


def _choice(name: str, value: Any, allowed: set[str]) -> str:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {sorted(allowed)}, got {value!r}")
    return str(value)


def _str_list(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{name}: expected a list of strings")


def _namespace(
    where: str, raw: Mapping[str, Any], default_name: str | None = None
) -> NamespaceSettings:
    allowed = {
        "name",
        "connection_string",
        "fully_qualified_namespace",
        "admin_connection_string",
        "admin_ca_cert",
    }
    extra = set(raw) - allowed
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {sorted(extra)}")
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
    name = raw.get("name") or default_name or host.split(".")[0].split(":")[0]
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


def _entity(where: str, raw: Mapping[str, Any]) -> EntitySettings:
    path = _str(f"{where}.path", raw.get("path") or raw.get("name"))
    kind = _choice(f"{where}.kind", raw.get("kind", "queue"), {"queue", "topic"})
    pair = str(raw.get("pair", "default"))
    try:
        validate_entity_path(path)  # the one rule, as clients' requests are held to it
    except InvalidEntityPath as exc:
        raise ConfigError(f"{where}.path: {path!r} is not a valid entity path: {exc}") from None
    return EntitySettings(path=path, kind=kind, pair=pair)  # type: ignore[arg-type]


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


def load_settings(env: Mapping[str, str], config_file: str | Path | None = None) -> Settings:
    """Build the one `Settings` object from a TOML file and the environment.

    Raises `ConfigError` naming the bad setting. Pure: reads only `config_file` and `env`.
    """
    raw: dict[str, Any] = {}
    path = config_file or env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None

    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_FIELDS}
    pairs_raw: dict[str, dict[str, Any]] = {}
    entities_raw: list[dict[str, Any]] = []

    for key, value in raw.items():
        if key in _TOP_FIELDS:
            top[key] = value
        elif key in _SECTION_FIELDS:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            sections[key].update(value)
        elif key == "pairs":
            if not isinstance(value, dict):
                raise ConfigError("[pairs.<name>] must be tables")
            pairs_raw = {k: dict(v) for k, v in value.items()}
        elif key == "entities":
            if not isinstance(value, list):
                raise ConfigError("[[entities]] must be an array of tables")
            entities_raw = [dict(e) for e in value]
        else:
            raise ConfigError(f"config file: unknown setting {key!r}")

    # Environment overrides.
    for env_key, value in env.items():
        if not env_key.startswith(ENV_PREFIX):
            continue
        key = env_key[len(ENV_PREFIX) :]
        low = key.lower()
        if key == "CONFIG":
            continue
        if low in _TOP_FIELDS:
            top[low] = value
        elif key in _ENV_ALIASES:
            section, fname = _ENV_ALIASES[key]
            sections[section][fname] = value
        elif low in _SECTION_OF_FIELD:
            sections[_SECTION_OF_FIELD[low]][low] = value
        elif key == "ENTITIES":
            entities_raw = _entities_from_env(value)
        elif m := _NS_ENV.match(key):
            role, attr = m.group(1).lower(), _NS_ENV_FIELDS[m.group(2)]
            table = pairs_raw.setdefault("default", {}).setdefault(role, {})
            if isinstance(table, str):
                table = pairs_raw["default"][role] = {"connection_string": table}
            table[attr] = value
        else:
            raise ConfigError(f"{env_key}: unknown setting")

    kwargs: dict[str, Any] = {}
    for key, value in top.items():
        kwargs[key] = _TOP_FIELDS[key](key, value)
    for section, (cls, parsers) in _SECTION_FIELDS.items():
        values: dict[str, Any] = {}
        for fname, value in sections[section].items():
            if fname not in parsers:
                raise ConfigError(f"[{section}]: unknown setting {fname!r}")
            values[fname] = parsers[fname](f"{section}.{fname}", value)
        kwargs[section] = cls(**values)

    pairs: list[PairSettings] = []
    for pname, praw in pairs_raw.items():
        where = f"pairs.{pname}"
        if "primary" not in praw:
            raise ConfigError(f"{where}: a primary namespace is required")
        primary = _namespace(f"{where}.primary", _ns_table(praw["primary"]))
        secondary = (
            _namespace(f"{where}.secondary", _ns_table(praw["secondary"]))
            if praw.get("secondary")
            else None
        )
        extra = set(praw) - {"primary", "secondary"}
        if extra:
            raise ConfigError(f"{where}: unknown setting(s) {sorted(extra)}")
        pairs.append(PairSettings(name=pname, primary=primary, secondary=secondary))
    kwargs["pairs"] = tuple(pairs)

    entities = tuple(_entity(f"entities[{i}]", e) for i, e in enumerate(entities_raw))
    seen: set[str] = set()
    pair_names = {p.name for p in pairs}
    for e in entities:
        if e.path.lower() in seen:
            raise ConfigError(f"entities: {e.path!r} is declared twice")
        seen.add(e.path.lower())
        if pairs and e.pair not in pair_names:
            raise ConfigError(f"entities: {e.path!r} names unknown pair {e.pair!r}")
    kwargs["entities"] = entities

    settings = Settings(**kwargs)
    _cross_check(settings)
    return settings


def _ns_table(value: Any) -> Mapping[str, Any]:
    if isinstance(value, str):
        return {"connection_string": value}
    if isinstance(value, dict):
        return value
    raise ConfigError("a namespace must be a connection string or a table")


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
