"""A namespace's AMQP connections: a small, bounded pool that every sender link shares.

Why: the azure-servicebus SDK opens one AMQP connection per `ServiceBusSender` (its handler
creates a pyamqp `Connection` when it is given none). At four senders per entity that is
four connections per entity: Basic's 100 connections are gone at 25 entities, and each
connection costs a socket, buffers and a keep-alive task in this process.

How: the SDK's handlers already accept an external connection (`open_async(connection=...)`:
they then add their own session, `$cbs` token links and link to it, and leave the connection
open when they close) — the path the SDK keeps switched off (`_connection_sharing = False`)
because its own connection factory does not build a usable connection for pyamqp. Here the
pool builds the connection itself, exactly as the handler would (same SASL, TLS options,
properties and socket timeout, `connection_for`), and `bind` hands it to one sender: every
time that sender (re)opens its link, it first asks its slot for a live connection, so a
connection the broker dropped is replaced once and the SDK's own retry then succeeds on the
new one, as it would on a private connection. Its `$cbs` token links are the connection's
one pair, shared by every handler on it (`gateway.servicebus.internals.shared_cbs`, `Slot.cbs`): a
handler adds only its session and its link. Frames read by any handler on a connection are
dispatched by pyamqp to the session and link they belong to, so handlers polling one socket
in turn see each other's dispositions (tests/broker/test_pooled_links.py holds this to the
local broker).

One reader per connection. pyamqp has no reader task: every handler waiting for an answer
reads the socket itself (`connection.listen(wait=0.2)`), under the lock that also guards
writes. Shared by many links, that serializes them all behind whichever handler holds the
lock waiting for a frame that may not come for 0.2 s, even when its own answer was already
read by another. So each pooled connection gets its own reader task (`Slot._read`), owned
by its slot, which reads and dispatches every frame; a handler's `listen` only waits until
a frame for its own session was dispatched (or its own deadline) and then looks at its own
state — each handler sees the connection through a `_View` that knows its session, so a
frame wakes the one handler it is for, not every handler of the connection; and writes do
not take the read's lock, so a send never waits for a read (asyncio's stream reader and
writer are independent). The frames every handler writes in one loop turn leave in one
socket write (`_Coalescing`): over many entities each request is a TRANSFER on a link of
its own, and the turn that sends one usually sends several. A reader ends when its
connection fails; the handlers then see the connection's error, and the slot replaces the
connection on the next open. A reader that raises with its connection up is logged, counted
and started again (`supervised`).

Each slot opens its connection on first use; a link goes to the slot with the fewest links,
or to one with at most one link more that already holds a token for the link's entity
or a sender to it is bound (`Slot.holds`: its open then needs no put-token of its own,
`shared_cbs.Grant`).
Cancellation: `connection()` may be cancelled (the caller owns the deadline); a half-opened
connection is then closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import certifi
from azure.servicebus._common.utils import create_properties
from azure.servicebus._pyamqp._decode import decode_empty_frame, decode_frame
from azure.servicebus._pyamqp.aio import Connection
from azure.servicebus._pyamqp.aio._transport_async import AsyncTransport
from azure.servicebus._pyamqp.constants import AUTH_TYPE_CBS, ConnectionState
from azure.servicebus._pyamqp.error import AMQPConnectionError, ErrorCondition
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender
from azure.servicebus.aio._async_utils import create_authentication

from gateway.lifetimes import Backoff, TaskObserver, close_quietly, supervised
from gateway.servicebus.internals import pyamqp_sharing
from gateway.servicebus.internals.shared_cbs import OPEN_TIMEOUT, SharedCbs, open_shared

log = logging.getLogger(__name__)

# Our deadline on closing a connection (the caller's deadline bounds opening one).
_CLOSE_TIMEOUT = 5.0
# How long the reader waits for a frame before it looks at the connection again (idle
# connections: it also sends the empty frames that keep the peer's idle timer reset).
_READ_WAIT = 0.5
# A connection's frames waiting for their write past this many bytes (with what the socket
# has not taken yet): the writer flushes them at once and waits for the socket to drain.
_HIGH_WATER = 256 * 1024
# A reader that raised starts again after this long, doubling up to the cap: its handlers
# wait for it meanwhile.
_READER_BACKOFF = Backoff(0.05, 1.0)
# States in which a connection will not carry another frame.
_DEAD = frozenset(
    {
        ConnectionState.END,
        ConnectionState.CLOSE_RCVD,
        ConnectionState.CLOSE_SENT,
        ConnectionState.CLOSE_PIPE,
        ConnectionState.OC_PIPE,
        ConnectionState.DISCARDING,
    }
)


def _alive(conn: Connection) -> bool:
    return conn._error is None and conn.state not in _DEAD


class _Coalescing:
    """A pooled connection's writes: every frame written in one loop turn goes out in one
    socket write, whichever link or session wrote it.

    Why: spread over many entities, nearly every request is a TRANSFER of its own on a link
    of its own, and each was a socket write of its own (a system call, and a wake-up of the
    broker's reader for a single frame). Frames still leave in the order they were written
    (one buffer per connection, so each session's delivery ids stay in order), and each is
    committed when `write` is called: a writer cancelled afterwards cannot half-send one.

    `write` returns at once, as pyamqp's does when the socket takes the bytes; it waits only
    when the connection's buffered bytes pass `_HIGH_WATER` (then it flushes and drains, as
    pyamqp's `_write` does for every frame). The flush runs as the loop's next callback.
    A write that fails is what it is in pyamqp (`Connection._send_frame`): the connection's
    error (`AMQPConnectionError`, SocketError), which every handler on it raises from its
    next `listen` — the slot wakes them all (`fail`) — and the SDK's retry opens a new
    connection. Later writes raise at once."""

    __slots__ = ("_conn", "_fail", "_frames", "_scheduled", "_size", "_transport", "failure")

    def __init__(self, conn: Connection, fail: Callable[[], None]) -> None:
        self._conn: Any = conn
        self._transport: Any = conn._transport
        self._fail = fail
        self._frames: list[bytes] = []
        self._size = 0
        self._scheduled = False
        self.failure: OSError | None = None

    async def write(self, data: bytes) -> None:
        if self.failure is not None:  # a new instance: one raised again grows its traceback
            raise OSError(f"the connection failed: {self.failure}")
        writer = self._transport.writer
        if writer is None:
            raise OSError("Connection has already been closed")
        self._frames.append(data)
        self._size += len(data)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        if self._size + writer.transport.get_write_buffer_size() > _HIGH_WATER:
            self.flush()  # backpressure: the socket is behind
            try:
                await writer.drain()
            except OSError as exc:
                self._failed(exc)
                raise

    def flush(self) -> None:
        """Hand what was written to the socket, in one write (never raises)."""
        self._scheduled = False
        if not self._frames:
            return
        data = self._frames[0] if len(self._frames) == 1 else b"".join(self._frames)
        self._frames.clear()
        self._size = 0
        if self.failure is not None:
            return
        writer = self._transport.writer
        try:
            if writer is None or writer.transport.is_closing():
                raise ConnectionResetError("Connection lost")
            writer.write(data)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        if self.failure is not None:
            return
        self.failure = exc
        self._transport.connected = False
        if self._conn._error is None:  # as pyamqp's `_send_frame` records a failed write
            self._conn._error = AMQPConnectionError(
                ErrorCondition.SocketError,
                description="Can not send frame out due to exception: " + str(exc),
                error=exc,
            )
        self._fail()


def _coalesce_writes(conn: Connection, fail: Callable[[], None]) -> _Coalescing:
    """Give `conn`'s transport a `_Coalescing` writer (so a send never waits for a read, and
    frames written together leave together); its close sends what is still buffered
    first."""
    transport: Any = conn._transport
    writes = _Coalescing(conn, fail)
    close: Any = transport.close

    async def flushed_close() -> None:
        writes.flush()
        await close()

    transport.write = writes.write  # the instance's own attributes shadow the class's
    transport.close = flushed_close
    return writes


def _time_reads_cheaply(transport: Any) -> None:
    """`transport.receive_frame` as pyamqp's, its deadline kept with `asyncio.timeout`
    instead of `asyncio.wait_for`: in Python 3.11 the latter runs the read as a task of its
    own, one more task and loop turn for every frame the reader reads."""
    read: Any = transport.read

    async def receive_frame(
        timeout: float | None = None,  # noqa: ASYNC109 (pyamqp's signature)
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        try:
            async with asyncio.timeout(timeout):
                header, channel, payload = await read(**kwargs)
        except (TimeoutError, asyncio.IncompleteReadError):
            return None, None
        return channel, decode_frame(payload) if payload else decode_empty_frame(header)

    transport.receive_frame = receive_frame


class Slot:
    """One connection of the pool and the number of links bound to it."""

    def __init__(self, pool: ConnectionPool, index: int) -> None:
        self._pool = pool
        self.index = index
        self.links = 0
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._frame = asyncio.Event()  # set (and replaced) each time the reader dispatched
        # Each handler's view, by the session it began: who to wake for a session's frame
        # (and the shared `$cbs` pair's session, which wakes no handler by itself).
        self._views: weakref.WeakKeyDictionary[Any, _View | SharedCbs] = weakref.WeakKeyDictionary()
        self._cbs: SharedCbs | None = None  # the connection's `$cbs` pair (`shared_cbs`)
        self._cbs_lock = asyncio.Lock()
        # The senders bound here, by audience (their entity): gone once collected.
        self.bound: dict[str, weakref.WeakSet[ServiceBusSender]] = {}

    @property
    def reading(self) -> bool:
        return self._reader is not None and not self._reader.done()

    def view(self, conn: Connection) -> _View:
        """A new handler's view of `conn` (this slot's connection)."""
        return _View(self, conn)

    def holds(self, audience: str) -> bool:
        """Whether this connection has a token for `audience` put, or being put
        (`shared_cbs.Grant`), or a sender to it that will put one: a sender for it opens
        here with the attach alone."""
        bound = self.bound.get(audience)
        if bound is not None:
            if bound:  # another sender to it is opening (or open) here: it puts the token
                return True
            del self.bound[audience]
        shared = self._cbs
        return shared is not None and shared.usable and shared.holds(audience)

    def watch(self, session: Any, view: _View | SharedCbs) -> None:
        self._views[session] = view

    async def cbs(self, conn: Connection) -> SharedCbs | None:
        """The `$cbs` link pair of `conn` (this slot's connection) every handler on it puts
        its token over, opened on first use; None (the handler opens its own, as the SDK
        does) without a reader or when it failed to open within our deadline."""
        shared = self._cbs
        if shared is not None and shared.conn is conn and shared.usable:
            return shared
        if not self.reading or self._conn is not conn:
            return None
        async with self._cbs_lock:  # one opener; the others wait for its pair
            shared = self._cbs
            if shared is None or shared.conn is not conn or not shared.started or shared.failed:
                shared = self._cbs = SharedCbs(conn)
                self.watch(shared.session, shared)
                await shared.begin()
            elif shared.usable:
                return shared
            try:
                async with asyncio.timeout(OPEN_TIMEOUT):
                    if await shared.wait_open(self._next_frame):
                        return shared
            except TimeoutError:
                pass
            log.warning("namespace %s: connection %d has no $cbs pair", self._pool.name, self.index)
            self._cbs = None  # the next open tries a new one
            return None

    async def _next_frame(self) -> None:
        await self._frame.wait()

    @property
    def open(self) -> bool:
        return self._conn is not None and _alive(self._conn)

    async def connection(self) -> Connection:
        """A live connection: the current one, or a new one in place of a dead one."""
        conn = self._conn
        if conn is not None and _alive(conn):
            return conn
        async with self._lock:  # one opener per slot; the others wait for its connection
            conn = self._conn
            if conn is not None and _alive(conn):
                return conn
            self._conn = None
            await self._stop_reader()
            if conn is not None:
                await _close_quietly(conn)
            conn = await self._pool.connection_for(self.index)
            self._conn = conn
            self._start_reader(conn)
            return conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._cbs = None
        await self._stop_reader()
        if conn is not None:
            await _close_quietly(conn)

    def _start_reader(self, conn: Connection) -> None:
        """Give `conn` its reader, its handlers a `listen` that waits for it, and its writes
        a writer that sends a loop turn's frames together (see the module docstring). Only
        for the plain TCP/TLS transport; another one (AMQP over WebSockets) keeps pyamqp's
        own polling."""
        transport: Any = conn._transport
        if not isinstance(transport, AsyncTransport):
            return
        _coalesce_writes(conn, self._wake_all)
        _time_reads_cheaply(transport)
        patched: Any = conn
        read: Any = patched.listen  # pyamqp's own, for the reader
        patched.listen = self._listen_for(conn, read)
        patched._process_incoming_frame = self._waking(conn)
        self._reader = asyncio.create_task(
            supervised(
                "amqp_reader",
                lambda: self._read(conn, read),
                self._pool.observer,
                backoff=_READER_BACKOFF,
            ),
            name=f"amqp reader {self._pool.name}",
        )

    def _listen_for(self, conn: Connection, read: Any) -> Any:
        """A handler's `listen` on `conn`: wait for the reader's next dispatch (at most the
        handler's own wait), or read itself when the connection has no reader."""
        socket_timeout: Any = conn._socket_timeout

        async def listen(wait: float | bool = False, batch: int = 1, **kwargs: Any) -> None:
            if conn._error:
                raise conn._error
            if not self.reading:
                await read(wait=wait, batch=batch, **kwargs)
                return
            timeout = socket_timeout if wait is False or wait is True else wait
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._frame.wait()
            if conn._error:
                raise conn._error

        return listen

    def _waking(self, conn: Connection) -> Any:
        """`conn`'s frame dispatch, then a wake-up for the handler whose session the frame
        is for (looked up before: an END unmaps it; and after: a BEGIN answer maps it), or
        for every handler (connection frames, and sessions no view began)."""
        patched: Any = conn
        dispatch: Any = patched._process_incoming_frame
        incoming = patched._incoming_endpoints

        async def process(channel: int | None, frame: Any) -> Any:
            session = incoming.get(channel) if channel is not None else None
            try:
                return await dispatch(channel, frame)
            finally:
                if session is None and channel is not None:
                    session = incoming.get(channel)
                view = self._views.get(session) if session is not None else None
                if view is not None:
                    view.wake()
                elif frame is not None:
                    self._wake_all()

        return process

    async def _read(self, conn: Connection, read: Any) -> None:
        """The reader: read and dispatch `conn`'s frames until it fails or the slot stops it.
        A frame pyamqp failed to process, the connection still up, is a bug or a frame
        nobody foresaw: it raises, and `supervised` logs it, counts it
        (``sbgate_task_restarts_total{task="amqp_reader"}``) and starts the reader again
        shortly; the handlers wait for it meanwhile."""
        try:
            while not self._stopping and conn._error is None and conn.state not in _DEAD:
                await read(wait=_READ_WAIT)
                self._pulse()
        except Exception:
            if _alive(conn) and not self._stopping:
                raise
            # the connection failed: its handlers see its error
            log.debug("namespace %s: reader %d ended", self._pool.name, self.index)
        finally:
            self._wake_all()

    def _pulse(self) -> None:
        frame, self._frame = self._frame, asyncio.Event()
        frame.set()

    def _wake_all(self) -> None:
        for view in list(self._views.values()):
            view.wake()
        self._pulse()

    async def _stop_reader(self) -> None:
        """Stop the reader after its current read (at most `_READ_WAIT`): cancelling it
        mid-read can leave pyamqp's read waiting for its own cancelled read forever."""
        reader, self._reader = self._reader, None
        if reader is not None:
            self._stopping = True
            try:
                async with asyncio.timeout(_READ_WAIT + _CLOSE_TIMEOUT):
                    await asyncio.shield(reader)
            except TimeoutError:
                reader.cancel()  # our deadline: the connection is closed next anyway
                log.debug("namespace %s: reader %d did not stop", self._pool.name, self.index)
            finally:
                self._stopping = False


class _View:
    """One SDK handler's view of a pooled connection: the pyamqp `Connection` in everything
    but `listen`, which waits until the slot's reader dispatched a frame to a session this
    handler began (or to the connection), at most the handler's own wait."""

    def __init__(self, slot: Slot, conn: Connection) -> None:
        self._slot = slot
        self._conn: Any = conn
        self._event = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    @property
    def pooled_reading(self) -> bool:
        """Whether the slot's reader dispatches this connection's frames (`listen` then
        waits for a wake-up instead of reading): `lean` relies on it."""
        return self._slot.reading

    def create_session(self, **kwargs: Any) -> Any:
        session = self._conn.create_session(**kwargs)
        self._slot.watch(session, self)
        return session

    def wake(self) -> None:
        self._event.set()

    async def listen(self, wait: float | bool = False, batch: int = 1, **kwargs: Any) -> None:
        conn = self._conn
        if conn._error:
            raise conn._error
        if not self._slot.reading:
            await conn.listen(wait=wait, batch=batch, **kwargs)
            return
        timeout = conn._socket_timeout if wait is False or wait is True else wait
        if not self._event.is_set():
            # The wait's end is a wake-up of its own (one timer handle per wait: cheaper
            # than `asyncio.timeout`'s cancellation, and the caller looks at its state after
            # a wake-up anyway).
            timer = asyncio.get_running_loop().call_later(timeout, self._event.set)
            try:
                await self._event.wait()
            finally:
                timer.cancel()
        # Cleared before the handler looks at its state: a frame dispatched from here on
        # sets it again, so none is missed.
        self._event.clear()
        if conn._error:
            raise conn._error


class ConnectionPool:
    """Up to `size` AMQP connections to the namespace of `client`, shared by sender links.

    `bind(sender)` makes a new, unopened `ServiceBusSender` open its link on the pool;
    `unbind` gives the slot back when the sender is closed. `close` closes the connections
    (never raises); the senders must be closed first."""

    def __init__(
        self,
        client: ServiceBusClient,
        size: int,
        name: str,
        observer: TaskObserver | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a connection pool needs at least one connection")
        self._client = client
        self.name = name
        self.observer = observer  # counts the readers' restarts
        self._slots = [Slot(self, i) for i in range(size)]
        self._opened = itertools.count(1)
        # pyamqp shares a connection safely only once patched (the pinned SDK only, by the
        # app's wiring: `gateway.servicebus.internals.install`): until then, each sender keeps
        # the SDK's own connection.
        self.sharing = pyamqp_sharing.installed()

    @property
    def size(self) -> int:
        return len(self._slots)

    def open_connections(self) -> int:
        """Connections open now (for metrics and tests)."""
        return sum(1 for s in self._slots if s.open)

    def links(self) -> int:
        """Sender links bound to the pool now."""
        return sum(s.links for s in self._slots)

    def bind(self, sender: ServiceBusSender) -> Slot:
        """Attach `sender` (not opened yet) to the least loaded slot.

        Each time the SDK (re)opens the sender's link it gets the slot's live connection: the
        SDK's `_open` builds its credential and handler, then opens the handler on the
        connection we set (`open_handler_with_deadline(handler, sender._connection, ...)`)."""
        slot = min(self._slots, key=lambda s: s.links)
        audience = getattr(sender, "_auth_uri", None)
        if audience:  # its entity's token already on a connection: no put-token there
            held = [s for s in self._slots if s.holds(audience) and s.links <= slot.links + 1]
            if held:
                slot = min(held, key=lambda s: s.links)
            slot.bound.setdefault(audience, weakref.WeakSet()).add(sender)
            if len(slot.bound) > 2 * slot.links + 64:  # amortized: the closed ones' entries
                slot.bound = {a: live for a, live in slot.bound.items() if live}
        slot.links += 1
        if not self.sharing:
            return slot
        open_link = sender._open
        create_handler = sender._create_handler
        pending: list[_View] = []

        async def _open(timeout: float | None = None) -> None:  # noqa: ASYNC109 (the SDK's)
            if sender._running:
                return
            pending[:] = [slot.view(await slot.connection())]
            sender._connection = None  # so `_open` builds this link's own CBS auth
            await open_link(timeout)

        def _create_handler(auth: Any) -> None:
            create_handler(auth)
            sender._connection = pending[0] if pending else None
            _ready_at_once(sender._handler)
            _share_cbs(slot, sender._handler)

        patched: Any = sender  # instance attributes shadowing the SDK's methods
        patched._open = _open
        patched._create_handler = _create_handler
        return slot

    def unbind(self, slot: Slot) -> None:
        slot.links -= 1

    async def connection_for(self, index: int) -> Connection:
        """A new connection, opened (frames sent; the broker's answer is read by the first
        handler that polls it), built as the SDK's handler builds its own."""
        client: Any = self._client
        config = client._config
        auth = await create_authentication(client)  # type: ignore[no-untyped-call]
        if client._ssl_context:
            ssl_opts: dict[str, Any] = {"context": client._ssl_context}
        else:
            ssl_opts = {"ca_certs": client._connection_verify or certifi.where()}
        scheme = "amqps://" if config.use_tls else "amqp://"
        conn = Connection(
            scheme + config.hostname,
            sasl_credential=auth.sasl,
            ssl_opts=ssl_opts,
            container_id=f"sbgate-{self.name}-{index}-{uuid.uuid4().hex[:8]}",
            properties=create_properties(config.user_agent, amqp_transport=client._amqp_transport),
            network_trace=config.logging_enable,
            transport_type=config.transport_type,
            http_proxy=config.http_proxy,
            custom_endpoint_address=config.custom_endpoint_address,
            socket_timeout=config.socket_timeout,
            use_tls=config.use_tls,
        )
        try:
            await conn.open()
        except BaseException:
            await _close_quietly(conn)
            raise
        log.debug("namespace %s: connection %d opened (#%d)", self.name, index, next(self._opened))
        return conn

    async def close(self) -> None:
        await asyncio.gather(*(slot.close() for slot in self._slots))


def _ready_at_once(handler: Any) -> None:
    """Make `handler.client_ready_async` return only once the link is ready.

    The SDK opens a link by calling it until it answers True, sleeping 50 ms after each
    False: with the session, the `$cbs` exchange and the attach, four calls and ~150 ms of
    sleep per cold sender (docs/deploy.md#sizing). Every False path already waited for a
    frame (`listen`: here, for one to this handler's session), so looping at once costs no
    busy wait; the SDK's deadline around each call still bounds it (it is cancellable)."""
    ready: Any = handler.client_ready_async

    async def client_ready_async() -> bool:
        while not await ready():  # noqa: ASYNC110 (each False already waited for a frame)
            await asyncio.sleep(0)  # a yield, should one ever not have
        return True

    handler.client_ready_async = client_ready_async


def _share_cbs(slot: Slot, handler: Any) -> None:
    """Make `handler.open_async` put its token over its connection's shared `$cbs` pair
    (`gateway.servicebus.internals.shared_cbs`), or open its own where there is none."""
    open_async: Any = handler.open_async

    async def shared_open_async(connection: Any = None) -> None:
        if connection is None or handler._session or handler._auth.auth_type != AUTH_TYPE_CBS:
            await open_async(connection)
            return
        shared = await slot.cbs(connection._conn)
        if shared is None:
            await open_async(connection)
            return
        await open_shared(handler, connection, shared, lambda: slot.cbs(connection._conn))

    handler.open_async = shared_open_async


async def _close_quietly(conn: Connection) -> None:
    await close_quietly("closing a connection", conn.close(), _CLOSE_TIMEOUT)
