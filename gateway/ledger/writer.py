"""The ledger writer: a non-blocking ``emit`` on the hot path, an owned background writer.

Layers: ``emit`` (API, never awaits, never raises) → a bounded in-memory buffer of tuples →
the writer task, which swaps the buffer out in batches, stamps event ids and ``seq`` and
encodes JSON lines column by column (in short slices between request handlers) and hands each
batch's bytes to one dedicated thread that writes to the sink. ``emit`` costs one
``time.time()`` and one list append (~0.5 µs).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, count, islice, repeat
from operator import add, lt, mul, sub
from types import TracebackType
from typing import Any, Final, Protocol, Self

import orjson

from gateway.ledger.events import (
    LEDGER_KEYS,
    LEDGER_VERSION,
    LedgerEvent,
    Route,
    format_ts,
    new_event_ids,
    new_event_ids_bytes,
    next_seq,
)
from gateway.ledger.sinks import EncodedLine, LedgerSink
from gateway.lifetimes import TaskObserver, stop_after, supervised

log = logging.getLogger(__name__)

# One buffered event: (epoch seconds, event, message_id, entity, route, backlog, size,
# latency_ms, session_id, extra fields). A tuple, because building it is the cheapest thing
# emit can do.
_Item = tuple[
    float,
    str,
    str | None,
    str | None,
    str | None,
    str | None,
    int | None,
    float | None,
    str | None,
    Any,
]

_ORJSON_OPTS: Final = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS
_RECORD_SEP: Final = b'},{"v":%d,"event_id":' % LEDGER_VERSION
_RECORD_SEP_NL: Final = b'}\n{"v":%d,"event_id":' % LEDGER_VERSION
_ERROR_LOG_INTERVAL: Final = 10.0
_ENCODE_SLICE: Final = 256  # events encoded per turn of the event loop (~0.3 ms)
_CONTRACT_KEYS: Final = frozenset(LEDGER_KEYS)
_FRAGMENTS_MAX: Final = 4096  # (entity, event, route, backlog) combinations kept encoded


class _Fragments(dict[tuple[object, ...], bytes]):
    """``"entity":…,"event":…,"route":…,"backlog":…`` for each (entity, event, route, backlog).

    Those take few values (declared entities, the event names, two routes, the backlog
    queues), so each combination is encoded once. Only strings and None are kept (``1`` and
    ``True`` are equal keys with different JSON).
    """

    def __missing__(self, key: tuple[object, ...]) -> bytes:
        entity, event, route, backlog = map(orjson.dumps, key)
        encoded = b'"entity":%s,"event":%s,"route":%s,"backlog":%s' % (
            entity,
            event,
            route,
            backlog,
        )
        if all(v is None or type(v) is str for v in key):
            if len(self) >= _FRAGMENTS_MAX:
                self.clear()
            self[key] = encoded
        return encoded


# A JSON string or null, as orjson writes them (every '"' inside a string is escaped).
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|null')
_STR_OR_NONE: Final = frozenset({str, type(None)})


def _json_strings(column: tuple[object, ...]) -> tuple[Iterable[bytes], bool] | None:
    """Each value of ``column`` (str or None) as JSON, from one ``orjson.dumps`` of the whole
    column (a call per value costs ~30x as much); None if a value is of another type.

    The second item says the values come without their quotes (the line template adds them):
    a column of strings that needed no escapes is split at its ``","`` separators, which then
    cannot occur inside a value; otherwise the JSON strings and nulls are cut out with a regex.
    """
    n = len(column)
    nones = column.count(None)
    if nones == n:
        return repeat(b"null", n), False
    if not set(map(type, column)) <= _STR_OR_NONE:
        return None
    data = orjson.dumps(column)
    if not nones and b"\\" not in data:
        return data[2:-2].split(b'","'), True
    return _JSON_TOKEN.findall(data), False


def _extra_tail(extra: dict[str, object] | None) -> bytes:
    """The end of a line after ``seq``: the extra fields (never a contract key) and ``}``."""
    if not extra:
        return b"}\n"
    if not _CONTRACT_KEYS.isdisjoint(extra):
        extra = {k: v for k, v in extra.items() if k not in _CONTRACT_KEYS}
        if not extra:
            return b"}\n"
    return b"," + orjson.dumps(extra, default=str, option=_ORJSON_OPTS)[1:]


def _line_template(replica: str, quoted_mid: bool, quoted_sid: bool) -> bytes:
    """One ledger line as a ``bytes %`` template, keys in the contract's order; the message
    and session ids inside quotes it adds (`_json_strings`) or as they are."""
    mid = b'"%s"' if quoted_mid else b"%s"
    sid = b'"%s"' if quoted_sid else b"%s"
    return (
        b'{"v":%d,"event_id":"%%s","ts":"%%s.%%06dZ","replica":' % LEDGER_VERSION
        + orjson.dumps(replica).replace(b"%", b"%%")
        + b',"message_id":'
        + mid
        + b',%s,"size":%s,"latency_ms":%s,"session_id":'
        + sid
        + b',"seq":%d%s'
    )


class EventLedger(Protocol):
    """What the gateway uses: ``Ledger`` when the event log is on, ``NullLedger`` when off."""

    @property
    def enabled(self) -> bool: ...
    @property
    def emitted(self) -> int: ...
    @property
    def written(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    @property
    def write_errors(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...

    # Told when the writer task raised and is restarted (metrics); set before `start`.
    task_observer: TaskObserver | None

    def emit(
        self,
        event: LedgerEvent,
        /,
        *,
        message_id: str | None = None,
        entity: str | None = None,
        route: Route | None = None,
        backlog: str | None = None,
        size: int | None = None,
        latency_ms: float | None = None,
        session_id: str | None = None,
        **extra: object,
    ) -> None:
        """Record one event; never blocks, never raises (drops and counts when full)."""

    async def start(self) -> None: ...
    async def flush(self) -> None: ...
    async def aclose(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class Ledger:
    """Buffered, batched event-log writer owned by an async context (or ``start``/``aclose``).

    ``emit`` must be called from the event loop's thread. Events emitted before ``start`` are
    buffered. When the buffer holds ``capacity`` events, new ones are dropped and counted in
    ``dropped``; so are the events of a batch the sink failed to write (``write_errors`` counts
    failed batches) and those still buffered when ``aclose`` runs out of time. Memory is bounded
    by two buffers: the one filling and the batch being written.

    Counters (plain attributes, read them any time from the loop's thread): ``emitted``
    (accepted by ``emit``), ``written``, ``dropped``, ``write_errors``, ``encode_errors``.
    """

    enabled: Final = True

    def __init__(
        self,
        sink: LedgerSink,
        *,
        replica: str,
        capacity: int = 65_536,
        batch_size: int = 4096,
        flush_interval: float = 0.25,
        close_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1 or batch_size < 1:
            raise ValueError("capacity and batch_size must be >= 1")
        if flush_interval <= 0 or close_timeout <= 0:
            raise ValueError("flush_interval and close_timeout must be > 0")
        self._sink = sink
        self._replica = replica
        self._capacity = capacity
        self._batch_size = min(batch_size, capacity)
        self._flush_interval = flush_interval
        self._close_timeout = close_timeout
        self._clock = clock
        self._buf: list[_Item] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        # Told when the writer raised and is restarted (metrics; set by the app before `start`).
        self.task_observer: TaskObserver | None = None
        self._executor: ThreadPoolExecutor | None = None
        # flush() waiters: (number of events that must be done, future to resolve)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._done = 0  # events written or dropped after leaving the buffer
        self._last_error_log = float("-inf")
        # Encoding state, touched only by the writer task.
        self._line_templates = {
            (qm, qs): _line_template(replica, qm, qs)
            for qm in (False, True)
            for qs in (False, True)
        }
        self._fragments = _Fragments()
        self._ts_second = -1
        self._ts_prefix = ""
        # The last `seq` stamped: batches are encoded one after another in emit order, so
        # stamping here (off the hot path) gives the order events were emitted in.
        self._seq = 0
        self.emitted = 0
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self.encode_errors = 0
        self.last_error: str | None = None

    @property
    def queue_depth(self) -> int:
        """Events buffered and not yet handed to the sink."""
        return len(self._buf)

    # -- hot path ---------------------------------------------------------------------------

    def emit(
        self,
        event: LedgerEvent,
        /,
        *,
        message_id: str | None = None,
        entity: str | None = None,
        route: Route | None = None,
        backlog: str | None = None,
        size: int | None = None,
        latency_ms: float | None = None,
        session_id: str | None = None,
        **extra: object,
    ) -> None:
        """Buffer one event stamped with the current time. Never awaits, never raises."""
        buf = self._buf
        if self._closing or len(buf) >= self._capacity:
            self.dropped += 1
            return
        buf.append(
            # ``extra or None``: a tuple of plain values is untracked by the cyclic GC.
            (
                self._clock(),
                event,
                message_id,
                entity,
                route,
                backlog,
                size,
                latency_ms,
                session_id,
                extra or None,
            )
        )
        self.emitted += 1
        if len(buf) == self._batch_size:
            self._wake.set()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the writer task (idempotent). Events buffered so far are written next."""
        if self._closed:
            raise RuntimeError("ledger is closed")
        if self._task is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-writer")
            # Supervised: a bug or an unforeseen value never ends the writer quietly.
            self._task = asyncio.get_running_loop().create_task(
                supervised("ledger_writer", self._run, self.task_observer), name="ledger-writer"
            )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def flush(self) -> None:
        """Wait until every event emitted before this call is written (or dropped).

        Waits for the writer task: bound it with ``asyncio.timeout`` (it never returns if the
        ledger is not started). Cancelling it is safe and loses nothing.
        """
        target = self.emitted
        if self._done >= target or self._closed:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        self._wake.set()
        try:
            await fut
        finally:
            self._waiters = [w for w in self._waiters if w[1] is not fut]

    async def aclose(self) -> None:
        """Stop accepting events, write what is buffered within ``close_timeout``, stop.

        Whatever could not be written by the deadline is counted in ``dropped``; the writer
        task is cancelled and awaited, and the sink is closed (after any write still running
        in the writer thread). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._closing = True
        deadline = asyncio.get_running_loop().time() + self._close_timeout
        task = self._task
        try:
            if task is not None:
                self._wake.set()
                # It ends by itself once the buffer is written; past the deadline (and, if
                # this close is cancelled, at once) it is cancelled.
                await stop_after([task], self._close_timeout, "ledger")
        finally:
            self.dropped += len(self._buf)
            self._done += len(self._buf)
            self._buf = []
            self._notify_waiters()
            await self._close_sink(deadline)

    async def _close_sink(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        executor = self._executor
        try:
            # Queued behind a write that may still be running in the writer thread.
            remaining = max(0.1, deadline - loop.time())
            await asyncio.wait_for(loop.run_in_executor(executor, self._sink.close), remaining)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failing sink must not fail the gateway's shutdown
            self.last_error = f"close: {exc!r}"
            log.warning("ledger sink close failed: %r", exc)
        finally:
            if executor is not None:
                executor.shutdown(wait=False)

    # -- writer task ------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._closing and not self._waiters and len(self._buf) < self._batch_size:
                self._wake.clear()
                try:
                    async with asyncio.timeout(self._flush_interval):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            batch, self._buf = self._buf, []
            if batch:
                await self._write(batch)
            self._notify_waiters()
            if self._closing and not self._buf:
                return

    async def _write(self, batch: list[_Item]) -> None:
        """Encode ``batch`` on the loop in short slices, then write it in the writer thread.

        Encoding stays on the event loop on purpose: measured here, encoding in a thread costs
        the loop several times the encoding's own CPU in GIL hand-offs (the loop releases the
        GIL in every ``select``), while a slice of ``_ENCODE_SLICE`` events blocks it well under
        a millisecond. Only the blocking I/O runs in the thread.
        """
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        chunks: list[EncodedLine] = []
        failures = 0
        try:
            for start in range(0, len(batch), _ENCODE_SLICE):
                if start:
                    await asyncio.sleep(0)  # let request handlers run between slices
                failures += self._encode(batch[start : start + _ENCODE_SLICE], chunks)
            if chunks:
                await loop.run_in_executor(self._executor, self._sink.write, chunks)
        except asyncio.CancelledError:
            self.dropped += len(batch)  # not confirmed written
            raise
        except Exception as exc:  # the sink failed: keep serving, count the loss
            self.write_errors += 1
            self.dropped += len(batch)
            self.last_error = repr(exc)
            now = loop.time()
            if now - self._last_error_log >= _ERROR_LOG_INTERVAL:
                self._last_error_log = now
                log.warning(
                    "ledger write failed, %d events dropped (dropped total %d): %r",
                    len(batch),
                    self.dropped,
                    exc,
                )
        else:
            self.encode_errors += failures
            self.dropped += failures
            self.written += len(batch) - failures
        finally:
            self._done += len(batch)

    def _notify_waiters(self) -> None:
        if not self._waiters:
            return
        still: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if self._done >= target or self._closed:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((target, fut))
        self._waiters = still

    # -- encoding (on the loop, in slices between request handlers) -------------------------

    def _encode(self, batch: Sequence[_Item], chunks: list[EncodedLine]) -> int:
        """Append the encoded lines of ``batch`` to ``chunks``; return the encode failures.

        Column by column (`_encode_columns`); a slice it does not take (an hour boundary, a
        value that is not a plain number or string) is encoded record by record.
        """
        if self._encode_columns(batch, chunks):
            return 0
        return self._encode_records(batch, chunks)

    def _encode_columns(self, batch: Sequence[_Item], chunks: list[EncodedLine]) -> bool:
        """Encode ``batch`` (events of one UTC hour) as whole columns; False if it cannot.

        Per event the interpreter runs no bytecode of ours: each step maps a C function over a
        column (one ``orjson.dumps`` per column, split into values; the encoded (entity, event,
        route, backlog) from a cache; ``seq`` as a running ``max``) and one ``bytes %`` per
        line fills a template that holds the keys. The lines are byte for byte what
        ``orjson.dumps`` of the record dict gives (``tests/gateway/test_ledger.py`` holds the
        two together); building that dict per event cost about twice as much CPU.
        """
        n = len(batch)
        if not n:
            return True
        ts_col, events, mids, entities, routes, backlogs, sizes, latencies, sids, extras = zip(
            *batch, strict=True
        )
        seconds = list(map(int, ts_col))
        hour = seconds[0] // 3600
        if min(seconds) // 3600 != hour or max(seconds) // 3600 != hour:
            return False
        try:
            sizes_json = orjson.dumps(sizes)[1:-1].split(b",")
            latencies_json = orjson.dumps(latencies)[1:-1].split(b",")
            mids_json = _json_strings(mids)
            sids_json = _json_strings(sids)
            fragments = list(
                map(
                    self._fragments.__getitem__,
                    zip(entities, events, routes, backlogs, strict=True),
                )
            )
            tails: Iterable[bytes] = (
                repeat(b"}\n", n) if extras.count(None) == n else list(map(_extra_tail, extras))
            )
        except (TypeError, ValueError):
            return False
        if mids_json is None or sids_json is None:
            return False
        template = self._line_templates[mids_json[1], sids_json[1]]
        if len(sizes_json) != n or len(latencies_json) != n:
            return False  # a value with commas of its own (a list?): not a plain number
        # The microseconds as ``ts`` shows them (truncated), and ``seq`` (see `next_seq`).
        micros = list(map(int, map(mul, map(sub, ts_col, seconds), repeat(1_000_000.0))))
        us = list(map(add, map(mul, seconds, repeat(1_000_000)), micros))
        if us[0] > self._seq and all(map(lt, us, islice(us, 1, None))):
            seqs = us  # the clock moved forward at every event: seq is the time
        else:
            # seq_i = max(us_i, seq_(i-1) + 1); with v_i = us_i - i that is
            # seq_i = i + max(seq_prev + 1, v_0, ..., v_i), a running max.
            running = accumulate(map(sub, us, count()), max, initial=self._seq + 1)
            seqs = list(map(add, islice(running, 1, None), count()))
        prefixes = {s: format_ts(s)[:-8].encode() for s in set(seconds)}
        data = b"".join(
            map(
                template.__mod__,
                zip(
                    new_event_ids_bytes(n),
                    map(prefixes.__getitem__, seconds),
                    micros,
                    mids_json[0],
                    fragments,
                    sizes_json,
                    latencies_json,
                    sids_json[0],
                    seqs,
                    tails,
                    strict=True,
                ),
            )
        )
        self._seq = seqs[-1]
        chunks.append((hour * 3600, data))
        return True

    def _encode_records(self, batch: Sequence[_Item], chunks: list[EncodedLine]) -> int:
        """`_encode`, one record dict per event: any value, an hour boundary, extra fields.

        Consecutive events of the same UTC hour without extra fields are encoded with one
        ``orjson.dumps`` of a list, then split into lines at the record boundaries.
        """
        failures = 0
        run: list[dict[str, object]] = []
        run_hour = -1
        replica = self._replica
        for event_id, (ts, event, mid, entity, route, backlog, size, latency, sid, extra) in zip(
            new_event_ids(len(batch)), batch, strict=True
        ):
            self._seq = seq = next_seq(ts, self._seq)
            second = int(ts)
            if run and (extra or second // 3600 != run_hour):
                failures += _encode_run(run, run_hour * 3600, chunks)
                run = []
            record: dict[str, object] = {
                "v": LEDGER_VERSION,
                "event_id": event_id,
                "ts": self._format_ts(ts, second),
                "replica": replica,
                "message_id": mid,
                "entity": entity,
                "event": event,
                "route": route,
                "backlog": backlog,
                "size": size,
                "latency_ms": latency,
                "session_id": sid,
                "seq": seq,
            }
            if extra:
                for key, value in extra.items():
                    record.setdefault(key, value)  # extras never override the contract
                failures += _encode_run([record], second, chunks)
            else:
                run_hour = second // 3600
                run.append(record)
        if run:
            failures += _encode_run(run, run_hour * 3600, chunks)
        return failures

    def _format_ts(self, epoch: float, second: int) -> str:
        if second != self._ts_second:
            self._ts_second = second
            self._ts_prefix = format_ts(second)[:-8]  # "YYYY-MM-DDTHH:MM:SS"
        return "%s.%06dZ" % (self._ts_prefix, (epoch - second) * 1_000_000)  # noqa: UP031


def _encode_run(run: list[dict[str, object]], second: int, chunks: list[EncodedLine]) -> int:
    """Append the JSON lines of ``run`` (events of one hour) to ``chunks``; return failures."""
    if len(run) > 1:
        try:
            data = orjson.dumps(run, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, ValueError):
            pass  # find the culprit below, one record at a time
        else:
            # The separator cannot occur inside a string (its quote would be escaped) and
            # records of a run have no extra (nested) values, so it matches only between
            # records.
            chunks.append((second, data[1:-1].replace(_RECORD_SEP, _RECORD_SEP_NL) + b"\n"))
            return 0
    failures = 0
    lines: list[bytes] = []
    for record in run:
        try:
            lines.append(orjson.dumps(record, default=str, option=_ORJSON_OPTS))
        except (TypeError, ValueError):
            failures += 1
    if lines:
        chunks.append((second, b"".join(lines)))
    return failures


class NullLedger:
    """The ledger when the event log is off (the default): every call does nothing."""

    enabled: Final = False
    emitted: Final = 0
    written: Final = 0
    dropped: Final = 0
    write_errors: Final = 0
    queue_depth: Final = 0
    task_observer: TaskObserver | None = None  # no writer task

    def emit(
        self,
        event: LedgerEvent,
        /,
        *,
        message_id: str | None = None,
        entity: str | None = None,
        route: Route | None = None,
        backlog: str | None = None,
        size: int | None = None,
        latency_ms: float | None = None,
        session_id: str | None = None,
        **extra: object,
    ) -> None:
        return None

    async def start(self) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None
