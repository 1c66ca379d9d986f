"""A TCP relay on 127.0.0.1 between an SDK and the gateway's AMQP listener, to see the wire.

What a test cannot ask the SDK or the gateway, the relay counts: how many TCP connections the
client opened (a reconnect shows as a second one, even one the SDK hides from the
application), and, on a plain (not TLS) connection, the AMQP frames each way: the client's
`open` (its idle timeout), its links and transfers, and the gateway's flows, close and
empty frames (heartbeats), with the loop time each arrived. Bytes are forwarded unchanged,
as they come; a TLS stream is only counted.

Every connection's pumps are owned by the relay and cancelled and awaited when it closes;
the frames kept are bounded (`MAX_FRAMES` a direction).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from sbamqp.addresses import entity_path
from sbamqp.codec import Described, decode

MAX_FRAMES = 10_000
MAX_FRAME = 1 << 24
_HEADER = b"AMQP"
_OPEN = 0x10
_ATTACH = 0x12
_FLOW = 0x13
_TRANSFER = 0x14
_CLOSE = 0x18
CONNECT_DEADLINE = 10.0


@dataclass(slots=True)
class Frame:
    """One AMQP frame as it crossed the relay: when, its size, and its performative."""

    at: float  # the loop's time when its last byte arrived
    size: int
    descriptor: int | None  # None: an empty frame (a heartbeat)
    fields: list[Any] | None


@dataclass(slots=True)
class _Stream:
    """A byte stream cut into protocol headers and frames (plain AMQP, SASL included)."""

    frames: list[Frame] = field(default_factory=list)
    opaque: bool = False  # not AMQP from its first bytes (TLS): counted, not read
    _buf: bytearray = field(default_factory=bytearray)
    _started: bool = False

    def feed(self, data: bytes, at: float) -> None:
        if self.opaque:
            return
        buf = self._buf
        buf += data
        if not self._started:
            if len(buf) < 4:
                return
            self._started = True
            if buf[:4] != _HEADER:
                self.opaque = True
                buf.clear()
                return
        while True:
            if buf[:4] == _HEADER:
                if len(buf) < 8:
                    return
                del buf[:8]
                continue
            if len(buf) < 8:
                return
            size = int.from_bytes(buf[:4], "big")
            if size < 8 or size > MAX_FRAME:
                self.opaque = True  # not a frame: stop reading rather than buffer without end
                buf.clear()
                return
            if len(buf) < size:
                return
            doff = buf[4] * 4
            body = bytes(buf[doff:size])
            del buf[:size]
            descriptor, fields = None, None
            if body:
                with contextlib.suppress(Exception):  # a frame we cannot read is kept unnamed
                    value = decode(body)[0]
                    if isinstance(value, Described):
                        descriptor = int(value.descriptor)
                        fields = list(value.value) if isinstance(value.value, list) else None
            if len(self.frames) < MAX_FRAMES:
                self.frames.append(Frame(at, size, descriptor, fields))


@dataclass(slots=True)
class Connection:
    """One client connection through the relay: where it went, and its frames each way."""

    target_port: int = 0
    to_server: _Stream = field(default_factory=_Stream)
    to_client: _Stream = field(default_factory=_Stream)

    def client_open(self) -> list[Any] | None:
        """The fields of the client's `open` (after SASL), or None before it came."""
        for frame in self.to_server.frames:
            if frame.descriptor == _OPEN:
                return frame.fields
        return None

    def client_idle_timeout_ms(self) -> int | None:
        fields = self.client_open()
        if fields is None or len(fields) < 5:
            return None
        return None if fields[4] is None else int(fields[4])

    def links_attached(self) -> int:
        """How many links the client attached (a new `$cbs` link would add two)."""
        return sum(1 for f in self.to_server.frames if f.descriptor == _ATTACH)

    def transfers_to(self, path: str) -> int:
        """How many transfers the client sent on its links to entity `path` (``$cbs``,
        ``orders``: the target address in any of its forms)."""
        handles = set()
        for f in self.to_server.frames:
            if f.descriptor == _ATTACH and f.fields and len(f.fields) > 6:
                target = f.fields[6]
                fields = target.value if isinstance(target, Described) else None
                address = fields[0] if isinstance(fields, list) and fields else None
                if isinstance(address, str) and entity_path(address) == path:
                    handles.add(int(f.fields[1]))
        return sum(
            1
            for f in self.to_server.frames
            if f.descriptor == _TRANSFER and f.fields and int(f.fields[0]) in handles
        )

    def credit_to_client(self) -> list[tuple[float, int, int]]:
        """The gateway's link flows: (when, handle, link-credit)."""
        out = []
        for f in self.to_client.frames:
            fields = f.fields
            if f.descriptor == _FLOW and fields and len(fields) > 6 and fields[4] is not None:
                out.append((f.at, int(fields[4]), int(fields[6] or 0)))
        return out

    def gateway_close(self) -> tuple[float, str | None] | None:
        """When the gateway sent its `close`, and the error condition it carried."""
        for f in self.to_client.frames:
            if f.descriptor == _CLOSE:
                error = f.fields[0] if f.fields else None
                if isinstance(error, Described) and isinstance(error.value, list):
                    return f.at, str(error.value[0])
                return f.at, None
        return None

    def heartbeats_to_client(self) -> list[float]:
        """When the gateway's empty frames arrived (its heartbeats)."""
        return [f.at for f in self.to_client.frames if f.descriptor is None and f.size == 8]


class Relay:
    """``async with Relay(port) as relay:`` clients dial ``relay.port`` instead of `port`."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections: list[Connection] = []
        self.port = 0

    def retarget(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        """Send the connections made from now on to another listener (a load balancer
        that moved on to another replica); open ones stay where they are."""
        self._target = (target_host, target_port)

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONNECT_DEADLINE):
                await self._server.wait_closed()

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(c_writer)
        target = self._target
        conn = Connection(target_port=target[1])
        self.connections.append(conn)
        s_writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(CONNECT_DEADLINE):
                s_reader, s_writer = await asyncio.open_connection(*target)
            self._writers.add(s_writer)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(_pump(c_reader, s_writer, conn.to_server))
                    tg.create_task(_pump(s_reader, c_writer, conn.to_client))
            except* OSError:
                pass  # one side reset: both are closed below
        except (OSError, TimeoutError):
            pass  # the listener refused or did not answer: the client is closed below
        finally:
            for writer in (c_writer, s_writer):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)
            self._tasks.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: _Stream) -> None:
    loop = asyncio.get_running_loop()
    while data := await reader.read(65536):
        seen.feed(data, loop.time())
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()
