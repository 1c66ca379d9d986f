"""The AMQP 1.0 server: a python-qpid-proton reactor, one listener per namespace.

Thread model: the proton `Container` runs in one dedicated thread (`AmqpServer`). Every proton
object is touched only from that thread. Other threads act on the reactor through
`AmqpServer.call(fn)`, which queues ``fn`` and wakes the reactor through an `EventInjector`
pipe; the returned `concurrent.futures.Future` carries the result back. Namespace state
(`sblocal.store.Namespace`) has its own lock, so the HTTP threads may read it directly.

What the Service Bus SDKs need from a peer (docs/design.md, "What the SDK needs from a
broker") is implemented here: sender links whose transfers are settled accepted/rejected
with an error that always carries an ``info`` map, batches (several messages in data
sections), peek-lock deliveries tagged with the lock token and the settlement echo. SASL,
optional TLS and each transfer's message format are handled in front of proton (`front`);
the ``$cbs`` put-token (`cbs`) and the ``<entity>/$management`` operations (`operations`)
are answered by their own modules.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from proton import (
    Condition,
    Delivery,
    Endpoint,
    Handler,
    Link,
    Message,
    Terminus,
    Transport,
    symbol,
)
from proton._handlers import IOHandler
from proton._reactor import Acceptor
from proton.reactor import ApplicationEvent, Container, EventInjector

from sblocal import codec, sas
from sblocal.amqp import cbs, operations
from sblocal.amqp.front import BATCH_FORMAT, FrontLayer
from sblocal.faults import FaultRule, FaultTable
from sblocal.store import BrokerError, Entity, Namespace, StoredMessage, now_ms
from sblocal.store.sessions import not_sessionful

_log = logging.getLogger(__name__)


def _not_a_peer_gone(record: logging.LogRecord) -> bool:
    """proton logs "Couldn't send: BrokenPipeError(...)" (or recv, or a reset) at ERROR when a
    peer went away mid-write: for a broker that is a client closing its connection, which
    fault injection and every client shutdown do on purpose, and proton closes the transport
    either way. Such lines are dropped; any other proton line still comes through."""
    message = record.getMessage()
    return not (
        message.startswith("Couldn't")
        and any(e in message for e in ("BrokenPipeError", "ConnectionResetError"))
    )


logging.getLogger("proton").addFilter(_not_a_peer_gone)

_T = TypeVar("_T")

_INCOMING_CREDIT = 1000
_TRACKING_ID = symbol("com.microsoft:tracking-id")
_DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024
_MGMT_SUFFIX = "/$management"
_SESSION_FILTER = symbol("com.microsoft:session-filter")
_LOCKED_UNTIL_UTC = symbol("com.microsoft:locked-until-utc")
_OPERATION_TIMEOUT = symbol("com.microsoft:timeout")
# How long Service Bus holds a next-available-session attach when the client names no
# operation timeout: its default server wait time.
_DEFAULT_SESSION_WAIT_MS = 60_000
_DOTNET_EPOCH_TICKS = 621_355_968_000_000_000  # 0001-01-01 to 1970-01-01 in 100 ns ticks


@dataclass(slots=True)
class Latency:
    """Injected latency (milliseconds) applied before a send is settled."""

    round_trip_ms: float = 0.0
    store_ms: float = 0.0

    @property
    def total_s(self) -> float:
        return max(0.0, (self.round_trip_ms + self.store_ms) / 1000.0)


def _error_condition(name: str, description: str) -> Condition:
    # azure-servicebus raises inside on_send_complete (and the send never returns) when a
    # rejected outcome has no info map, so every error we send carries one.
    return Condition(name, description, {_TRACKING_ID: str(uuid.uuid4())})


class _Callback(Handler):
    """A reactor timer handler running one function."""

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__()
        self._fn = fn

    def on_timer_task(self, event: Any) -> None:
        try:
            self._fn()
        except Exception:
            _log.exception("timer callback failed")


class _FrontIOHandler(IOHandler):
    """proton's I/O handler, told that a socket's transport is its `FrontLayer`: proton
    updates a selectable from the transport an event names (the bare proton transport),
    which knows nothing of the bytes the front layer still has to write."""

    def on_transport(self, event: Any) -> None:
        t = event.transport
        s = t._selectable
        if s and not s.is_terminal:
            self.update(s._transport or t, s, t._reactor.now)


class _SaslAcceptor(Acceptor):
    """proton's Acceptor, with a `FrontLayer` (SASL, optional TLS, the message-format
    sniffer) between each accepted socket and a proton transport without SASL.

    The front layer has to exist before the transport produces its first bytes, i.e.
    before the connection is bound, which the stock Acceptor gives no hook for.
    """

    def __init__(
        self,
        reactor: Container,
        host: str,
        port: int,
        handler: Handler,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(reactor, host, port, handler)
        self._tls = tls

    def on_selectable_readable(self, event: Any) -> None:
        from proton._io import IO
        from proton._url import Url

        listener: Any = self._selectable
        sock, name = IO.accept(listener)
        reactor: Any = self._reactor
        handler = self._handler or reactor.handler
        conn: Any = reactor.connection(handler)
        conn._acceptor = self
        conn.url = Url(host=name[0], port=name[1])  # type: ignore[no-untyped-call]
        transport: Any = Transport(Transport.SERVER)
        transport.idle_timeout = 0
        front = FrontLayer(transport, self._tls)
        conn._sb_front = front
        transport.bind(conn)
        sel: Any = reactor.selectable(delegate=sock)
        sel._transport = front
        transport._selectable = sel
        IOHandler.update(front, sel, reactor.now)  # type: ignore[arg-type]

    @property
    def port(self) -> int:
        return int(self._selectable.getsockname()[1])


class NamespaceRuntime:
    """Reactor-side state of one namespace (reactor thread only, except the settings)."""

    def __init__(
        self, namespace: Namespace, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> None:
        self.namespace = namespace
        self.tls = tls  # AMQPS on the port when set, else plain AMQP
        self.faults = FaultTable()
        self.latency = Latency()
        self.host = host
        self.port = port
        self.acceptor: _SaslAcceptor | None = None
        self.connections: dict[int, Any] = {}  # connection id -> proton Connection
        self.receivers: dict[int, list[Any]] = {}  # id(Entity) -> sender links to clients
        # id(Entity) -> next-available-session attaches waiting for a session (unanswered)
        self.pending_sessions: dict[int, list[Any]] = {}
        self.session_links: dict[uuid.UUID, Any] = {}  # session lock owner -> its link
        self._conn_ids = 0

    @property
    def name(self) -> str:
        return self.namespace.name

    @property
    def up(self) -> bool:
        return self.acceptor is not None

    def next_conn_id(self) -> int:
        self._conn_ids += 1
        return self._conn_ids


class _NamespaceHandler(Handler):
    """Event handler of every connection accepted by one namespace's listener."""

    def __init__(self, server: AmqpServer, rt: NamespaceRuntime) -> None:
        super().__init__()
        self._server = server
        self._rt = rt
        self._ns = rt.namespace

    # -- connection / session lifecycle --------------------------------------------------

    def on_connection_remote_open(self, event: Any) -> None:
        conn = event.connection
        conn_id = self._rt.next_conn_id()
        conn._sb_id = conn_id
        conn._sb_replies = {}  # reply address (lower) -> sender link
        conn._sb_scopes = set()  # entity paths granted by $cbs tokens ('' = namespace)
        self._rt.connections[conn_id] = conn
        with self._ns.lock:
            self._ns.counters.connections += 1
            self._ns.counters.active_connections += 1
        conn.container = f"sblocal-{self._rt.name}"
        conn.open()

    def on_session_remote_open(self, event: Any) -> None:
        event.session.open()

    def on_session_remote_close(self, event: Any) -> None:
        event.session.close()

    def on_connection_remote_close(self, event: Any) -> None:
        event.connection.close()
        self._forget_connection(event.connection)

    def on_transport_closed(self, event: Any) -> None:
        conn = event.connection
        if conn is not None:
            self._forget_connection(conn)

    def _forget_connection(self, conn: Any) -> None:
        try:
            conn_id = conn._sb_id
        except AttributeError:
            return
        if self._rt.connections.pop(conn_id, None) is not None:
            with self._ns.lock:
                self._ns.counters.active_connections -= 1
        self.forget_links(conn_id)

    def forget_links(self, conn_id: int) -> None:
        """The receivers of a connection that ended (or that we closed) are forgotten."""
        gone: list[Any] = []
        for links in (*self._rt.receivers.values(), *self._rt.pending_sessions.values()):
            gone.extend(lk for lk in links if lk.connection._sb_id == conn_id)
            links[:] = [lk for lk in links if lk.connection._sb_id != conn_id]
        # Only now release the sessions they held: a released session is offered at once,
        # and must not go to another link of the same dead connection.
        for link in gone:
            self._unregister(link)

    def forget_sessions(self) -> None:
        """The namespace went down (every connection cut): every session lock held through
        it is released, after every receiver is forgotten, so that nothing is offered to a
        link of a cut connection."""
        self._rt.pending_sessions.clear()
        self._rt.receivers.clear()
        for link in list(self._rt.session_links.values()):
            self._unregister(link)

    # -- links ---------------------------------------------------------------------------

    def on_link_remote_open(self, event: Any) -> None:
        link = event.link
        try:
            if link.is_receiver:
                self._open_incoming(link)
            else:
                self._open_outgoing(link)
        except Exception:
            _log.exception("link attach failed")
            self._close_link(link, "amqp:internal-error", "The broker failed to attach the link.")

    def _open_incoming(self, link: Any) -> None:
        """The client sends on this link: entity sends, $cbs or $management requests."""
        address = link.remote_target.address or ""
        link.target.copy(link.remote_target)
        link.source.copy(link.remote_source)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link._sb_address = address
        if address == "$cbs":
            link._sb_kind = "cbs"
        elif address.lower().endswith(_MGMT_SUFFIX):
            link._sb_kind = "mgmt"
            link._sb_entity_path = Namespace.normalize(address)[: -len(_MGMT_SUFFIX)]
        else:
            link._sb_kind = "send"
            link._sb_entity_path = Namespace.normalize(address)
            target = self._ns.send_target(address)
            limit = target.message_size_limit if target is not None else _DEFAULT_MAX_MESSAGE_SIZE
            link.max_message_size = limit
        link.open()
        if link._sb_kind == "send" and not self._authorized(link):
            return
        link.flow(_INCOMING_CREDIT)

    def _open_outgoing(self, link: Any) -> None:
        """The client receives on this link: entity receivers, $cbs / $management replies."""
        address = link.remote_source.address or ""
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link._sb_address = address
        if address == "$cbs" or address.lower().endswith(_MGMT_SUFFIX):
            link._sb_kind = "reply"
            link._sb_tag = 0
            _register_reply(link)
            link.open()
            return
        link._sb_kind = "receive"
        link._sb_hung = False
        link._sb_session = None  # the session id a session receiver holds
        link._sb_owner = None  # its session lock owner id
        link._sb_peek_lock = link.remote_snd_settle_mode != Link.SND_SETTLED
        entity = self._ns.receive_source(address)
        session = _session_filter(link.remote_source)
        if session is None and not (entity is not None and entity.sessionful):
            link.open()
        # else the attach is answered once the receiver has a session, or refused (below)
        if not self._authorized(link):
            return
        if entity is None:
            path = Namespace.normalize(address)
            self._close_link(
                link,
                "amqp:not-found",
                f"The messaging entity '{self._rt.name}:{path}' could not be found.",
            )
            return
        link._sb_entity = entity
        if session is not None:
            self._open_session_receiver(link, entity, session[0])
            return
        if entity.sessionful:
            self._close_link(
                link,
                "amqp:not-allowed",
                f"It is not possible for an entity that requires sessions ('{entity.path}') "
                "to create a non-sessionful message receiver.",
            )
            return
        self._rt.receivers.setdefault(id(entity), []).append(link)

    def _open_session_receiver(self, link: Any, entity: Entity, session: str | None) -> None:
        """Lock the session a receiver asks for (`None`: the next available one). With no
        session available the attach stays unanswered until one is, or until the client's
        operation timeout (`com.microsoft:timeout`) passes, as Service Bus does."""
        if not entity.sessionful:
            err = not_sessionful(entity)
            self._close_link(link, err.condition, err.description)
            return
        owner = uuid.uuid4()
        link._sb_owner = owner
        try:
            accepted = self._ns.accept_session(entity, session, owner)
        except BrokerError as err:
            self._close_link(link, err.condition, err.description)
            return
        if accepted is None:
            wait_ms = _DEFAULT_SESSION_WAIT_MS
            props = link.remote_properties or {}
            if isinstance(props.get(_OPERATION_TIMEOUT), int):
                wait_ms = int(props[_OPERATION_TIMEOUT])
            link._sb_wait_until = now_ms() + wait_ms
            self._rt.pending_sessions.setdefault(id(entity), []).append(link)
            return
        self._attach_session(link, entity, *accepted)

    def _attach_session(self, link: Any, entity: Entity, session: str, locked_until: int) -> None:
        """Answer a session receiver's attach: the source's session filter names the session
        (how the SDK learns which one it got) and `locked-until-utc` its lock, in .NET ticks."""
        link._sb_session = session
        flt = link.source.filter
        flt.clear()
        flt.put_dict({_SESSION_FILTER: session})
        link.properties = {_LOCKED_UNTIL_UTC: _dotnet_ticks(locked_until)}
        link.open()
        self._rt.session_links[link._sb_owner] = link
        self._rt.receivers.setdefault(id(entity), []).append(link)

    def _grant_pending(self, entity: Entity) -> None:
        """Give waiting next-available-session receivers the sessions now available."""
        pending = self._rt.pending_sessions.get(id(entity))
        while pending:
            link = pending[0]
            if link.state & Link.REMOTE_CLOSED:
                pending.pop(0)
                continue
            accepted = self._ns.accept_session(entity, None, link._sb_owner)
            if accepted is None:
                return
            pending.pop(0)
            self._attach_session(link, entity, *accepted)

    def expire_sessions(self, now: int) -> None:
        """Housekeeping: detach receivers whose session lock lapsed, and answer waiting
        next-available-session attaches whose operation timeout passed."""
        owners, touched = self._ns.expire_sessions(now)
        for owner in owners:
            link = self._rt.session_links.get(owner)
            if link is not None:
                self._close_link(
                    link,
                    "com.microsoft:session-lock-lost",
                    f"The session lock on '{link._sb_session}' expired.",
                )
        for pending in list(self._rt.pending_sessions.values()):
            for link in [lk for lk in pending if lk._sb_wait_until <= now]:
                pending.remove(link)
                self._session_wait_timed_out(link)
        self._pump_all(touched)

    def _session_wait_timed_out(self, link: Any) -> None:
        # The SDK raises OperationTimeoutError from the receiver's open.
        self._close_link(
            link,
            "com.microsoft:timeout",
            "The operation did not complete within the allotted timeout: no session was "
            "available to accept.",
        )

    def _authorized(self, link: Any) -> bool:
        """Whether a token put on this connection's `$cbs` covers the link's entity."""
        if not self._ns.config.keys:
            return True
        path = Namespace.normalize(link._sb_address)
        if any(sas.covers(granted, path) for granted in link.connection._sb_scopes):
            return True
        self._close_link(
            link,
            "amqp:unauthorized-access",
            f"Unauthorized access: no valid token for '{path}' was put on the $cbs node of "
            "this connection.",
        )
        return False

    def on_link_remote_close(self, event: Any) -> None:
        link = event.link
        self._unregister(link)
        link.close()

    def _unregister(self, link: Any) -> None:
        try:
            kind = link._sb_kind
        except AttributeError:
            return
        if kind == "receive":
            try:
                entity = link._sb_entity
            except AttributeError:
                return
            links = self._rt.receivers.get(id(entity), [])
            self._rt.receivers[id(entity)] = [lk for lk in links if lk is not link and lk != link]
            self._release_session(link, entity)
        elif kind == "reply":
            for key in link._sb_reply_keys:
                for replies in (_replies(link.session), link.connection._sb_replies):
                    if replies.get(key) is link:
                        replies.pop(key, None)

    def _release_session(self, link: Any, entity: Entity) -> None:
        """A session receiver went away: its pending attach is dropped, the session it held
        released, and the session offered to whoever waits for one."""
        owner: uuid.UUID | None = link._sb_owner
        if owner is None:
            return
        link._sb_owner = None  # once: a link is unregistered on every path that ends it
        pending = self._rt.pending_sessions.get(id(entity))
        if pending is not None and link in pending:
            pending.remove(link)
        if self._rt.session_links.get(owner) is link:
            del self._rt.session_links[owner]
        session: str | None = link._sb_session
        if session is not None and self._ns.release_session(entity, session, owner):
            self.pump(entity)

    def _close_link(self, link: Any, condition: str, description: str) -> None:
        self._unregister(link)
        if link.state & Endpoint.LOCAL_UNINIT:
            # An attach refused before it was answered (a session receiver's): as Service
            # Bus does, the answer has no source nor target, and the detach carries the
            # error, which the SDK then raises from the receiver's open.
            link.source.type = Terminus.UNSPECIFIED
            link.target.type = Terminus.UNSPECIFIED
        link.condition = _error_condition(condition, description)
        link.close()

    def on_link_flow(self, event: Any) -> None:
        link = event.link
        try:
            self._on_flow(link)
        except Exception:
            # A bug here must not stop the reactor (and every namespace with it).
            _log.exception("flow handling failed on %s", getattr(link, "_sb_address", "?"))
            self._close_link(link, "amqp:internal-error", "The broker failed the receive.")

    def _on_flow(self, link: Any) -> None:
        if not link.is_sender:
            return
        try:
            kind = link._sb_kind
        except AttributeError:
            return
        if kind != "receive":
            return
        try:
            entity: Entity = link._sb_entity
        except AttributeError:
            return
        if link.credit > 0 and not link.drain_mode:
            with self._ns.lock:
                self._ns.counters.receives += 1
            rule = self._rt.faults.take(entity.path, "receive") if self._rt.faults else None
            if rule is not None:
                self._apply_receive_fault(link, rule)
                return
            try:
                self._ns.check_receivable(entity)
            except BrokerError as err:
                self._close_link(link, err.condition, err.description)
                return
        self.pump(entity)
        if link.drain_mode and link.credit > 0:
            link.drained()

    def _apply_receive_fault(self, link: Any, rule: FaultRule) -> None:
        with self._ns.lock:
            self._ns.counters.faults_applied += 1
        if rule.mode == "hang":
            link._sb_hung = True
            return
        self._close_link(link, rule.condition, rule.description)

    # -- deliveries ----------------------------------------------------------------------

    def on_delivery(self, event: Any) -> None:
        delivery = event.delivery
        link = delivery.link
        try:
            if link.is_receiver:
                if delivery.partial or not delivery.readable:
                    return
                data = link.recv(delivery.pending)
                link.advance()
                kind = getattr(link, "_sb_kind", "send")
                # Asked for every delivery, so that the sniffer forgets each one.
                message_format = link.connection._sb_front.sniffer.message_format(
                    link.name, delivery
                )
                if kind == "cbs":
                    self._on_cbs(link, delivery, data)
                elif kind == "mgmt":
                    self._on_management(link, delivery, data)
                else:
                    self._on_send(link, delivery, data, message_format)
                if link.state & Link.LOCAL_ACTIVE and link.credit < _INCOMING_CREDIT // 2:
                    link.flow(_INCOMING_CREDIT - link.credit)
            elif delivery.updated:
                self._on_settlement(link, delivery)
        except Exception:
            _log.exception("delivery handling failed on %s", getattr(link, "_sb_address", "?"))
            if link.is_receiver and not delivery.settled:
                self._reject(delivery, "amqp:internal-error", "The broker failed the operation.")

    def _reject(self, delivery: Any, condition: str, description: str) -> None:
        delivery.local.condition = _error_condition(condition, description)
        delivery.update(Delivery.REJECTED)
        delivery.settle()

    def _accept(self, delivery: Any) -> None:
        delivery.update(Delivery.ACCEPTED)
        delivery.settle()

    def _on_send(self, link: Any, delivery: Any, data: bytes, message_format: int) -> None:
        if link.connection.state & Endpoint.LOCAL_CLOSED:
            # We closed this connection (drop-connections): like Service Bus, nothing that
            # arrives after our close is stored; the client sees the close, not an outcome.
            return
        path: str = link._sb_entity_path
        rule = self._rt.faults.take(path, "send") if self._rt.faults else None
        lose_outcome = rule is not None and rule.mode == "lose-outcome"
        if lose_outcome:
            with self._ns.lock:
                self._ns.counters.faults_applied += 1
        elif rule is not None:
            with self._ns.lock:
                self._ns.counters.faults_applied += 1
                self._ns.counters.rejected_sends += 1
            if rule.mode == "hang":
                return  # accepted on the wire, never settled: the client waits forever
            if rule.mode == "detach":
                self._close_link(link, rule.condition, rule.description)
                return
            self._reject(delivery, rule.condition, rule.description)
            return
        target = self._ns.send_target(path)
        if target is None:
            with self._ns.lock:
                self._ns.counters.rejected_sends += 1
            self._reject(
                delivery,
                "amqp:not-found",
                f"The messaging entity '{self._rt.name}:{path}' could not be found.",
            )
            return
        try:
            inner = codec.split_batch(data) if message_format == BATCH_FORMAT else None
            raw = inner if inner is not None else [data]
            limit = target.message_size_limit
            if inner is not None and len(data) > limit:
                raise BrokerError(
                    "amqp:link:message-size-exceeded",
                    f"The received batch (size {len(data)} bytes) exceeds the limit "
                    f"({limit} bytes) currently allowed on the link.",
                )
            parsed = [codec.parse_message(m) for m in raw]
            result = self._ns.enqueue(target, parsed, [len(m) for m in raw])
        except codec.CodecError as exc:
            with self._ns.lock:
                self._ns.counters.rejected_sends += 1
            self._reject(delivery, "amqp:decode-error", str(exc))
            return
        except BrokerError as err:
            with self._ns.lock:
                self._ns.counters.rejected_sends += 1
            self._reject(delivery, err.condition, err.description)
            return
        delay = self._rt.latency.total_s
        if lose_outcome:
            pass  # stored, and never settled: the client cannot know it was
        elif delay > 0:
            # Never block the reactor: settle from a timer.
            self._server.container.schedule(delay, _Callback(lambda: self._settle_late(delivery)))
        else:
            self._accept(delivery)
        self._pump_all(result.touched)

    def _settle_late(self, delivery: Any) -> None:
        if delivery.settled or delivery.link.state & Link.LOCAL_CLOSED:
            return
        self._accept(delivery)

    # -- sending to receivers ------------------------------------------------------------

    def _pump_all(self, entities: list[Entity]) -> None:
        seen: set[int] = set()
        for entity in entities:
            if id(entity) not in seen:
                seen.add(id(entity))
                self.pump(entity)

    def pump(self, entity: Entity) -> None:
        """Hand available messages to the receivers of ``entity`` that have credit; on a
        sessionful entity each receiver gets its own session's messages only."""
        if self._rt.pending_sessions.get(id(entity)):
            self._grant_pending(entity)
        links = self._rt.receivers.get(id(entity))
        if not links:
            return
        progress = True
        while progress:
            progress = False
            for link in links:
                if link.credit <= 0 or link._sb_hung or not link.state & Link.LOCAL_ACTIVE:
                    continue
                session = link._sb_session
                msg = self._ns.take(
                    entity, lock=link._sb_peek_lock, session=session, owner=link._sb_owner
                )
                if msg is None:
                    if session is None:
                        return  # the entity has nothing for anyone
                    continue
                self._deliver(link, msg)
                progress = True

    def _deliver(self, link: Any, msg: StoredMessage) -> None:
        token = msg.lock_token
        tag = token.bytes_le if token is not None else uuid.uuid4().bytes_le
        delivery = link.delivery(tag)
        delivery._sb_token = token
        link.send(msg.encode(with_lock=token is not None))
        link.advance()
        if token is None:
            delivery.settle()

    def _on_settlement(self, link: Any, delivery: Any) -> None:
        kind = getattr(link, "_sb_kind", None)
        if kind != "receive":
            delivery.settle()  # replies to $cbs / $management
            return
        token: uuid.UUID | None = getattr(delivery, "_sb_token", None)
        entity: Entity = link._sb_entity
        state = delivery.remote_state
        if token is None or state is None:
            delivery.settle()
            return
        outcome = state
        condition: Condition | None = None
        ready = False
        try:
            if state == Delivery.ACCEPTED:
                self._ns.complete(entity, token)
            elif state == Delivery.RELEASED:
                ready = self._ns.abandon(entity, token, count=False)
            elif state == Delivery.MODIFIED:
                remote = delivery.remote
                if remote.undeliverable:
                    self._ns.defer(entity, token)
                else:
                    ready = self._ns.abandon(entity, token, count=remote.failed)
            elif state == Delivery.REJECTED:
                cond = delivery.remote.condition
                info = dict(cond.info or {}) if cond is not None else {}
                reason = codec.to_text(info.get("DeadLetterReason"))
                description = codec.to_text(info.get("DeadLetterErrorDescription"))
                if description is None and cond is not None:
                    description = cond.description
                self._ns.dead_letter(entity, token, reason, description)
        except BrokerError as err:
            outcome = Delivery.REJECTED
            condition = _error_condition(err.condition, err.description)
        # azure-servicebus >= 7.15 sends the outcome unsettled and waits for the broker to
        # echo it, settled; without the echo every complete() blocks for 60 s.
        if not delivery.settled:
            if condition is not None:
                delivery.local.condition = condition
            delivery.update(outcome)
            delivery.settle()
        if ready:
            self.pump(entity)

    # -- $cbs ----------------------------------------------------------------------------

    def _on_cbs(self, link: Any, delivery: Any, data: bytes) -> None:
        request = Message()
        request.decode(data)
        self._accept(delivery)
        reply, granted = cbs.put_token(self._ns, request)
        if granted is not None:
            link.connection._sb_scopes.add(granted)
        self._reply(link, request.reply_to or "$cbs", reply)

    def _reply(self, request_link: Any, address: str, reply: Message) -> None:
        """Send `reply` on the reply link `address` names (the request's reply-to, else the
        node's own address): the one in the request's session, else the connection's latest
        (Node and .NET put their reply link in a session of its own)."""
        key = address.lower()
        conn = request_link.connection
        link = _replies(request_link.session).get(key) or conn._sb_replies.get(key)
        if link is None:
            _log.warning("no reply link %r on connection %s", address, conn._sb_id)
            return
        link._sb_tag += 1
        delivery = link.delivery(str(link._sb_tag))
        link.send(reply.encode())
        link.advance()
        if link.snd_settle_mode == Link.SND_SETTLED:
            delivery.settle()

    # -- $management ---------------------------------------------------------------------

    def _on_management(self, link: Any, delivery: Any, data: bytes) -> None:
        request = Message()
        request.decode(data)
        self._accept(delivery)
        reply = operations.reply(self._ns, request, link._sb_entity_path, self.pump)
        self._reply(link, request.reply_to or link._sb_address, reply)


class _ReactorHandler(Handler):
    """Container-level events: cross-thread calls and the housekeeping timer."""

    def __init__(self, server: AmqpServer) -> None:
        super().__init__()
        self._server = server

    def on_sblocal_call(self, event: Any) -> None:
        self._server._run_calls()

    def on_timer_task(self, event: Any) -> None:
        self._server._housekeeping()


class AmqpServer:
    """Owns the proton reactor thread and every namespace's listener."""

    def __init__(self, runtimes: list[NamespaceRuntime], *, housekeeping_interval: float) -> None:
        self.runtimes = {rt.name: rt for rt in runtimes}
        self._interval = housekeeping_interval
        self._handler = _ReactorHandler(self)
        self.container = Container(self._handler, global_handler=_FrontIOHandler())
        self._ns_handlers = {rt.name: _NamespaceHandler(self, rt) for rt in runtimes}
        self._injector = EventInjector()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle (caller's thread) -------------------------------------------------------

    def start(self) -> None:
        """Bind every listener (raising OSError if a port is taken), then run the reactor."""
        for rt in self.runtimes.values():
            self._listen(rt)
        self.container.selectable(self._injector)
        self.container.schedule(self._interval, self._handler)
        self._thread = threading.Thread(target=self._run, name="sblocal-amqp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.container.run()
        except Exception:
            _log.exception("the AMQP reactor stopped on an error")
        finally:
            # Nobody waits forever on a call the dead reactor will never run.
            while True:
                try:
                    _, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                fut.set_exception(RuntimeError("the AMQP reactor is not running"))

    def stop(self, timeout: float = 5.0) -> None:
        """Close listeners and connections and stop the reactor thread (blocking)."""
        if self._thread is None or not self._thread.is_alive():
            return

        def shutdown() -> None:
            self._stopping = True
            for rt in self.runtimes.values():
                self._down(rt)
            self._injector.close()
            self.container.stop()

        try:
            self.call(shutdown).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            _log.warning("the AMQP reactor did not stop cleanly")
        self._thread.join(timeout)

    def call(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Run ``fn`` on the reactor thread; thread-safe."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():
            fut.set_exception(RuntimeError("the AMQP reactor is not running"))
            return fut
        self._calls.put((fn, fut))
        self._injector.trigger(ApplicationEvent("sblocal_call"))
        return fut

    # -- reactor thread --------------------------------------------------------------------

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _housekeeping(self) -> None:
        if self._stopping:
            return
        try:
            now = now_ms()
            for name, rt in self.runtimes.items():
                touched = rt.namespace.housekeeping(now)
                handler = self._ns_handlers[name]
                handler._pump_all(touched)
                handler.expire_sessions(now)
        except Exception:
            _log.exception("housekeeping failed")
        self.container.schedule(self._interval, self._handler)

    def _listen(self, rt: NamespaceRuntime) -> None:
        acceptor = _SaslAcceptor(
            self.container, rt.host, rt.port, self._ns_handlers[rt.name], rt.tls
        )
        rt.acceptor = acceptor
        rt.port = acceptor.port

    def _down(self, rt: NamespaceRuntime) -> None:
        if rt.acceptor is not None:
            rt.acceptor.close()
            rt.acceptor = None
        for conn in list(rt.connections.values()):
            _cut(conn)
        rt.connections.clear()
        self._ns_handlers[rt.name].forget_sessions()
        with rt.namespace.lock:
            rt.namespace.counters.active_connections = 0

    def pump_namespace(self, name: str) -> None:
        """Reactor thread: offer messages to every receiver of a namespace."""
        rt = self.runtimes[name]
        handler = self._ns_handlers[name]
        for entity in rt.namespace.all_entities():
            if isinstance(entity, Entity):
                handler.pump(entity)
                if entity.dlq is not None:
                    handler.pump(entity.dlq)

    # -- control operations (any thread; they run on the reactor) ------------------------

    def down(self, name: str) -> concurrent.futures.Future[None]:
        return self.call(lambda: self._down(self.runtimes[name]))

    def up(self, name: str) -> concurrent.futures.Future[None]:
        def bring_up() -> None:
            rt = self.runtimes[name]
            if rt.acceptor is None:
                self._listen(rt)

        return self.call(bring_up)

    def drop_connections(self, name: str) -> concurrent.futures.Future[int]:
        def drop() -> int:
            rt = self.runtimes[name]
            conns = list(rt.connections.values())
            for conn in conns:
                conn.condition = _error_condition(
                    "amqp:connection:forced",
                    "The connection was closed by the broker (control API).",
                )
                conn.close()
                # Its links are dead from now on, whenever the client answers the close:
                # the sessions they held are free again, as on Service Bus.
                self._ns_handlers[name].forget_links(conn._sb_id)
            return len(conns)

        return self.call(drop)

    def census(self, name: str) -> concurrent.futures.Future[dict[str, int]]:
        """What clients hold open on a namespace now: connections, sessions, links (every
        kind), and the links clients send messages on (``send_links``)."""

        def count() -> dict[str, int]:
            rt = self.runtimes[name]
            sessions = links = send_links = 0
            active = Endpoint.LOCAL_ACTIVE | Endpoint.REMOTE_ACTIVE
            for conn in rt.connections.values():
                session = conn.session_head(active)
                while session is not None:
                    sessions += 1
                    session = session.next(active)
                link = conn.link_head(active)
                while link is not None:
                    links += 1
                    if getattr(link, "_sb_kind", None) == "send":
                        send_links += 1
                    link = link.next(active)
            return {
                "connections": len(rt.connections),
                "sessions": sessions,
                "links": links,
                "send_links": send_links,
            }

        return self.call(count)

    def wake(self, name: str) -> None:
        """Any thread: messages may have become deliverable in this namespace."""
        if self._thread is not None and self._thread.is_alive():
            self.call(lambda: self.pump_namespace(name))


def _register_reply(link: Any) -> None:
    """File a `$cbs` / `$management` reply link under every name a request's reply-to may
    use for it: Python sends no reply-to (the node's address is the key), Node's reply-to is
    its receiver's link name, .NET's its receiver's target address."""
    keys = {link._sb_address.lower(), link.name.lower()}
    target = link.remote_target.address
    if target:
        keys.add(target.lower())
    link._sb_reply_keys = keys
    for key in keys:
        _replies(link.session)[key] = link
        link.connection._sb_replies[key] = link


def _session_filter(source: Any) -> tuple[str | None] | None:
    """A receiver's session filter: None for a plain receiver, else a 1-tuple of the session
    id it asks for (None inside: the next available session)."""
    flt = source.filter
    if flt is None:
        return None
    flt.rewind()
    if not flt.next():
        return None
    filters = flt.get_object()
    if not isinstance(filters, dict) or _SESSION_FILTER not in filters:
        return None
    value = filters[_SESSION_FILTER]
    return (codec.to_text(value) if value is not None else None,)


def _dotnet_ticks(ms: int) -> int:
    """Unix milliseconds as .NET ticks, the unit of `com.microsoft:locked-until-utc`."""
    return ms * 10_000 + _DOTNET_EPOCH_TICKS


def _replies(session: Any) -> dict[str, Any]:
    """The reply links (by address, lower case) attached in `session`."""
    try:
        replies: dict[str, Any] = session._sb_replies
    except AttributeError:
        replies = session._sb_replies = {}
    return replies


def _cut(conn: Any) -> None:
    """Drop a connection's socket without an AMQP close, like a network failure."""
    transport = conn.transport
    if transport is None:
        return
    sel = getattr(transport, "_selectable", None)
    transport.close_head()
    transport.close_tail()
    if sel is not None and not sel.is_terminal:
        sel.terminate()
        sel._transport = None
        transport._selectable = None
        sel.update()
