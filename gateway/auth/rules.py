"""Authorization rules: named keys, the rights they grant, and the entities they apply to.

A rule mirrors a Service Bus shared access authorization rule: its name is the ``skn`` of the
tokens it signs, it holds a primary and an optional secondary key (either one verifies, so keys
rotate without downtime) and a set of rights, ``Manage`` implying ``Send`` and ``Listen``.
Unlike Service Bus, where a rule lives on one entity or the namespace, a gateway rule lists the
entity patterns it applies to:

* ``*`` — every entity, and the namespace itself (required for namespace-wide ``/admin``);
* ``orders`` — the entity ``orders`` and every path below it (``orders/$DeadLetterQueue``,
  ``orders/subscriptions/audit``), but not ``ordersX``;
* ``tenants/*`` — every path strictly below ``tenants``, not ``tenants`` itself.

Matching is on whole ``/``-separated segments, ASCII case-insensitive like Service Bus names.

Rules are loaded once at start-up (`load_rules`, `rules_from_json`); every
problem raises `AuthConfigError` naming the source and the field, never echoing a key.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from gateway.auth._paths import MAX_ENTITY_PATH, Segments, covers, fold, valid_segment
from gateway.auth.errors import AuthConfigError
from gateway.secret import Secret as Secret  # re-exported: rules hold keys

RULES_ENV_VAR = "SBGATE_AUTH_RULES"
MIN_KEY_LENGTH = 32
# Service Bus allows letters, digits, '.', '-', '_' in rule names. Restricting to these also
# keeps the SDK's double URL-encoding of `skn` (quote_plus twice) a no-op.
_KEY_NAME = re.compile(r"[A-Za-z0-9._-]{1,256}")
_RULE_FIELDS = frozenset(
    {"name", "primary_key", "secondary_key", "rights", "entities", "description"}
)

KeySlot = Literal["primary", "secondary"]


class Right(StrEnum):
    """A Service Bus claim. ``Manage`` implies the other two."""

    SEND = "Send"
    LISTEN = "Listen"
    MANAGE = "Manage"

    @classmethod
    def parse(cls, text: str) -> Right:
        """The right named *text* (case-insensitive); ValueError if there is none."""
        for right in cls:
            if right.value.lower() == text.lower():
                return right
        raise ValueError(text)


def effective_rights(rights: Iterable[Right]) -> frozenset[Right]:
    """*rights* with Service Bus' implication applied: ``Manage`` brings ``Send`` and ``Listen``."""
    granted = frozenset(rights)
    return frozenset(Right) if Right.MANAGE in granted else granted


def valid_key_name(name: str) -> bool:
    """True when *name* may name a rule (the ``skn`` of a token)."""
    return _KEY_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class EntityPattern:
    """One compiled entity pattern (see the module docstring for the syntax)."""

    text: str
    prefix: Segments
    strictly_below: bool

    @classmethod
    def parse(cls, text: str) -> EntityPattern:
        """Compile *text*; ValueError with a human reason when it is not a valid pattern."""
        if text == "*":
            return cls(text, (), strictly_below=False)
        body = text.strip("/")
        strictly_below = body.endswith("/*")
        if strictly_below:
            body = body[:-2]
        if not body:
            raise ValueError("is empty")
        if len(body) > MAX_ENTITY_PATH:
            raise ValueError(f"is longer than {MAX_ENTITY_PATH} characters")
        parts = body.split("/")
        for part in parts:
            if "*" in part:
                raise ValueError("may use '*' only alone or as a whole last segment ('a/*')")
            if not valid_segment(part):
                raise ValueError(
                    "segments must be non-empty, not '.' or '..', and use only "
                    "letters, digits, '.', '-', '_', '$'"
                )
        return cls(text, tuple(fold(part) for part in parts), strictly_below=strictly_below)

    def matches(self, entity: Segments | None) -> bool:
        """Whether this pattern applies to *entity* (None: the namespace as a whole)."""
        if not self.prefix:
            return True
        if entity is None or not covers(self.prefix, entity):
            return False
        return len(entity) > len(self.prefix) or not self.strictly_below


@dataclass(frozen=True)
class AuthRule:
    """A named key pair with its rights and the entity patterns it applies to.

    Construct directly with `Secret` keys, or through `parse_rules`. Raises `AuthConfigError`
    when a field is invalid (the message names the field, never the key).
    """

    name: str
    primary_key: Secret
    rights: frozenset[Right]
    entities: tuple[str, ...]
    secondary_key: Secret | None = None
    description: str = ""
    _patterns: tuple[EntityPattern, ...] = field(init=False, repr=False, compare=False)
    _rights: frozenset[Right] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not valid_key_name(self.name):
            raise AuthConfigError(
                f"name: {self.name!r} is not a valid rule name "
                "(1-256 letters, digits, '.', '-', '_')"
            )
        _check_key("primary_key", self.primary_key)
        if self.secondary_key is not None:
            _check_key("secondary_key", self.secondary_key)
        if not self.rights or not all(isinstance(r, Right) for r in self.rights):
            raise AuthConfigError("rights: must be a non-empty set of Send, Listen, Manage")
        if isinstance(self.entities, str) or not self.entities:
            raise AuthConfigError("entities: must be a non-empty list of entity patterns")
        patterns = []
        for index, text in enumerate(self.entities):
            if not isinstance(text, str):
                raise AuthConfigError(f"entities[{index}]: must be a string")
            try:
                patterns.append(EntityPattern.parse(text))
            except ValueError as exc:
                raise AuthConfigError(f"entities[{index}]: pattern {text!r} {exc}") from None
        object.__setattr__(self, "_patterns", tuple(patterns))
        object.__setattr__(self, "_rights", effective_rights(self.rights))

    @property
    def effective_rights(self) -> frozenset[Right]:
        """The rights granted, ``Manage`` expanded (computed once)."""
        return self._rights

    def grants(self, right: Right) -> bool:
        """Whether this rule holds *right* (directly or through ``Manage``)."""
        return right in self._rights

    def applies_to(self, entity: Segments | None) -> bool:
        """Whether one of the patterns matches *entity* (canonical segments; None: namespace)."""
        return any(pattern.matches(entity) for pattern in self._patterns)

    def keys(self) -> tuple[tuple[KeySlot, Secret], ...]:
        """The keys that verify tokens for this rule, primary first."""
        if self.secondary_key is None:
            return (("primary", self.primary_key),)
        return (("primary", self.primary_key), ("secondary", self.secondary_key))


def _check_key(field_name: str, key: object) -> None:
    if not isinstance(key, Secret) or not isinstance(key.get(), str):
        raise AuthConfigError(f"{field_name}: must be a string")
    value = key.get()
    if len(value) < MIN_KEY_LENGTH:
        raise AuthConfigError(
            f"{field_name}: must be at least {MIN_KEY_LENGTH} characters "
            "(Service Bus keys are 44-character base64 strings)"
        )
    if value != value.strip() or not value.isprintable():
        raise AuthConfigError(
            f"{field_name}: must not contain whitespace at either end or control characters"
        )


def parse_rules(document: object, *, source: str) -> tuple[AuthRule, ...]:
    """Validate a decoded rules document: ``{"rules": [rule, ...]}`` or a bare list of rules.

    Raises `AuthConfigError` (``"<source>: rules[i].<field>: <reason>"``) on the first problem,
    including an empty list and two rules with the same name.
    """
    if isinstance(document, Mapping):
        extra = sorted(set(document) - {"rules"})
        if extra:
            raise AuthConfigError(f"{source}: unknown top-level key(s) {', '.join(extra)}")
        if "rules" not in document:
            raise AuthConfigError(f"{source}: rules: missing (expected a list of rule tables)")
        entries = document["rules"]
    else:
        entries = document
    if not isinstance(entries, list):
        raise AuthConfigError(f"{source}: rules: must be a list of rule tables")
    if not entries:
        raise AuthConfigError(f"{source}: rules: must contain at least one rule")
    rules: list[AuthRule] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(entries):
        where = f"{source}: rules[{index}]"
        if not isinstance(entry, Mapping):
            raise AuthConfigError(
                f"{where}: must be a table/object with name, primary_key, rights, entities"
            )
        try:
            rule = _parse_rule(entry)
        except AuthConfigError as exc:
            raise AuthConfigError(f"{where}.{exc}") from None
        if rule.name in seen:
            raise AuthConfigError(
                f"{where}.name: duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])"
            )
        seen[rule.name] = index
        rules.append(rule)
    return tuple(rules)


def _parse_rule(entry: Mapping[str, Any]) -> AuthRule:
    # Messages raised here start with the field name; parse_rules prefixes the location.
    unknown = sorted(str(k) for k in set(entry) - _RULE_FIELDS)
    if unknown:
        raise AuthConfigError(
            f"{unknown[0]}: unknown field (expected {', '.join(sorted(_RULE_FIELDS))})"
        )
    for required in ("name", "primary_key", "rights", "entities"):
        if required not in entry:
            raise AuthConfigError(f"{required}: missing")
    name = entry["name"]
    if not isinstance(name, str):
        raise AuthConfigError("name: must be a string")
    primary = _secret_field(entry, "primary_key")
    secondary_value = entry.get("secondary_key")
    secondary = None if secondary_value is None else _secret_field(entry, "secondary_key")
    description = entry.get("description", "")
    if not isinstance(description, str):
        raise AuthConfigError("description: must be a string")
    return AuthRule(
        name=name,
        primary_key=primary,
        secondary_key=secondary,
        rights=_rights_field(entry["rights"]),
        entities=_entities_field(entry["entities"]),
        description=description,
    )


def _secret_field(entry: Mapping[str, Any], name: str) -> Secret:
    value = entry[name]
    if not isinstance(value, str):
        raise AuthConfigError(f"{name}: must be a string")
    return Secret(value)


def _rights_field(value: object) -> frozenset[Right]:
    if not isinstance(value, list) or not value:
        raise AuthConfigError("rights: must be a non-empty list of Send, Listen, Manage")
    rights = set()
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise AuthConfigError(f"rights[{index}]: must be a string")
        try:
            rights.add(Right.parse(item))
        except ValueError:
            raise AuthConfigError(
                f"rights[{index}]: unknown right {item!r} (expected Send, Listen or Manage)"
            ) from None
    return frozenset(rights)


def _entities_field(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise AuthConfigError("entities: must be a non-empty list of entity patterns")
    return tuple(value)


def rules_from_json(text: str, *, source: str = RULES_ENV_VAR) -> tuple[AuthRule, ...]:
    """Parse a JSON rules document (see `parse_rules`); `AuthConfigError` on any problem."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        # The exception's message holds only a position; `from None` keeps `exc.doc` (which
        # contains the keys) out of tracebacks.
        raise AuthConfigError(f"{source}: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    return parse_rules(document, source=source)


def load_rules(path: str | os.PathLike[str]) -> tuple[AuthRule, ...]:
    """Rules from a TOML or JSON file.

    ``.json`` files are JSON, ``.toml`` files TOML; any other name (a mounted Kubernetes
    Secret key, say) is JSON when its first non-blank character is ``{`` or ``[``, else TOML.
    Raises `AuthConfigError` when the file cannot be read or is invalid.
    """
    file = Path(path)
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthConfigError(f"{source}: cannot read rules file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"{source}: rules file is not valid UTF-8") from None
    suffix = file.suffix.lower()
    is_json = suffix == ".json" or (suffix != ".toml" and text.lstrip()[:1] in {"{", "["})
    if is_json:
        return rules_from_json(text, source=source)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AuthConfigError(f"{source}: invalid TOML: {exc}") from None
    return parse_rules(document, source=source)
