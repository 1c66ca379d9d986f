"""Where ledger lines go. Sinks are synchronous and blocking: the ledger calls them from its
own writer thread, never from the event loop.

A sink raises ``OSError`` (or anything else) when a batch could not be written; the ledger
counts the batch as dropped and keeps going, and the sink must be usable again for the next
batch (it reopens what it has to).
"""

from __future__ import annotations

import gzip
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

# What the writer hands a sink: (an epoch second, one or more encoded lines each ending in
# "\n"); all events of a chunk fall in the UTC hour of that second.
EncodedLine = tuple[int, bytes]

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class LedgerSink(Protocol):
    """A blocking destination for encoded ledger lines."""

    def write(self, lines: Sequence[EncodedLine]) -> None:
        """Write one batch; raise if any of it could not be written."""

    def close(self) -> None:
        """Flush and release resources; the sink is not used afterwards."""


class StreamSink:
    """Writes lines to a binary stream (standard output by default), flushing per batch.

    Readers find ledger lines among other JSON log lines by their ``"v"`` and ``"event_id"``
    keys, so the ledger can share stdout with JSON logs collected by a log shipper.
    """

    def __init__(self, stream: BinaryIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self._lock = threading.Lock()

    def write(self, lines: Sequence[EncodedLine]) -> None:
        data = b"".join(line for _, line in lines)
        with self._lock:
            self._stream.write(data)
            self._stream.flush()

    def close(self) -> None:
        with self._lock:
            self._stream.flush()


class DirectorySink:
    """Files partitioned by the event's UTC hour: ``<root>/dt=YYYY-MM-DD/hour=HH/<replica>.jsonl``.

    The partition is the event's own timestamp, not the write time, so an event always lands
    in the hour the reconciliation looks for it. Plain files stay open in append mode and are
    flushed per batch (a crash loses at most the batch being written). With ``compress=True``
    each batch is appended as one gzip member to ``<replica>.jsonl.gz``: a concatenation of
    members is a valid gzip file that gzip, Python and Spark read whole, and a crash can only
    truncate the last member. ``replica`` must be unique per writing process.
    """

    def __init__(self, root: Path, replica: str, *, compress: bool = False) -> None:
        self._root = Path(root)
        self._filename = _SAFE_NAME.sub("_", replica) + (".jsonl.gz" if compress else ".jsonl")
        self._compress = compress
        self._lock = threading.Lock()
        self._open: dict[int, BinaryIO] = {}  # hour number -> open plain file
        self.files_opened = 0

    def path_for(self, epoch_second: int) -> Path:
        """The file that holds events of this second."""
        tm = time.gmtime(epoch_second)
        return (
            self._root
            / time.strftime("dt=%Y-%m-%d", tm)
            / time.strftime("hour=%H", tm)
            / self._filename
        )

    def write(self, lines: Sequence[EncodedLine]) -> None:
        by_hour: dict[int, list[bytes]] = {}
        for second, line in lines:
            by_hour.setdefault(second // 3600, []).append(line)
        with self._lock:
            for hour, hour_lines in by_hour.items():
                data = b"".join(hour_lines)
                if self._compress:
                    self._append_gzip(hour, data)
                else:
                    self._append_plain(hour, data)
            self._close_old_hours(max(by_hour, default=0))

    def _append_gzip(self, hour: int, data: bytes) -> None:
        path = self.path_for(hour * 3600)
        path.parent.mkdir(parents=True, exist_ok=True)
        member = gzip.compress(data, compresslevel=6, mtime=0)
        with path.open("ab") as f:
            f.write(member)
        self.files_opened += 1

    def _append_plain(self, hour: int, data: bytes) -> None:
        f = self._open.get(hour)
        if f is None:
            path = self.path_for(hour * 3600)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = path.open("ab")
            self._open[hour] = f
            self.files_opened += 1
        try:
            f.write(data)
            f.flush()
        except BaseException:
            # Reopen on the next batch: the handle may be in an unknown state (ENOSPC, EIO).
            self._open.pop(hour, None)
            _close_quietly(f)
            raise

    def _close_old_hours(self, newest: int) -> None:
        # Late events can still arrive for the previous hour; anything older is closed.
        for hour in [h for h in self._open if h < newest - 1]:
            _close_quietly(self._open.pop(hour))

    def close(self) -> None:
        with self._lock:
            errors: list[BaseException] = []
            for f in self._open.values():
                try:
                    f.close()
                except OSError as exc:
                    errors.append(exc)
            self._open.clear()
            if errors:
                raise errors[0]


def _close_quietly(f: BinaryIO) -> None:
    try:
        f.close()
    except OSError:
        pass
