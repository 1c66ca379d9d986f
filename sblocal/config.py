"""Broker configuration: frozen dataclasses, read once from TOML or JSON.

A config file looks like this (TOML; the JSON form has the same shape)::

    host = "127.0.0.1"
    control_port = 0            # 0 = a free port
    data_dir = "/var/tmp/sb"    # optional: durable mode (SQLite per namespace)
    amqp_tls = false            # true: AMQPS with the development certificate

    [[namespaces]]
    name = "primary"
    amqp_port = 0
    management_port = 0         # false/omitted-with-null disables the HTTPS management API
    keys = { RootManageSharedAccessKey = "<base64>" }   # {} = accept any token

    [[namespaces.queues]]
    path = "orders"
    lock_duration = "PT30S"     # ISO 8601 duration, seconds (number) or "max"
    max_delivery_count = 5

    [[namespaces.topics]]
    path = "events"
    subscriptions = [{ name = "audit" }]

Entity property names are those of `sblocal.entities` (snake_case).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sblocal.entities import (
    TIMESPAN_MAX,
    QueueProperties,
    SubscriptionProperties,
    TopicProperties,
)

# The fixed development key of the embedded default namespaces. It protects nothing: it is
# here so that the SAS verification path is exercised exactly as against Azure.
DEV_KEY_NAME = "RootManageSharedAccessKey"
DEV_KEY_VALUE = "c2Jsb2NhbC1kZXYta2V5LWZvci1sb2NhbC10ZXN0cy0wMDA="


class ConfigError(ValueError):
    """The configuration file is invalid (the message says where)."""


@dataclass(frozen=True, slots=True)
class QueueConfig:
    path: str
    properties: QueueProperties = field(default_factory=QueueProperties)


@dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    name: str
    properties: SubscriptionProperties = field(default_factory=SubscriptionProperties)


@dataclass(frozen=True, slots=True)
class TopicConfig:
    path: str
    properties: TopicProperties = field(default_factory=TopicProperties)
    subscriptions: tuple[SubscriptionConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class NamespaceConfig:
    name: str
    amqp_port: int = 0
    management_port: int | None = 0  # None: no management (HTTPS) server
    keys: tuple[tuple[str, str], ...] = ((DEV_KEY_NAME, DEV_KEY_VALUE),)  # () = accept any token
    queues: tuple[QueueConfig, ...] = ()
    topics: tuple[TopicConfig, ...] = ()

    @property
    def key_map(self) -> dict[str, str]:
        return dict(self.keys)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    namespaces: tuple[NamespaceConfig, ...]
    host: str = "127.0.0.1"
    control_port: int = 0
    data_dir: Path | None = None  # durable mode when set
    cert_dir: Path | None = None  # where the development TLS certificate goes (default: temp)
    # Serve AMQPS (the development certificate) instead of plain AMQP on every namespace's
    # AMQP port; the connection strings then leave out UseDevelopmentEmulator.
    amqp_tls: bool = False
    # How often the reactor expires locks/TTLs and activates scheduled messages.
    housekeeping_interval: float = 0.05

    def namespace(self, name: str) -> NamespaceConfig:
        for ns in self.namespaces:
            if ns.name == name:
                return ns
        raise KeyError(name)

    def with_overrides(
        self,
        *,
        host: str | None = None,
        data_dir: Path | None = None,
        amqp_tls: bool | None = None,
    ) -> BrokerConfig:
        changes: dict[str, Any] = {}
        if amqp_tls is not None:
            changes["amqp_tls"] = amqp_tls
        if host is not None:
            changes["host"] = host
        if data_dir is not None:
            changes["data_dir"] = data_dir
        return dataclasses.replace(self, **changes)


def default_config() -> BrokerConfig:
    """The embedded default: `primary` (queue orders, topic events/audit) and `secondary`."""
    return BrokerConfig(
        namespaces=(
            NamespaceConfig(
                name="primary",
                queues=(QueueConfig("orders"),),
                topics=(TopicConfig("events", subscriptions=(SubscriptionConfig("audit"),)),),
            ),
            NamespaceConfig(name="secondary"),
        )
    )


_ISO_DURATION = re.compile(
    r"^P(?:(?P<days>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:\.\d+)?)H)?(?:(?P<minutes>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$"
)


def parse_duration(value: Any, where: str) -> dt.timedelta:
    """Seconds (number), ISO 8601 (``PT1M``, ``P10675199DT2H48M5.4775807S``) or ``"max"``."""
    if isinstance(value, dt.timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        return dt.timedelta(seconds=value)
    if isinstance(value, str):
        if value.lower() == "max":
            return TIMESPAN_MAX
        m = _ISO_DURATION.match(value)
        if m and any(m.groupdict().values()):
            parts = {k: float(v) for k, v in m.groupdict().items() if v}
            delta = dt.timedelta(**parts)
            return min(delta, TIMESPAN_MAX)
    raise ConfigError(f"{where}: invalid duration {value!r} (seconds, ISO 8601 or 'max')")


_P = TypeVar("_P", QueueProperties, TopicProperties, SubscriptionProperties)


def parse_properties(cls: type[_P], raw: dict[str, Any], where: str) -> _P:
    """Build an entity-properties dataclass from a dict, converting and validating each field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields.get(key)
        if f is None:
            raise ConfigError(f"{where}: unknown property {key!r} (known: {', '.join(fields)})")
        default = getattr(cls(), key)
        if isinstance(default, dt.timedelta):
            kwargs[key] = parse_duration(value, f"{where}.{key}")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{key}: expected true/false, got {value!r}")
            kwargs[key] = value
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
            kwargs[key] = value
        else:
            kwargs[key] = str(value)
    return cls(**kwargs)


def _entity_path(raw: dict[str, Any], key: str, where: str) -> str:
    path = raw.get(key)
    if not isinstance(path, str) or not path or len(path) > 260 or any(c in path for c in "@?#*"):
        raise ConfigError(f"{where}: {key!r} must be an entity path (1-260 chars, no @?#*)")
    return path.strip("/")


def _namespace_from_dict(raw: dict[str, Any], where: str) -> NamespaceConfig:
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,49}", name):
        raise ConfigError(f"{where}: 'name' must be a namespace name (letters, digits, '-')")
    amqp_port = raw.get("amqp_port", 0)
    if not isinstance(amqp_port, int) or not 0 <= amqp_port < 65536:
        raise ConfigError(f"{where}.amqp_port: expected a port number")
    mgmt = raw.get("management_port", 0)
    if mgmt is False:
        mgmt = None
    if mgmt is not None and (not isinstance(mgmt, int) or not 0 <= mgmt < 65536):
        raise ConfigError(f"{where}.management_port: expected a port number or false")
    keys_raw = raw.get("keys", {DEV_KEY_NAME: DEV_KEY_VALUE})
    if not isinstance(keys_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in keys_raw.items()
    ):
        raise ConfigError(f"{where}.keys: expected a table of key name = key value")
    queues = []
    for i, q in enumerate(raw.get("queues", [])):
        qw = f"{where}.queues[{i}]"
        props = {k: v for k, v in q.items() if k != "path"}
        queues.append(
            QueueConfig(_entity_path(q, "path", qw), parse_properties(QueueProperties, props, qw))
        )
    topics = []
    for i, t in enumerate(raw.get("topics", [])):
        tw = f"{where}.topics[{i}]"
        subs = []
        for j, s in enumerate(t.get("subscriptions", [])):
            sw = f"{tw}.subscriptions[{j}]"
            sprops = {k: v for k, v in s.items() if k != "name"}
            subs.append(
                SubscriptionConfig(
                    _entity_path(s, "name", sw),
                    parse_properties(SubscriptionProperties, sprops, sw),
                )
            )
        tprops = {k: v for k, v in t.items() if k not in ("path", "subscriptions")}
        topics.append(
            TopicConfig(
                _entity_path(t, "path", tw),
                parse_properties(TopicProperties, tprops, tw),
                tuple(subs),
            )
        )
    unknown = set(raw) - {"name", "amqp_port", "management_port", "keys", "queues", "topics"}
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {sorted(unknown)}")
    return NamespaceConfig(
        name=name,
        amqp_port=amqp_port,
        management_port=mgmt,
        keys=tuple(sorted(keys_raw.items())),
        queues=tuple(queues),
        topics=tuple(topics),
    )


def config_from_dict(raw: dict[str, Any]) -> BrokerConfig:
    namespaces_raw = raw.get("namespaces")
    if not isinstance(namespaces_raw, list) or not namespaces_raw:
        raise ConfigError("'namespaces' must be a non-empty list")
    namespaces = tuple(
        _namespace_from_dict(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces_raw)
    )
    names = [ns.name for ns in namespaces]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate namespace names: {names}")
    unknown = set(raw) - {
        "namespaces",
        "host",
        "control_port",
        "data_dir",
        "cert_dir",
        "housekeeping_interval",
        "amqp_tls",
    }
    if unknown:
        raise ConfigError(f"unknown top-level setting(s) {sorted(unknown)}")
    control_port = raw.get("control_port", 0)
    if not isinstance(control_port, int) or not 0 <= control_port < 65536:
        raise ConfigError("control_port: expected a port number")
    interval = raw.get("housekeeping_interval", 0.05)
    if not isinstance(interval, int | float) or not 0.001 <= interval <= 10:
        raise ConfigError("housekeeping_interval: expected seconds between 0.001 and 10")
    amqp_tls = raw.get("amqp_tls", False)
    if not isinstance(amqp_tls, bool):
        raise ConfigError("amqp_tls: expected true or false")
    return BrokerConfig(
        namespaces=namespaces,
        amqp_tls=amqp_tls,
        host=str(raw.get("host", "127.0.0.1")),
        control_port=control_port,
        data_dir=Path(raw["data_dir"]) if raw.get("data_dir") else None,
        cert_dir=Path(raw["cert_dir"]) if raw.get("cert_dir") else None,
        housekeeping_interval=float(interval),
    )


def load_config(path: str | Path) -> BrokerConfig:
    """Read a TOML (``.toml``) or JSON (anything else) config file; raises ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from exc
    try:
        raw = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a table/object")
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
