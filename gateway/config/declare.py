"""Declaring a setting: `setting(...)` on a dataclass field of gateway.config.settings, and
what the loader and the docs read back from those declarations (`declared`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Final, cast

from gateway.config.values import Parser

ENV_PREFIX: Final = "SBGATE_"
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
    """A dataclass field that is a setting (see gateway.config)."""
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


def namespace_field(env: str, doc: str, shown_default: str | None = None, **kw: Any) -> Any:
    return field(metadata={_SETTING: NamespaceField(env, doc, shown_default)}, **kw)


# --- read back: what the loader reads, and the docs list ---------------------------------


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


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def declared(cls: type[Any], section_name: str | None) -> Iterator[SettingInfo]:
    """The settings declared on `cls` (the top level, or the table `section_name`)."""
    for f in fields(cls):
        spec = f.metadata.get(_SETTING)
        if isinstance(spec, Setting):
            env = (
                spec.env
                if spec.standard and spec.env
                else ENV_PREFIX + (spec.env or f.name.upper())
            )
            yield SettingInfo(section_name, f.name, env, spec, _default(f))


def sections_of(cls: type[Any]) -> dict[str, type[Any]]:
    """The TOML tables declared with `section` on `cls`: name → dataclass."""
    return {
        f.name: cast("type[Any]", f.default_factory)
        for f in fields(cls)
        if f.metadata.get(_SECTION)
    }


def namespace_fields_of(cls: type[Any]) -> dict[str, tuple[str, NamespaceField]]:
    """The namespace settings declared on `cls`: the variable's suffix → (field, declaration)."""
    return {f.metadata[_SETTING].env: (f.name, f.metadata[_SETTING]) for f in fields(cls)}
