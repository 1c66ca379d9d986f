"""The declared entities: the catalog the edge and the engine look paths up in.

The path grammar itself (`validate_entity_path`, `ENTITY_PATH_PATTERN`) is the leaf module
`gateway.entitypath`, so that configuration can hold to it without importing the engine; it
is re-exported here for the engine's users.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.entitypath import ENTITY_PATH_PATTERN, MAX_PATH, validate_entity_path
from gateway.errors import UnknownEntity

if TYPE_CHECKING:
    # Types only: the catalog is built from the settings.
    from gateway.config import EntityKind, EntitySettings


@dataclass(frozen=True, slots=True)
class EntityRef:
    """A declared entity: its path, kind and namespace pair."""

    path: str
    kind: EntityKind
    pair: str
    session_order: str | None = None  # its own `session_order`, if it has one


class EntityCatalog:
    """The entities declared in configuration. Lookups are case-insensitive, like Service Bus.

    Every declared path is checked with `validate_entity_path` here, once: a path found in
    the catalog needs no further validation on the hot path."""

    def __init__(self, entities: Iterable[EntitySettings]) -> None:
        self._by_key = {
            validate_entity_path(e.path).lower(): EntityRef(
                path=e.path, kind=e.kind, pair=e.pair, session_order=e.session_order
            )
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


__all__ = ["ENTITY_PATH_PATTERN", "MAX_PATH", "EntityCatalog", "EntityRef", "validate_entity_path"]
