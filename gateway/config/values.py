"""Value parsers: a raw TOML or environment value → a setting's value, or a `ConfigError`
that starts with the setting's name. Each also says what it accepts, for the docs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.secret import Secret


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it."""


class Parser(Protocol):
    """Checks and converts one raw value (a TOML value, or an environment variable's text);
    raises `ConfigError` starting with `name`. `accepts` says what it takes, for the docs."""

    def __call__(self, name: str, value: Any, /) -> Any: ...

    def accepts(self) -> str: ...


def sdk_connection_string(value: str) -> Any:
    """azure-servicebus's `parse_connection_string` (ValueError with the SDK's message): what
    the SDK refuses is refused at start-up, in its words."""
    from azure.servicebus import parse_connection_string

    return parse_connection_string(value)


def plain(n: float) -> str:
    """A number as the docs show it: 600, 0.05, 2147483647."""
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


def text(name: str, value: Any) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected a non-empty string")
    return value


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """One of `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}: must be one of {sorted(allowed)}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Bool:
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


@dataclass(frozen=True, slots=True)
class Number:
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
        return f"{what}, {plain(self.minimum)} to {plain(self.maximum)}"


def int_between(minimum: int, maximum: int = 2**31 - 1) -> Number:
    return Number(int, minimum, maximum)


def float_between(minimum: float, maximum: float = 365 * 86400.0) -> Number:
    return Number(float, minimum, maximum)


@dataclass(frozen=True, slots=True)
class Text:
    secret: bool = False  # held as a `Secret`: never shown in logs or errors

    def __call__(self, name: str, value: Any) -> str | Secret:
        s = text(name, value)
        return Secret(s) if self.secret else s

    def accepts(self) -> str:
        return "a secret string" if self.secret else "a string"


@dataclass(frozen=True, slots=True)
class Choice:
    allowed: tuple[str, ...]
    upper: bool = False  # compared in capitals (log levels)

    def __call__(self, name: str, value: Any) -> str:
        return choice(name, str(value).upper() if self.upper else value, self.allowed)

    def accepts(self) -> str:
        return ", ".join(f"`{a}`" for a in self.allowed)


@dataclass(frozen=True, slots=True)
class StrList:
    def __call__(self, name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name}: expected a list of strings")

    def accepts(self) -> str:
        return "comma-separated (TOML: a list of strings)"
