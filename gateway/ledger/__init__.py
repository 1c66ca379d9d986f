"""The gateway's event log (ledger v2): one JSON line per message event, written off the hot path.

Use ``create_ledger(LedgerSettings(...), replica=...)`` and own it with ``async with``; call
``ledger.emit("accepted", message_id=..., entity=..., route="primary", size=..., latency_ms=...,
session_id=...)`` from handlers. The contract is in ``gateway.ledger.events`` and
``docs/pipeline.md``.
"""

from gateway.ledger.events import LEDGER_EVENTS, LEDGER_VERSION, LedgerEvent, Route
from gateway.ledger.settings import LedgerSettings, LedgerSinkKind, create_ledger
from gateway.ledger.sinks import DirectorySink, EncodedLine, LedgerSink, StreamSink
from gateway.ledger.writer import EventLedger, Ledger, NullLedger

__all__ = [
    "LEDGER_EVENTS",
    "LEDGER_VERSION",
    "DirectorySink",
    "EncodedLine",
    "EventLedger",
    "Ledger",
    "LedgerEvent",
    "LedgerSettings",
    "LedgerSink",
    "LedgerSinkKind",
    "NullLedger",
    "Route",
    "StreamSink",
    "create_ledger",
]
