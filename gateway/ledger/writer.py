"""The ledger writer: a non-blocking ``emit`` on the hot path, an owned background writer.

Layers: ``emit`` (API, never awaits, never raises) → a bounded in-memory buffer → the writer
task, which swaps the buffer out in batches, stamps event ids and encodes JSON (orjson, in
short slices between request handlers) and hands each batch's bytes to one dedicated thread
that writes to the sink. ``emit`` costs one ``time.time()`` and one list append (~0.5 µs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Final, Protocol, Self

import orjson

from gateway.ledger.events import (
    LEDGER_VERSION,
    LedgerEvent,
    Route,
    format_ts,
    new_event_ids,
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
        # Encoding cache, touched only by the writer thread.
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

    # -- writer thread ----------------------------------------------------------------------

    def _encode(self, batch: Sequence[_Item], chunks: list[EncodedLine]) -> int:
        """Append the encoded lines of ``batch`` to ``chunks``; return the encode failures.

        Consecutive events of the same UTC hour without extra fields are encoded with one
        ``orjson.dumps`` of a list, then split into lines at the record boundaries: about half
        the CPU of one call per event.
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
