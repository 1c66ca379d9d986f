"""A small asyncio TCP fault proxy (toxiproxy is not installable here, `tc netem` is not in
this kernel). Put it between a gateway and Redis or the broker: the gateway connects to
``127.0.0.1:<proxy.port>`` and the proxy forwards to the real target.

Modes (switch at any time; they act on open connections and on new ones):

* ``pass`` — forward, optionally adding `latency` seconds each way;
* ``blackhole`` — accept and read, forward nothing, answer nothing (a silently dead network:
  the peer's calls hang until their own deadlines);
* ``stall`` — stop reading and writing but keep everything buffered; `heal()` resumes the
  streams intact (a long GC pause or a frozen link);
* ``reset`` — abort every connection with a TCP RST and reset new ones at once.

`heal()` returns to ``pass``. Connections that saw a blackhole are aborted on heal (their
streams lost bytes, so the protocol on them is broken), as a real network outage would do.
Every link is a task owned by the proxy; `close()` cancels and awaits them all. The pumps'
reads have no deadline on purpose: a proxied stream lives as long as its peers (Redis
pub/sub idles for minutes); the peers' own deadlines, `reset()` and `close()` end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Mode = Literal["pass", "blackhole", "stall", "reset"]
_CHUNK = 65536


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a RST (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    blackholed: bool = False
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def abort(self) -> None:
        _abort(self.client)
        if self.upstream is not None:
            _abort(self.upstream)


class FaultProxy:
    """One listening port forwarding to ``target_host:target_port``."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        port: int = 0,
        name: str = "proxy",
        connect_timeout: float = 5.0,
    ) -> None:
        self.name = name
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.port = port
        self.connect_timeout = connect_timeout
        self.mode: Mode = "pass"
        self.latency = 0.0
        self.connections_total = 0
        self.bytes_forwarded = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        """Stop listening, abort every link, await every task (bounded)."""
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.abort()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connections(self) -> int:
        return len(self._links)

    # -- faults ------------------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Add `seconds` to each direction of every forwarded chunk (order is kept)."""
        self.latency = max(0.0, seconds)

    def blackhole(self) -> None:
        self.mode = "blackhole"
        self._flowing.set()
        for link in self._links:
            link.blackholed = True

    def stall(self) -> None:
        self.mode = "stall"
        self._flowing.clear()

    def reset(self) -> None:
        """Abort every open connection now (RST) and reset new ones until `heal()`."""
        self.mode = "reset"
        self._flowing.set()
        for link in list(self._links):
            link.abort()

    def heal(self) -> None:
        """Back to ``pass`` (latency kept): stalled streams resume, blackholed ones are reset."""
        self.mode = "pass"
        for link in list(self._links):
            if link.blackholed:
                link.abort()
        self._flowing.set()

    # -- forwarding --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        link = _Link(client=writer)
        self._links.add(link)
        self.connections_total += 1
        try:
            await self._serve(link, reader, writer)
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a reset or a closed peer ends the link: that is what faults are for
        except asyncio.CancelledError:
            link.abort()
            raise
        finally:
            self._links.discard(link)
            self._tasks.discard(task)
            if not writer.is_closing():
                writer.close()
            if link.upstream is not None and not link.upstream.is_closing():
                link.upstream.close()

    async def _serve(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.mode == "reset":
            link.abort()
            return
        if self.mode == "blackhole":
            link.blackholed = True
            await self._swallow(reader)
            return
        async with asyncio.timeout(self.connect_timeout):
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        link.upstream = up_w
        # The link ends when either direction ends; the other pump is cancelled and awaited.
        pumps = {
            asyncio.create_task(self._pump(link, reader, up_w)),
            asyncio.create_task(self._pump(link, up_r, writer)),
        }
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader) -> None:
        while await reader.read(_CHUNK):
            pass

    async def _pump(
        self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        """Copy src → dst honouring the mode; ends (raising) when either side closes."""
        while True:
            await self._flowing.wait()
            data = await src.read(_CHUNK)
            if not data:
                raise ConnectionResetError("peer closed")
            if self.latency > 0:
                await asyncio.sleep(self.latency)  # order is kept: one pump per direction
            await self._flowing.wait()  # a stall that began while reading holds the chunk
            if link.blackholed or self.mode == "blackhole":
                link.blackholed = True
                continue  # swallowed
            dst.write(data)
            self.bytes_forwarded += len(data)
            await dst.drain()


async def wait_for_port(host: str, port: int, within: float) -> None:
    """Poll until a TCP connect to host:port succeeds, or raise TimeoutError."""
    deadline = time.monotonic() + within
    while True:
        try:
            async with asyncio.timeout(1.0):
                _, w = await asyncio.open_connection(host, port)
            w.close()
            return
        except (OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} not reachable within {within} s") from None
            await asyncio.sleep(0.05)
