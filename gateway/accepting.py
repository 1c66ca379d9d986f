"""Taking connections off a listening socket as fast as they come (`Acceptor`).

libuv, under uvloop (which `gateway serve` runs on), accepts **one** connection each time a
listening socket is readable, once a turn of the event loop: measured, a loop busy serving
~1,000 connections turned every few milliseconds, so it accepted a few hundred connections
a second and the kernel's accept queue grew while it served. Clients whose connects wait
there are unseen by every cap, and once the queue is full the kernel drops their SYNs
(they retry after a second, then three...).

An `Acceptor` watches a duplicate of each listening socket (`watch`) and, each time it is
readable and the owner says there is room, accepts up to `ACCEPT_BATCH` connections from the
queue and hands each to the server's protocol factory as an accepted socket
(`loop.connect_accepted_socket`, TLS included), in a task it owns. The loop's own one-a-turn
accept goes on beside it: whichever of the two comes first takes a connection.
Used by both edges: the HTTP listener (`gateway.web.listener.ShedSite`) and the AMQP
listeners (`gateway.amqp.server`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import Protocol

from gateway.lifetimes import TaskSet

log = logging.getLogger(__name__)

# Connections taken from the accept queue each time a listening socket is readable: at this
# many a turn, a connect waits at most a turn of the loop.
ACCEPT_BATCH = 128

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class _Listening(Protocol):
    def fileno(self) -> int: ...


def _always() -> bool:
    return True


class Acceptor:
    """See the module docstring. `room` is asked before each connection: while it says no, the
    queue is left to the loop's own accept (one a turn), and to whatever rule the owner
    applies to the queue. `stop` forgets the sockets and waits for the hand-overs still
    running (a TLS handshake, bounded by its own timeout), cancelling only what outlives
    its bound."""

    __slots__ = ("_batch", "_name", "_room", "_tasks", "_watched")

    def __init__(
        self, name: str, *, room: Callable[[], bool] = _always, batch: int = ACCEPT_BATCH
    ) -> None:
        self._name = name
        self._room = room
        self._batch = batch
        self._watched: list[socket.socket] = []  # duplicates of the listening sockets
        self._tasks = TaskSet(f"{name} accepts")

    def watch(
        self,
        sockets: Iterable[_Listening],
        factory: ProtocolFactory,
        *,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
    ) -> None:
        """Accept from the listening `sockets` (a server's, as they are now) into
        `factory`'s protocols."""
        loop = asyncio.get_running_loop()
        for listening in sockets:
            sock = socket.socket(fileno=os.dup(listening.fileno()))
            sock.setblocking(False)
            loop.add_reader(
                sock.fileno(), self._accept, sock, factory, ssl_context, ssl_handshake_timeout
            )
            self._watched.append(sock)

    def unwatch(self) -> None:
        """Stop accepting (the listening sockets are the server's to close)."""
        loop = asyncio.get_running_loop()
        for sock in self._watched:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._watched.clear()

    @property
    def pending(self) -> int:
        """Connections taken and not yet handed over (a TLS handshake under way): an owner
        counting its connections against a cap counts these too, or a flood of connects
        that never finish their handshakes would be taken without bound."""
        return len(self._tasks)

    async def stop(self, within: float) -> None:
        """Stop accepting, let the hand-overs still running end within `within` seconds, and
        cancel only what is left then (a TLS handshake not finished). Never cancelled at
        once: uvloop's `connect_accepted_socket`, cancelled once the protocol has heard
        `connection_made` (its coroutine returns a turn of the loop later), closes the
        socket under the protocol without ever calling `connection_lost`; a request read
        in that turn was handled, and its answer could not be written (a message stored,
        its client told the server disconnected). A plain hand-over ends within a turn, a
        TLS one within its handshake timeout."""
        self.unwatch()
        await self._tasks.finish(within)

    def _accept(
        self,
        listening: socket.socket,
        factory: ProtocolFactory,
        ssl_context: ssl.SSLContext | None,
        ssl_handshake_timeout: float | None,
    ) -> None:
        for _ in range(self._batch):
            if not self._room():
                return
            try:
                conn, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return  # the queue is empty (the loop's own accept may have taken some)
            except OSError as exc:  # out of descriptors, say: the loop's accept says so too
                log.debug("accept on %s: %s", self._name, exc)
                return
            conn.setblocking(False)
            self._tasks.spawn(
                self._serve(conn, factory, ssl_context, ssl_handshake_timeout),
                name=f"{self._name} accepted connection",
            )

    async def _serve(
        self,
        conn: socket.socket,
        factory: ProtocolFactory,
        ssl_context: ssl.SSLContext | None,
        ssl_handshake_timeout: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            if ssl_context is None:
                await loop.connect_accepted_socket(factory, conn)
            else:
                await loop.connect_accepted_socket(
                    factory,
                    conn,
                    ssl=ssl_context,
                    ssl_handshake_timeout=ssl_handshake_timeout,
                )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            # A client gone, or a handshake that failed or timed out: the loop's own
            # listener logs these no louder (its transports close the socket themselves).
            log.debug("connection on %s not taken: %r", self._name, exc)
            conn.close()
        except BaseException:
            conn.close()
            raise
