"""Loading: built-in defaults → the TOML file (``SBGATE_CONFIG`` or ``--config``) → the
environment variables, into one frozen `Settings`, or a `ConfigError` that names the setting
(and the variable the user set). The loader's tables are derived from the declarations in
gateway.config.settings."""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, cast, get_args

from gateway.config.declare import (
    ENV_PREFIX,
    SettingInfo,
    declared,
    namespace_fields_of,
    sections_of,
)
from gateway.config.settings import (
    EntityKind,
    EntitySettings,
    NamespaceSettings,
    PairSettings,
    SessionOrder,
    Settings,
)
from gateway.config.values import ConfigError, choice, sdk_connection_string, text
from gateway.entitypath import validate_entity_path
from gateway.errors import InvalidEntityPath
from gateway.secret import Secret

# --- derived from the declarations -------------------------------------------------------

SECTIONS: Final[Mapping[str, type[Any]]] = sections_of(Settings)
# Every declared setting, top level first, then each table's in order.
DECLARED: Final[tuple[SettingInfo, ...]] = (
    *declared(Settings, None),
    *(info for name, cls in SECTIONS.items() for info in declared(cls, name)),
)
# SBGATE_{PRIMARY,SECONDARY}_<env>: the default pair's namespaces.
NAMESPACE_ROLES: Final = ("PRIMARY", "SECONDARY")
NAMESPACE_FIELDS: Final = namespace_fields_of(NamespaceSettings)
CONFIG_FILE_ENV: Final = f"{ENV_PREFIX}CONFIG"  # the TOML file (or --config)
ENTITIES_ENV: Final = f"{ENV_PREFIX}ENTITIES"  # queue:orders,topic:events@pair; TOML [[entities]]

_TOP: Final = {i.name: i for i in DECLARED if i.section is None}
_BY_SECTION: Final = {s: {i.name: i for i in DECLARED if i.section == s} for s in SECTIONS}
_BY_ENV: Final = {i.env: i for i in DECLARED}
_STANDARD_ENV: Final = {i.env: i for i in DECLARED if i.spec.standard}
# Sections read only from standard variables: not a table of the TOML file.
_ENV_ONLY: Final = {i.section for i in _STANDARD_ENV.values()}
if len(_BY_ENV) != len(DECLARED):  # two sections' fields of one name need their own `env`
    raise AssertionError("two settings share an environment variable")


def env_names() -> set[str]:
    """Every variable `load_settings` accepts: SBGATE_*, and the standard OTEL_* ones."""
    namespaces = {f"{ENV_PREFIX}{r}_{s}" for r in NAMESPACE_ROLES for s in NAMESPACE_FIELDS}
    return {CONFIG_FILE_ENV, ENTITIES_ENV, *_BY_ENV, *namespaces}


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
        cs = text(f"{where}.connection_string", cs)
        try:
            host = sdk_connection_string(cs).fully_qualified_namespace
        except ValueError as exc:
            raise ConfigError(f"{where}.connection_string: {exc}") from None
    else:
        host = text(f"{where}.fully_qualified_namespace", fqns)
    name = raw.get("name") or host.split(".")[0].split(":")[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9\-]*", name):
        raise ConfigError(f"{where}.name: {name!r} is not a valid namespace name")
    admin = raw.get("admin_connection_string")
    return NamespaceSettings(
        name=name,
        connection_string=Secret(cs) if cs else None,
        fully_qualified_namespace=fqns or None,
        admin_connection_string=Secret(text(f"{where}.admin_connection_string", admin))
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
    path = text(f"{where}.path", raw.get("path") or raw.get("name"))
    kind = choice(f"{where}.kind", raw.get("kind", "queue"), get_args(EntityKind))
    pair = str(raw.get("pair", "default"))
    try:
        validate_entity_path(path)  # the one rule, as clients' requests are held to it
    except InvalidEntityPath as exc:
        raise ConfigError(f"{where}.path: {path!r} is not a valid entity path: {exc}") from None
    order = raw.get("session_order")
    if order is not None:
        order = choice(f"{where}.session_order", order, get_args(SessionOrder))
    return EntitySettings(
        path=path,
        kind=kind,  # type: ignore[arg-type]
        pair=pair,
        session_order=order,  # type: ignore[arg-type]
    )


def _cross_check(s: Settings) -> None:
    lim = s.limits
    if lim.max_message_bytes > lim.max_batch_bytes:
        raise ConfigError("limits.max_message_bytes must not exceed limits.max_batch_bytes")
    if lim.max_batch_bytes > lim.max_pending_bytes:
        raise ConfigError("limits.max_batch_bytes must not exceed limits.max_pending_bytes")
    if s.probe_port and s.probe_port == s.listen_port:
        raise ConfigError("probe_port must differ from listen_port")
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
