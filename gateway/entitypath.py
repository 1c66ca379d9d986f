"""The entity-path grammar: what a valid Service Bus entity path is, and which ones clients
may address.

A leaf module (it imports only `gateway.errors`), because two layers hold to it:
configuration (`gateway.config`) refuses a declared path with `validate_entity_path` at load
time, and the engine's catalog (`gateway.core.entities`) and the edge check a requested one.
The OpenAPI document derives its pattern from `ENTITY_PATH_PATTERN`.
"""

from __future__ import annotations

import re
from typing import Final

from gateway.errors import InvalidEntityPath

# Backlog queues live at <primary-namespace>/x-servicebus-transfer/<index> in the secondary
# (`gateway.core.backlog` builds and recognises them); clients may never address one.
BACKLOG_SEGMENT: Final = "x-servicebus-transfer"
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
