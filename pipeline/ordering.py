"""Per-session order, the rule in plain Python (no Spark): what counts as an inversion.

For an entity whose sessions must keep their order (``--strict-sessions``), a sender that
waits for each acknowledgement before its next request expects a session receiver to get the
session's messages in the order the gateway acknowledged them. The audit compares, per
(entity, session, destination), two orders of the same messages:

* the **acknowledgement order**: the ledger's ``seq`` of the message's first ``accepted``
  event (a replica's events in the order it acknowledged them; its time in microseconds, so
  it compares across replicas as a time; a version 1 line has no ``seq`` and its ``ts`` in
  microseconds stands in);
* the **stored order**: the Service Bus sequence number of the message's first copy at that
  destination (a queue, or each subscription of a topic) — a duplicate, the same MessageId
  stored twice, counts by its first copy and is never an inversion by itself.

Walking the messages in acknowledgement order, an **inversion** is a message stored before
the message acknowledged just before it: the consumer receives it first. Only messages found
at the destination are compared (a message still in a backlog queue, lost, or dead-lettered is
reported elsewhere); two messages with the same acknowledgement key are not ordered, so never
an inversion. Counting adjacent pairs, one message that overtook (or fell behind) a whole run
is one inversion, not one per message it passed.

``pipeline.sessions`` computes the same with Spark window functions; the tests hold the two
equal on generated data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True, slots=True)
class Inversion:
    """Two messages of one session, acknowledged in one order and stored in the other."""

    earlier: str  # the message acknowledged first
    later: str  # the next one acknowledged, stored before it
    earlier_ack: int
    later_ack: int
    earlier_position: int
    later_position: int


def first_ack(acks: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Each message's acknowledgement key: that of its first acceptance (a retried request
    may be accepted twice)."""
    out: dict[str, int] = {}
    for message_id, key in acks:
        if message_id not in out or key < out[message_id]:
            out[message_id] = key
    return out


def first_stored(copies: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Each message's stored position at one destination: its first copy's sequence number."""
    return first_ack(copies)  # the same rule: the smallest value per message


def inversions(acked: Mapping[str, int], stored: Mapping[str, int]) -> list[Inversion]:
    """The inversions of one session at one destination, in acknowledgement order.

    ``acked``: message id → acknowledgement key; ``stored``: message id → position. Messages
    missing from either are left out. Ties in acknowledgement key are ordered by message id
    (deterministic) and never counted.
    """
    both = sorted((acked[m], m, stored[m]) for m in acked if m in stored)
    found: list[Inversion] = []
    for (a_key, a_id, a_pos), (b_key, b_id, b_pos) in pairwise(both):
        if a_key < b_key and b_pos < a_pos:
            found.append(Inversion(a_id, b_id, a_key, b_key, a_pos, b_pos))
    return found
