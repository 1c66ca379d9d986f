"""The ledger writer against real files: partitioning, gzip, ids, drops, failures, shutdown."""

from __future__ import annotations

import asyncio
import datetime as dt
import gzip
import io
import re
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from gateway.ledger import (
    LEDGER_EVENTS,
    LEDGER_VERSION,
    DirectorySink,
    EncodedLine,
    EventLedger,
    Ledger,
    LedgerSettings,
    NullLedger,
    StreamSink,
    create_ledger,
)
from tests.support.waiting import no_hang

TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
CONTRACT_KEYS = [
    "v",
    "event_id",
    "ts",
    "replica",
    "message_id",
    "entity",
    "event",
    "route",
    "backlog",
    "size",
    "latency_ms",
    "session_id",
    "seq",
]
# 2025-03-04T05:59:59.5Z and one second later: two different hours.
T0 = 1741067999.5


class StepClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def read_lines(path: Path) -> list[dict[str, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return [orjson.loads(line) for line in f.read().splitlines()]


def all_records(root: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for path in sorted(root.rglob("*.jsonl*")):
        out.extend(read_lines(path))
    return out


class FlakySink:
    """A sink that fails while ``failing`` is set, like a full disk, and records the rest."""

    def __init__(self) -> None:
        self.failing = True
        self.lines: list[bytes] = []
        self.closed = False

    def write(self, lines: Sequence[EncodedLine]) -> None:
        if self.failing:
            raise OSError(28, "No space left on device")
        self.lines.extend(line for _, line in lines)

    def close(self) -> None:
        self.closed = True


class BlockingSink:
    """A sink whose write hangs until released (a stuck NFS mount)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, lines: Sequence[EncodedLine]) -> None:
        self.entered.set()
        self.release.wait(10)

    def close(self) -> None:
        pass


async def test_directory_sink_partitions_by_event_hour(tmp_path: Path) -> None:
    clock = StepClock(T0)
    ledger = Ledger(DirectorySink(tmp_path, "gw-0"), replica="gw-0", clock=clock)
    async with ledger:
        ledger.emit(
            "accepted",
            message_id="m1",
            entity="orders",
            route="primary",
            size=10,
            latency_ms=1.5,
        )
        clock.now = T0 + 1
        ledger.emit("accepted", message_id="m2", entity="orders", route="backlog", backlog="b/0")
        ledger.emit("failover_start", entity="orders")
    assert ledger.written == 3 and ledger.dropped == 0

    first = tmp_path / "dt=2025-03-04" / "hour=05" / "gw-0.jsonl"
    second = tmp_path / "dt=2025-03-04" / "hour=06" / "gw-0.jsonl"
    assert sorted(tmp_path.rglob("*.jsonl")) == [first, second]
    [rec1] = read_lines(first)
    assert list(rec1) == CONTRACT_KEYS
    assert rec1["ts"] == "2025-03-04T05:59:59.500000Z"
    assert rec1["v"] == LEDGER_VERSION == 2
    assert rec1["replica"] == "gw-0" and rec1["event"] == "accepted"
    assert (rec1["size"], rec1["latency_ms"], rec1["backlog"]) == (10, 1.5, None)
    rec2, rec3 = read_lines(second)
    assert rec2["ts"] == "2025-03-04T06:00:00.500000Z"
    assert (rec2["route"], rec2["backlog"]) == ("backlog", "b/0")
    assert rec3["event"] == "failover_start" and rec3["message_id"] is None


async def test_session_id_and_seq_order_a_replicas_acknowledgements() -> None:
    """``seq`` is the event's time in microseconds, and still grows when the clock does not:
    the same microsecond (a batch's messages) or a clock stepped back by NTP."""
    sink = FlakySink()
    sink.failing = False
    clock = StepClock(T0)
    ledger = Ledger(sink, replica="gw", clock=clock)
    async with ledger:
        ledger.emit("accepted", message_id="a", entity="orders", session_id="s-1")
        ledger.emit("accepted", message_id="b", entity="orders", session_id="s-1")
        clock.now = T0 - 5  # stepped back
        ledger.emit("accepted", message_id="c", entity="orders", session_id="s-1")
        clock.now = T0 + 1.25
        ledger.emit("accepted", message_id="d", entity="orders")
    records = [orjson.loads(line) for chunk in sink.lines for line in chunk.splitlines()]
    t0_us = int(T0 * 1_000_000)
    assert [(r["message_id"], r["session_id"], r["seq"]) for r in records] == [
        ("a", "s-1", t0_us),
        ("b", "s-1", t0_us + 1),
        ("c", "s-1", t0_us + 2),
        ("d", None, t0_us + 1_250_000),
    ]
    assert records[3]["ts"] == "2025-03-04T06:00:00.750000Z"  # seq is ts, in microseconds


async def test_seq_is_ts_in_microseconds_while_the_clock_moves_forward() -> None:
    """The audit reads a v1 line's ``ts`` in microseconds where a v2 line has ``seq``: the two
    must be the same number."""
    sink = FlakySink()
    sink.failing = False
    clock = StepClock(T0)
    ledger = Ledger(sink, replica="gw", clock=clock)
    async with ledger:
        for epoch in (T0, T0 + 0.000011, T0 + 0.5000019, T0 + 0.999999, T0 + 3601.1234567):
            clock.now = epoch
            ledger.emit("accepted", message_id=str(epoch))
    for chunk in sink.lines:
        for line in chunk.splitlines():
            record = orjson.loads(line)
            when = dt.datetime.fromisoformat(str(record["ts"]))
            micros = (when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
            assert record["seq"] == micros, record


async def test_event_ids_are_unique_uuid4_and_ts_has_microseconds(tmp_path: Path) -> None:
    ledger = Ledger(DirectorySink(tmp_path, "gw-1"), replica="gw-1", batch_size=100)
    async with ledger:
        for i in range(1000):
            ledger.emit("accepted", message_id=f"m{i}", entity="orders", route="primary")
            if i % 250 == 0:
                await asyncio.sleep(0)  # let the writer take partial batches
    records = all_records(tmp_path)
    assert len(records) == 1000
    ids = [str(r["event_id"]) for r in records]
    assert len(set(ids)) == 1000
    for event_id in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", event_id)
        assert uuid.UUID(hex=event_id).version == 4
        assert uuid.UUID(hex=event_id).variant == uuid.RFC_4122
    assert all(TS_RE.match(str(r["ts"])) for r in records)
    assert [r["message_id"] for r in records] == [f"m{i}" for i in range(1000)]


async def test_gzip_appends_one_member_per_batch_and_reads_whole(tmp_path: Path) -> None:
    ledger = Ledger(
        DirectorySink(tmp_path, "gw/2", compress=True), replica="gw/2", clock=StepClock(T0)
    )
    async with ledger:
        ledger.emit("ping", entity="orders")
        await ledger.flush()
        ledger.emit("failover_end", entity="orders")
        await ledger.flush()
        ledger.emit("syphoned", message_id="m1", entity="orders", backlog="b/1")
    [path] = list(tmp_path.rglob("*"))[-1:]
    assert path.name == "gw_2.jsonl.gz"  # the replica name is made path-safe
    assert [r["event"] for r in read_lines(path)] == ["ping", "failover_end", "syphoned"]
    with path.open("rb") as f:
        assert f.read().count(b"\x1f\x8b\x08") >= 3  # three gzip members


async def test_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    ledger = Ledger(DirectorySink(tmp_path, "gw"), replica="gw", capacity=10)
    for i in range(15):  # not started yet: buffered up to capacity
        ledger.emit("accepted", message_id=str(i))
    assert (ledger.emitted, ledger.dropped, ledger.queue_depth) == (10, 5, 10)
    async with ledger:
        pass
    assert ledger.written == 10
    assert [r["message_id"] for r in all_records(tmp_path)] == [str(i) for i in range(10)]


async def test_failing_sink_counts_and_recovers() -> None:
    sink = FlakySink()
    ledger = Ledger(sink, replica="gw")
    async with ledger:
        for i in range(5):
            ledger.emit("accepted", message_id=str(i))  # never raises on the hot path
        async with asyncio.timeout(5):
            await ledger.flush()
        assert ledger.write_errors == 1 and ledger.dropped == 5 and ledger.written == 0
        assert ledger.last_error is not None and "No space left" in ledger.last_error
        sink.failing = False
        ledger.emit("accepted", message_id="after")
        async with asyncio.timeout(5):
            await ledger.flush()
    assert ledger.written == 1 and sink.closed
    assert orjson.loads(sink.lines[0])["message_id"] == "after"


async def test_unwritable_directory_is_counted_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the ledger directory should be")
    ledger = Ledger(DirectorySink(blocker / "ledger", "gw"), replica="gw")
    async with ledger:
        ledger.emit("accepted", message_id="m1")
        async with asyncio.timeout(5):
            await ledger.flush()
        ledger.emit("accepted", message_id="m2")
    assert ledger.write_errors == 2 and ledger.dropped == 2 and ledger.written == 0


async def test_unencodable_event_is_dropped_alone() -> None:
    sink = FlakySink()
    sink.failing = False
    ledger = Ledger(sink, replica="gw")
    async with ledger:
        ledger.emit("accepted", message_id="ok1", when=object(), tags={1: "x"})
        ledger.emit("accepted", message_id="bad", size=2**70)  # beyond 64-bit JSON ints
        ledger.emit("accepted", message_id="ok2", v=99, region="weu")
    assert (ledger.written, ledger.encode_errors, ledger.dropped) == (2, 1, 1)
    first, second = (orjson.loads(line) for line in sink.lines)
    assert first["message_id"] == "ok1" and first["tags"] == {"1": "x"}
    assert str(first["when"]).startswith("<object object")
    assert (
        second["v"] == LEDGER_VERSION and second["region"] == "weu"
    )  # extras never override the contract


async def test_clean_shutdown_flushes_without_waiting_for_the_interval(tmp_path: Path) -> None:
    ledger = Ledger(DirectorySink(tmp_path, "gw"), replica="gw", flush_interval=60.0)
    await ledger.start()
    for i in range(100):
        ledger.emit("accepted", message_id=str(i))
    async with no_hang("close with a 60 s flush interval", guard=30):
        await ledger.aclose()
    assert ledger.written == 100 and len(all_records(tmp_path)) == 100
    ledger.emit("accepted", message_id="late")  # after close: counted, not raised
    assert ledger.dropped == 1
    await ledger.aclose()  # idempotent


async def test_close_deadline_bounds_a_stuck_sink() -> None:
    sink = BlockingSink()
    ledger = Ledger(sink, replica="gw", close_timeout=0.3)
    await ledger.start()
    ledger.emit("accepted", message_id="stuck")
    async with asyncio.timeout(5):
        await asyncio.to_thread(sink.entered.wait, 5)
    ledger.emit("accepted", message_id="buffered")
    try:
        # The sink never returns until released: closing at all is close_timeout at work.
        async with no_hang("close over a stuck sink"):
            await ledger.aclose()
        assert ledger.dropped >= 1 and ledger.written == 0
    finally:
        sink.release.set()


async def test_flush_returns_once_written(tmp_path: Path) -> None:
    ledger = Ledger(DirectorySink(tmp_path, "gw"), replica="gw", flush_interval=60.0)
    async with ledger:
        ledger.emit("accepted", message_id="m1")
        async with asyncio.timeout(5):
            await ledger.flush()
        assert ledger.written == 1
        assert [r["message_id"] for r in all_records(tmp_path)] == ["m1"]


async def test_stream_sink_writes_lines() -> None:
    stream = io.BytesIO()
    ledger = Ledger(StreamSink(stream), replica="gw")
    async with ledger:
        ledger.emit("rejected", message_id="m1", entity="orders", status=503)
    [line] = stream.getvalue().splitlines()
    record = orjson.loads(line)
    assert record["event"] == "rejected" and record["status"] == 503


async def test_null_ledger_and_factory(tmp_path: Path) -> None:
    off: EventLedger = create_ledger(LedgerSettings(), replica="gw")
    assert isinstance(off, NullLedger) and not off.enabled
    async with off:
        off.emit("accepted", message_id="m1")
        await off.flush()
    assert (off.emitted, off.written, off.dropped, off.write_errors) == (0, 0, 0, 0)

    on = create_ledger(LedgerSettings(sink="dir", directory=tmp_path, compress=True), replica="r")
    assert isinstance(on, Ledger) and on.enabled
    async with on:
        on.emit("ping", entity="orders")
    assert [p.name for p in tmp_path.rglob("*.gz")] == ["r.jsonl.gz"]
    assert isinstance(create_ledger(LedgerSettings(sink="stdout"), replica="r"), Ledger)

    with pytest.raises(ValueError, match="directory"):
        LedgerSettings(sink="dir")
    with pytest.raises(ValueError, match="sink"):
        LedgerSettings(sink="file")  # type: ignore[arg-type]


def test_event_names_match_the_contract() -> None:
    expected = "accepted syphoned expired dead_lettered rejected failover_start failover_end ping"
    assert frozenset(expected.split()) == LEDGER_EVENTS


# -- the column encoder against the record encoder -------------------------------------------

EVENT_ID = re.compile(rb'"event_id":"[0-9a-f]{32}"')

# (epoch, event, message_id, entity, route, backlog, size, latency_ms, session_id, extra): the
# buffer's tuples, with what clients can put in them (quotes, backslashes, control characters,
# non-ASCII, '%', commas) and the clock moving as it does (the same microsecond, stepped back).
AWKWARD_BATCH = [
    (T0 + 0.25, "accepted", "m-1", "orders", "primary", None, 1024, 3.25, None, None),
    (T0 + 0.25, "accepted", 'q"uo\\te', "orders", "primary", None, 0, 0.001, "s,1", None),
    (T0 + 0.2500004, "accepted", "ctl\n\t\x00", "o/ä", "backlog", "b/0", 7, 1e-07, "sé", None),
    (T0 + 0.1, "accepted", "100%s %d", "%(x)s", "primary", None, None, None, "%", None),
    (T0 + 0.3, "rejected", "m-2", "orders", None, None, None, 2.5, None, {"status": 400}),
    (T0 + 0.3, "ping", None, "orders", None, None, None, None, None, {"ok": True, "seq": 5}),
    (T0 + 0.35, "failover_start", None, "orders", None, None, None, None, None, {"v": 9}),
    (T0 + 0.4, "accepted", "🙂", "orders", "primary", None, 2**63 - 1, float("nan"), "", None),
    (T0 + 0.45, "accepted", "m-3", "orders", "primary", None, True, 7, None, {"tags": {1: "x"}}),
]

# Ids that need no escapes (the common case, taken by a faster path), with and without sessions.
PLAIN_BATCH = [
    (T0 + 0.5, "accepted", "m,1", "orders", "primary", None, 10, 1.5, "s-1", None),
    (T0 + 0.5, "accepted", "m-é🙂", "events", "backlog", "b/1", 11, 2.0, "s,2", None),
    (T0 + 0.6, "syphoned", "m-3", "orders", None, "b/1", None, None, "", {"x": "100%"}),
]


def _masked(chunks: list[EncodedLine]) -> list[tuple[int, bytes]]:
    lines = [(second // 3600, line) for second, data in chunks for line in data.splitlines()]
    return [(hour, EVENT_ID.sub(b'"event_id":"-"', line)) for hour, line in lines]


def test_column_encoder_writes_the_record_encoders_bytes() -> None:
    """The fast path (one template per line, C functions mapped over columns) must write
    exactly what ``orjson.dumps`` of the contract's record dict writes, ``seq`` included."""
    columns, records = Ledger(FlakySink(), replica='gw-"0%'), Ledger(FlakySink(), replica='gw-"0%')
    columns._seq = records._seq = int((T0 + 0.2500001) * 1_000_000)  # ahead of the clock
    col_chunks: list[EncodedLine] = []
    rec_chunks: list[EncodedLine] = []
    batches = (AWKWARD_BATCH, AWKWARD_BATCH[:1], AWKWARD_BATCH[3:], PLAIN_BATCH, PLAIN_BATCH[:1])
    for batch in batches:  # seq carries over from batch to batch
        assert columns._encode_columns(batch, col_chunks)
        assert records._encode_records(batch, rec_chunks) == 0
    assert _masked(col_chunks) == _masked(rec_chunks)
    assert columns._seq == records._seq
    parsed = [orjson.loads(line) for _, line in _masked(col_chunks)]
    assert [list(r)[:13] for r in parsed] == [CONTRACT_KEYS] * len(parsed)
    seqs = [r["seq"] for r in parsed]
    assert seqs == sorted(set(seqs))  # strictly increasing in emit order


@pytest.mark.parametrize(
    "odd",
    [
        (T0 + 1, "accepted", "m", "orders", "primary", None, 1, 1.0, None, None),  # next hour
        (T0, "accepted", "m", "orders", "primary", None, 2**70, 1.0, None, None),  # too big
        (T0, "accepted", "m", "orders", "primary", None, [1, 2], 1.0, None, None),  # a list
        (T0, "accepted", "m", "orders", "primary", None, "1,2", 1.0, None, None),  # commas
        (T0, "accepted", object(), "orders", "primary", None, 1, 1.0, None, None),  # not JSON
        (T0, "accepted", "m", ["orders"], "primary", None, 1, 1.0, None, None),  # unhashable
    ],
)
def test_column_encoder_leaves_odd_slices_to_the_record_encoder(odd: tuple[object, ...]) -> None:
    ledger = Ledger(FlakySink(), replica="gw")
    plain = (T0, "accepted", "m0", "orders", "primary", None, 1, 1.0, None, None)
    chunks: list[EncodedLine] = []
    assert not ledger._encode_columns([plain, odd], chunks)  # type: ignore[list-item]
    assert chunks == [] and ledger._seq == 0  # nothing written, no seq spent
    ledger._encode([plain, odd], chunks)  # type: ignore[list-item]
    assert len(b"".join(data for _, data in chunks).splitlines()) in (1, 2)  # per record
