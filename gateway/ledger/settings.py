"""Ledger settings (read once at start-up by ``gateway.config``) and the factory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gateway.ledger.sinks import DirectorySink, LedgerSink, StreamSink
from gateway.ledger.writer import EventLedger, Ledger, NullLedger

LedgerSinkKind = Literal["off", "stdout", "dir"]


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """Where and how the gateway writes its event log. Off by default.

    ``sink="dir"`` needs ``directory``; files are ``<directory>/dt=YYYY-MM-DD/hour=HH/
    <replica>.jsonl`` (``.jsonl.gz`` with ``compress``). ``capacity`` bounds the events
    buffered in memory (beyond it they are dropped and counted), ``batch_size`` wakes the
    writer early, ``flush_interval`` is the longest an event waits in the buffer, and
    ``close_timeout`` bounds the final flush at shutdown.
    """

    sink: LedgerSinkKind = "off"
    directory: Path | None = None
    compress: bool = False
    capacity: int = 65_536
    batch_size: int = 4096
    flush_interval: float = 0.25
    close_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.sink not in ("off", "stdout", "dir"):
            raise ValueError(f"ledger sink must be off, stdout or dir, not {self.sink!r}")
        if self.sink == "dir" and self.directory is None:
            raise ValueError("ledger sink 'dir' needs a directory")
        if self.capacity < 1 or self.batch_size < 1:
            raise ValueError("ledger capacity and batch_size must be >= 1")
        if self.flush_interval <= 0 or self.close_timeout <= 0:
            raise ValueError("ledger flush_interval and close_timeout must be > 0")


def create_ledger(settings: LedgerSettings, *, replica: str) -> EventLedger:
    """The ledger these settings describe; ``NullLedger`` when off. Not started yet."""
    sink: LedgerSink
    if settings.sink == "off":
        return NullLedger()
    if settings.sink == "stdout":
        sink = StreamSink()
    else:
        assert settings.directory is not None
        sink = DirectorySink(settings.directory, replica, compress=settings.compress)
    return Ledger(
        sink,
        replica=replica,
        capacity=settings.capacity,
        batch_size=settings.batch_size,
        flush_interval=settings.flush_interval,
        close_timeout=settings.close_timeout,
    )
