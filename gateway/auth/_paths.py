"""Entity paths as tuples of canonical segments, shared by resource and rule matching.

Service Bus entity names are case-insensitive, so segments are compared after folding ASCII
letters only: ``str.lower`` would also fold look-alikes such as the Kelvin sign into ``k``.
Anything that is not a plain entity path (empty segments, ``.``/``..``, characters outside
``[A-Za-z0-9._$-]``, more than 260 characters) yields ``None`` and therefore matches nothing.
"""

from __future__ import annotations

import functools
import re

MAX_ENTITY_PATH = 260
_SEGMENT = re.compile(r"[A-Za-z0-9._$-]+")
_ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

Segments = tuple[str, ...]


def fold(text: str) -> str:
    """Lower-case ASCII letters only."""
    return text.translate(_ASCII_FOLD)


def valid_segment(segment: str) -> bool:
    """True when *segment* can be one ``/``-separated part of an entity path."""
    return _SEGMENT.fullmatch(segment) is not None and segment not in {".", ".."}


@functools.lru_cache(maxsize=1024)
def entity_segments(path: str) -> Segments | None:
    """Canonical segments of an entity path (``"a/b"`` → ``("a", "b")``), or None if invalid.

    One leading and one trailing ``/`` are tolerated; the empty path is invalid (the namespace
    root is spelled ``None`` by callers, never ``""``). Every request names its entity, so
    the answers for the last 1,024 paths are kept (an immutable tuple or None).
    """
    if len(path) > MAX_ENTITY_PATH + 2:
        return None
    if path.startswith("/"):
        path = path[1:]
    if path.endswith("/"):
        path = path[:-1]
    if not path or len(path) > MAX_ENTITY_PATH:
        return None
    parts = path.split("/")
    if not all(valid_segment(part) for part in parts):
        return None
    return tuple(fold(part) for part in parts)


def covers(prefix: Segments, entity: Segments) -> bool:
    """Prefix match on whole segments: ``orders`` covers ``orders/x``, never ``ordersX``."""
    return entity[: len(prefix)] == prefix
