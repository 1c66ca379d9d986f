"""What every scenario does around its fault: drain the whole stack and check the result."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from gateway.core.backlog import PING_CONTENT_TYPE, is_backlog_path
from loadtests.drain import Source, drain
from loadtests.stack import PRIMARY, QUEUES, SECONDARY, SUBSCRIPTION, TOPIC
from sblocal.testing import BrokerProcess

log = logging.getLogger(__name__)


def primary_sources() -> list[Source]:
    out = []
    for dl in (False, True):
        out += [Source("primary", q, dead_letter=dl) for q in QUEUES]
        out.append(Source("primary", TOPIC, SUBSCRIPTION, dead_letter=dl))
    return out


async def backlog_sources(broker: BrokerProcess) -> list[Source]:
    """Every backlog queue that exists in the secondary (any index), and its DLQ."""
    entities = await broker.control.entities(SECONDARY)
    paths = sorted(
        e["path"]
        for e in entities
        if is_backlog_path(str(e.get("path", ""))) and e.get("kind") == "queue"
    )
    return [Source("backlog", p, dead_letter=dl) for p in paths for dl in (False, True)]


async def backlog_depth(broker: BrokerProcess) -> int:
    """Active messages waiting in the backlog queues (from the control API, no receive)."""
    total = 0
    for e in await broker.control.entities(SECONDARY):
        path = str(e.get("path", ""))
        if is_backlog_path(path) and e.get("kind") == "queue":
            total += int(e.get("active", 0)) + int(e.get("locked", 0))
    return total


async def drain_all(broker: BrokerProcess, work_dir: Path) -> list[dict[str, Any]]:
    """Receive-and-delete everything from the primary entities, every backlog queue and
    every dead-letter queue. Uses `gateway drain` (gateway/tools/drain.py) when this checkout
    has it, else our own small drain (loadtests/drain.py); the records have the same shape.
    Each record gets ``drained_at``: when the drain started (a lower bound)."""
    started = time.monotonic()
    drained_at = datetime.now(UTC).isoformat()
    backlog = await backlog_sources(broker)
    try:
        from gateway.tools.drain import drain as gateway_drain
    except ImportError:
        records = await drain(broker.connection_string(PRIMARY), primary_sources())
        if backlog:
            records += await drain(broker.connection_string(SECONDARY), backlog)
    else:
        records = []
        plans = [
            (PRIMARY, sorted({s.label for s in primary_sources() if not s.dead_letter})),
            (SECONDARY, sorted({s.label for s in backlog if not s.dead_letter})),
        ]
        for ns, paths in plans:
            if not paths:
                continue
            out = work_dir / f"drained-{ns}.jsonl"
            summary = await gateway_drain(
                broker.connection_string(ns),
                paths,
                out,
                include_dlq=True,
                idle_timeout=1.0,
                receive_mode="receive_and_delete",
                batch_size=250,
            )
            if summary.errors:
                raise RuntimeError(f"the drain of {ns} failed on {summary.errors}")
            records += [orjson.loads(line) for line in out.read_bytes().splitlines()]
    for r in records:
        r.setdefault("drained_at", drained_at)
    records = [r for r in records if r.get("content_type") != PING_CONTENT_TYPE]
    log.info("drained %d messages in %.1f s", len(records), time.monotonic() - started)
    return records
