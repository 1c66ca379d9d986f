"""What every scenario does around its fault: drain the whole stack and check the result."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from gateway.audit.drain import drain
from gateway.core.backlog import is_backlog_path
from loadtests.stack import PRIMARY, QUEUES, SECONDARY, SUBSCRIPTION, TOPIC
from sblocal.testing import BrokerProcess

log = logging.getLogger(__name__)


def primary_paths() -> list[str]:
    """The primary entities a run sends to (a subscription for the topic)."""
    return [*QUEUES, f"{TOPIC}/Subscriptions/{SUBSCRIPTION}"]


async def backlog_paths(broker: BrokerProcess) -> list[str]:
    """Every backlog queue that exists in the secondary (any index)."""
    entities = await broker.control.entities(SECONDARY)
    return sorted(
        str(e["path"])
        for e in entities
        if is_backlog_path(str(e.get("path", ""))) and e.get("kind") == "queue"
    )


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
    every dead-letter queue, with `gateway drain` (gateway/audit/drain.py). Each record
    gets ``drained_at``: when the drain started (a lower bound)."""
    started = time.monotonic()
    drained_at = datetime.now(UTC).isoformat()
    records: list[dict[str, Any]] = []
    plans = [(PRIMARY, primary_paths()), (SECONDARY, await backlog_paths(broker))]
    for ns, paths in plans:
        if not paths:
            continue
        out = work_dir / f"drained-{ns}.jsonl"
        summary = await drain(
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
    log.info("drained %d messages in %.1f s", len(records), time.monotonic() - started)
    return records
