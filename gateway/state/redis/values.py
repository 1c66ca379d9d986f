"""Values read from Redis and its channel, validated where they are read, and the events
written to the channel.

Values in Redis are input: anyone with write access (or an operator's typo) can put anything
under the prefix. `Invalid` (a ValueError) is raised for anything the gateway could not have
written; the Lua scripts (`gateway.state.redis.lua`) check the same grammar, so that a script
and every replica agree on what is valid.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import cast

import orjson

from gateway.state.base import SEVERITY, BacklogState, EntityState, Status

# Values in Redis are input: anyone with write access (or an operator's typo) can put
# anything under the prefix. A time is a decimal Unix time in [0, MAX_TIME] (no inf, nan or
# year 33658), an epoch decimal digits below 2^53 (Lua numbers are doubles). The Lua checks
# and the Python ones (`parse_time`, `parse_epoch`) accept exactly the same strings, so that
# a script and every replica agree on what is valid.
MAX_TIME = 4_102_444_800.0  # 2100-01-01
MAX_EPOCH = 2**53
MAX_TEXT = 1024  # `by`, `reason`, names: longer is not ours
# The Lua patterns of `valid_time` (`^%d+$`, `^%d+%.%d*$`, `^%d+[eE][-+]?%d+$`,
# `^%d+%.%d*[eE][-+]?%d+$`) as one regex, with the same 45-character cap: Lua patterns have
# no counted repetition, so no part is bounded but the whole (tests/gateway/test_state_grammar.py
# feeds the same generated strings to both against a real redis-server).
TIME_TEXT = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?")
EPOCH_TEXT = re.compile(r"[0-9]{1,16}")


class Invalid(ValueError):
    """A value read from Redis or the channel that is not one we could have written."""


def parse_time(value: object) -> float:
    """A Unix time as stored or published: a number or the decimal text `TIME_TEXT`, in
    [0, `MAX_TIME`] (never inf or nan)."""
    if isinstance(value, str):
        if len(value) > 45 or TIME_TEXT.fullmatch(value) is None:
            raise Invalid(f"time {value[:50]!r} is not a decimal number")
        number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise Invalid("time out of range") from None
    else:
        raise Invalid(f"time of type {type(value).__name__}")
    if not 0.0 <= number <= MAX_TIME:  # also False for nan
        raise Invalid(f"time {value!r} is not a Unix time in [0, {MAX_TIME:.0f}]")
    return number


def parse_epoch(value: object) -> int:
    if isinstance(value, str) and EPOCH_TEXT.fullmatch(value):
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise Invalid(f"epoch {str(value)[:50]!r} is not decimal digits")
    if not 0 <= number < MAX_EPOCH:
        raise Invalid(f"epoch {number} out of range")
    return number


def parse_text(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or (not empty and not value):
        raise Invalid(f"{what} is not a string of 0-{MAX_TEXT} characters")
    return value


def parse_status(value: object) -> Status:
    if not isinstance(value, str) or value not in SEVERITY:
        raise Invalid(f"unknown status {str(value)[:50]!r}")
    return cast(Status, value)


def entity_from_hash(entity: str, h: Mapping[str, str]) -> EntityState:
    if "epoch" not in h or "status" not in h:
        raise Invalid("no epoch or no status")
    return EntityState(
        entity=entity,
        status=parse_status(h["status"]),
        epoch=parse_epoch(h["epoch"]),
        since=parse_time(h.get("since", "0")),
        by=parse_text(h.get("by", ""), "by"),
        reason=parse_text(h.get("reason", ""), "reason"),
    )


def backlog_from_hash(queue: str, h: Mapping[str, str]) -> BacklogState:
    if "until" not in h:
        raise Invalid("no until")
    return BacklogState(
        queue,
        parse_time(h["until"]),
        parse_text(h.get("by", ""), "by"),
        parse_text(h.get("reason", ""), "reason"),
    )


def event_state(ev: object) -> EntityState | BacklogState | tuple[str | None, str]:
    """A pub/sub event, validated: an entity state, a backlog state, or a backlog write
    announcement (queue, by). Raises `Invalid` (a ValueError) for anything else."""
    if not isinstance(ev, dict):
        raise Invalid("not a JSON object")
    kind = ev.get("kind")
    try:
        if kind == "entity":
            return EntityState(
                entity=parse_text(ev["entity"], "entity", empty=False),
                status=parse_status(ev["status"]),
                epoch=parse_epoch(ev["epoch"]),
                since=parse_time(ev["since"]),
                by=parse_text(ev["by"], "by"),
                reason=parse_text(ev["reason"], "reason"),
            )
        if kind == "backlog":
            return BacklogState(
                queue=parse_text(ev["queue"], "queue", empty=False),
                until=parse_time(ev["until"]),
                by=parse_text(ev["by"], "by"),
                reason=parse_text(ev["reason"], "reason"),
            )
        if kind == "written":
            queue = ev["queue"]
            return (None if queue is None else parse_text(queue, "queue", empty=False)), parse_text(
                ev["by"], "by"
            )
    except KeyError as exc:
        raise Invalid(f"no {exc}") from None
    raise Invalid(f"unknown kind {str(kind)[:50]!r}")


def entity_event(s: EntityState) -> bytes:
    return orjson.dumps(
        {
            "kind": "entity",
            "entity": s.entity,
            "status": s.status,
            "epoch": s.epoch,
            "since": s.since,
            "by": s.by,
            "reason": s.reason,
        }
    )


def backlog_event(b: BacklogState) -> bytes:
    return orjson.dumps(
        {"kind": "backlog", "queue": b.queue, "until": b.until, "by": b.by, "reason": b.reason}
    )


def written_event(queue: str | None, by: str) -> bytes:
    return orjson.dumps({"kind": "written", "queue": queue, "by": by})
