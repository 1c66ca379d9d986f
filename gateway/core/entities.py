"""Entity paths: what a valid Service Bus entity path is, and which ones clients may use.

This module is the one definition of the rule: configuration (`gateway.config`) refuses a
declared path with `validate_entity_path`, and the OpenAPI document derives its pattern from
`ENTITY_PATH_PATTERN`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.core.backlog import BACKLOG_SEGMENT
from gateway.errors import InvalidEntityPath, UnknownEntity

if TYPE_CHECKING:
    # Types only: gateway.config validates entity paths with this module at load time.
    from gateway.config import EntityKind, EntitySettings

MAX_PATH = 260
# Letters, digits, '.', '-', '_' in '/'-separated segments (Service Bus entity naming rules;
# '@ ? # *' and everything non-ASCII — including Unicode look-alikes — are refused). A
# segment starts with a letter or a digit, so '.' and '..' never match.
SEGMENT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._\-]*"
# A whole path, anchored, for JSON Schema (the OpenAPI document). The full rule, with the
# length limit, sub-queues and backlog queues, is `validate_entity_path`.
ENTITY_PATH_PATTERN = rf"^{SEGMENT_PATTERN}(/{SEGMENT_PATTERN})*$"
_SEGMENT = re.compile(SEGMENT_PATTERN + r"\Z")


def validate_entity_path(path: str) -> str:
    """Return `path` if clients may address it, else raise `InvalidEntityPath` (400).

    Refused: empty or over 260 characters, characters outside the Service Bus set, empty,
    ``.`` or ``..`` segments, sub-queues (``$DeadLetterQueue`` and any ``$`` segment) and
    backlog queues (``*/x-servicebus-transfer/*``).
    """
    if not path:
        raise InvalidEntityPath("the entity path is empty")
    if len(path) > MAX_PATH:
        raise InvalidEntityPath(
            f"the entity path is {len(path)} characters long; the limit is {MAX_PATH}"
        )
    segments = path.split("/")
    for seg in segments:
        if seg in {"", ".", ".."}:
            raise InvalidEntityPath("the entity path has an empty, '.' or '..' segment")
        if seg.startswith("$"):
            raise InvalidEntityPath(
                f"sub-queues such as {seg!r} cannot be sent to", entity=_printable(path)
            )
        if not _SEGMENT.match(seg):
            raise InvalidEntityPath(
                "entity paths may contain only letters, digits, '.', '-', '_' and '/'",
                entity=_printable(path),
            )
    if any(s.lower() == BACKLOG_SEGMENT for s in segments):
        raise InvalidEntityPath("backlog queues are internal to the gateway", entity=path)
    return path


def _printable(s: str) -> str:
    return s.encode("ascii", "backslashreplace").decode("ascii")[:300]


@dataclass(frozen=True, slots=True)
class EntityRef:
    """A declared entity: its path, kind and namespace pair."""

    path: str
    kind: EntityKind
    pair: str


class EntityCatalog:
    """The entities declared in configuration. Lookups are case-insensitive, like Service Bus.

    Every declared path is checked with `validate_entity_path` here, once: a path found in
    the catalog needs no further validation on the hot path."""

    def __init__(self, entities: Iterable[EntitySettings]) -> None:
        self._by_key = {
            validate_entity_path(e.path).lower(): EntityRef(path=e.path, kind=e.kind, pair=e.pair)
            for e in entities
        }

    def __iter__(self) -> Iterable[EntityRef]:  # type: ignore[override]
        return iter(self._by_key.values())

    def all(self) -> list[EntityRef]:
        return list(self._by_key.values())

    def resolve(self, path: str, kind: EntityKind | None = None) -> EntityRef:
        """Validate `path` and find it among the declared entities (of `kind`, if given).

        Raises `InvalidEntityPath` (400) or `UnknownEntity` (404, naming the entity).
        """
        ref = self.find(path, kind)
        if ref is None:
            validate_entity_path(path)
            raise self.unknown(path, kind)
        return ref

    def find(self, path: str, kind: EntityKind | None = None) -> EntityRef | None:
        """The declared entity at `path` (of `kind`, if given), or None. No validation is
        needed for a hit (see the class docstring); a miss may still be an invalid path.
        Non-ASCII never hits: `str.lower` folds look-alikes such as KELVIN SIGN into ASCII."""
        ref = self._by_key.get(path.lower()) if path.isascii() else None
        if ref is None or (kind is not None and ref.kind != kind):
            return None
        return ref

    @staticmethod
    def unknown(path: str, kind: EntityKind | None = None) -> UnknownEntity:
        """The 404 for a valid path that is not declared (of `kind`)."""
        what = kind or "queue or topic"
        return UnknownEntity(f"no {what} named {path!r} is configured", entity=path)
