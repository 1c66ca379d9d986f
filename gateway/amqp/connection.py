"""One AMQP connection: an asyncio `Protocol` driving a sans-IO `sbamqp.engine.ServerConnection`.

Bytes in go to the engine; its events are answered here; its bytes out go to the socket, at
once. What each event becomes:

* a sender link to an entity is accepted (with `max-message-size` and the vendor batch
  size) and given credit; a sender or receiver link on ``$cbs`` or ``<entity>/$management``
  carries requests and their replies; any other receiver, and a transaction coordinator, is
  refused `amqp:not-implemented`;
* a transfer to an entity is one send request (`gateway.ingest`), run as its own task owned
  here, and settled with its outcome when it is done: `accepted` (stored, at the primary or
  in a backlog queue) or `rejected` with the condition of the error table
  (`gateway.errors.amqp_rejection`);
* a ``$cbs`` put-token is checked by `Grants`; a management request is answered 501.

Credit: each sender link has up to ``link_credit`` deliveries in flight, topped up as they
settle while the dispatcher's admission has room, and never left without one when it has
none in flight (`_replenish`). A connection lost with sends in flight lets them finish (their
outcome is recorded; nobody is left to tell); `close` waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from gateway.amqp import management, messages
from gateway.amqp.auth import Grants
from gateway.core.entities import EntityRef
from gateway.core.message import OutboundMessage, random_id
from gateway.errors import Draining, GatewayError, Overloaded, PayloadTooLarge, amqp_rejection
from gateway.ingest import Outcome, ingest, record_outcome
from gateway.lifetimes import stop_after
from sbamqp import conventions, sections
from sbamqp.addresses import entity_path, reply_link
from sbamqp.codec import DecodeError, Described, Int, Symbol, Ulong, decode
from sbamqp.conventions import Condition
from sbamqp.engine import (
    Closed,
    Event,
    Limits,
    Link,
    LinkAttached,
    LinkDetached,
    Opened,
    ProtocolViolation,
    ServerConnection,
    SessionEnded,
    Transfer,
    TransferRefused,
)
from sbamqp.performatives import Accepted, DeliveryState, Error, Rejected, TransactionalState

if TYPE_CHECKING:
    from gateway.amqp.server import AmqpServer

log = logging.getLogger(__name__)

SENDERS_ONLY = management.SENDERS_ONLY
_MANAGEMENT_SUFFIX = "/" + conventions.MANAGEMENT_NODE
# Credit on the request links ($cbs, $management): a client sends one request at a time.
_REQUEST_CREDIT = 8
_TRACKING_ID = Symbol(conventions.VENDOR_TRACKING_ID)


@dataclass(slots=True)
class _EntityLink:
    """A client's sender link to an entity: what its deliveries need."""

    link: Link
    name: str  # the entity path as the target names it
    in_flight: int = 0


class AmqpConnection(asyncio.Protocol):
    """One client connection (see the module docstring). Created by `AmqpServer`."""

    def __init__(self, server: AmqpServer, listener: str) -> None:
        self._server = server
        self._listener = listener  # "tls" or "plain", for the log
        self._transport: asyncio.Transport | None = None
        self._engine: ServerConnection | None = None
        self._grants = Grants(server.authorizer)
        self._entity_links: dict[int, _EntityLink] = {}  # by id(link)
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._flush_handle: asyncio.Handle | None = None
        # The loop, kept: asyncio.get_running_loop() costs a getpid() syscall per call on
        # CPython 3.11, and a delivery asked for it several times.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opened_at = 0.0
        self._peer = "?"
        self.closing = False  # draining or aged: no more credit, closed when idle
        self.lost = asyncio.Event()

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is one without subclassing asyncio.Transport).
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        now = self._now()
        self._opened_at = now
        self._engine = ServerConnection(self._server.limits, now=now)
        if not self._server.admit(self):
            # Over the connection cap: the AMQP header and a close are all it gets.
            transport.close()
            return
        self._schedule()

    def data_received(self, data: bytes) -> None:
        engine = self._engine
        if engine is None:
            return
        self._handle(engine.receive_data(data, self._now()))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._transport = None
        self.lost.set()
        self._server.forget(self, self._tasks)

    def pause_writing(self) -> None:
        # The client does not read its answers: stop reading its requests meanwhile.
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    # -- the engine's events ----------------------------------------------------------

    def _handle(self, events: list[Event]) -> None:
        engine = self._engine
        assert engine is not None
        for event in events:
            if isinstance(event, Transfer):
                self._on_transfer(event)
            elif isinstance(event, LinkAttached):
                self._on_attach(event.link)
            elif isinstance(event, Opened):
                self._on_open(event)
            elif isinstance(event, LinkDetached):
                self._entity_links.pop(id(event.link), None)
            elif isinstance(event, SessionEnded):
                for state in list(self._entity_links.values()):
                    if state.link.session is event.session:
                        del self._entity_links[id(state.link)]
            elif isinstance(event, TransferRefused):
                self._refused_at_engine(event)
            elif isinstance(event, ProtocolViolation):
                log.info(
                    "AMQP connection %s: %s: %s", self._peer, event.condition, event.description
                )
            elif isinstance(event, Closed) and event.error is not None:
                log.debug("AMQP connection %s closed by the peer: %s", self._peer, event.error)
        self._flush()

    def _on_open(self, event: Opened) -> None:
        engine = self._engine
        assert engine is not None
        if event.hostname and not self._server.serves_host(event.hostname):
            engine.close(
                Condition.UNAUTHORIZED_ACCESS,
                f"this gateway does not serve host {event.hostname[:200]!r} (public_hosts)",
            )

    def _on_attach(self, link: Link) -> None:
        engine = self._engine
        assert engine is not None
        observer = self._server.edge.observer
        if link.is_coordinator:
            observer.amqp_refused("link")
            engine.refuse_link(link, Condition.NOT_IMPLEMENTED, "transactions: " + SENDERS_ONLY)
            return
        if link.is_server_sender:  # the client receives
            source = link.source_address or ""
            if _is_request_node(source):
                engine.accept_attach(link)
            else:
                observer.amqp_refused("link")
                engine.refuse_link(link, Condition.NOT_IMPLEMENTED, SENDERS_ONLY)
            return
        target = link.target_address or ""
        if _is_request_node(target):
            engine.accept_attach(link)
            engine.grant_credit(link, _REQUEST_CREDIT)
            return
        limits = self._server.settings_limits
        engine.accept_attach(
            link,
            max_message_size=self._server.limits.max_message_size,
            properties={
                Symbol(conventions.VENDOR_MAX_MESSAGE_BATCH_SIZE): Ulong(limits.max_batch_bytes)
            },
        )
        state = _EntityLink(link, entity_path(target))
        self._entity_links[id(link)] = state
        self._replenish(state)

    def _on_transfer(self, event: Transfer) -> None:
        link = event.link
        state = self._entity_links.get(id(link))
        if state is None:
            target = link.target_address or ""
            if entity_path(target) == conventions.CBS_NODE:
                self._on_cbs_request(event)
            elif _is_request_node(target):
                self._on_management_request(event)
            elif not event.settled:
                self._settle(link, event.delivery_id, _rejected(Condition.NOT_FOUND, "no link"))
            return
        if isinstance(event.state, TransactionalState):
            self._settle(
                link,
                event.delivery_id,
                _rejected(Condition.NOT_IMPLEMENTED, "transactions: " + SENDERS_ONLY),
            )
            return
        server = self._server
        size = len(event.payload)
        if self.closing:
            # Credit went to 0 (a drain) while this delivery was on its way.
            self._refuse(state, event, Draining("the gateway is closing this connection"))
            return
        if event.over_credit:
            # A client sent past the credit (the Python SDK, out of credit, resets its own
            # count and sends).
            why = "a delivery past the link's credit: the gateway is at its limit; retry later"
            self._refuse(state, event, Overloaded(why))
            return
        if server.held_bytes + size > server.held_bytes_cap and server.held_bytes:
            why = "the gateway holds its limit of deliveries in flight; retry later"
            self._refuse(state, event, Overloaded(why))
            return
        server.held_bytes += size
        state.in_flight += 1
        task = self._loop_().create_task(
            self._deliver(state, event), name=f"amqp delivery {event.delivery_id:d}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if link.credit == 0:
            # Topped up here only when used up: otherwise at the settlement (`_deliver`),
            # where the flow rides in the disposition's write instead of a write of its own.
            self._replenish(state)

    async def _deliver(self, state: _EntityLink, event: Transfer) -> None:
        """One delivery: the send request, then its settlement. Errors are the outcome's."""
        server = self._server
        request_id = random_id()
        outcome = Outcome(request_id, protocol="amqp", fields=self._fields(state, event))

        tracer = server.edge.tracer
        read_early: list[OutboundMessage] | None = None
        if tracer.enabled:
            # The server span continues the messages' own context, read before it opens
            # (once: `read` hands these over); a delivery that cannot be read has none, and
            # `read` raises its error again inside `ingest`, where it is answered.
            with contextlib.suppress(Exception):  # whatever it is, `ingest` meets it again
                read_early = _read(event)

        async def read(_entity: EntityRef) -> list[OutboundMessage]:
            return read_early if read_early is not None else _read(event)

        origins = [m.application_properties for m in read_early or ()]
        settlement: DeliveryState
        try:
            with tracer.delivery(state.name, request_id, origins) as traced:
                done = await ingest(
                    server.edge,
                    server.router,
                    outcome,
                    state.name,
                    None,
                    self._grants.authorize_send,
                    read,
                )
                traced(done.result.status)
            result = done.result
            if isinstance(result, GatewayError):
                condition, description = amqp_rejection(result), result.message
                if condition == Condition.NOT_FOUND:
                    # Service Bus's own wording: the JS SDK recognises a missing entity by it.
                    description = (
                        f"The messaging entity '{state.name[:200]}' could not be found. "
                        + description
                    )
                settlement = _rejected(condition, description, request_id)
            else:
                settlement = Accepted()
        except Exception:  # a bug: the client still gets an answer, not a 60 s hang
            log.exception("AMQP delivery %s failed", request_id)
            settlement = _rejected(Condition.SERVER_BUSY, "internal error", request_id)
        finally:
            state.in_flight -= 1
            server.held_bytes -= len(event.payload)
        if not event.settled:
            self._settle(state.link, event.delivery_id, settlement)
        self._replenish(state)
        self._close_if_idle()
        if len(self._tasks) > 1:
            self._flush_soon()  # others may settle in this turn: one write for them all
        else:
            self._flush()  # the only one in flight (a sequential sender): no turn to wait

    def _fields(self, state: _EntityLink, event: Transfer) -> dict[str, object]:
        """A delivery's fields of the access line."""
        return {
            "container_id": (self._engine.container_id if self._engine else None),
            "link": state.link.name,
            "delivery_id": event.delivery_id,
        }

    def _refuse(self, state: _EntityLink, event: Transfer, error: GatewayError) -> None:
        """A delivery refused before any send (this replica is full, or closing): rejected
        with the error table's condition, and recorded like a request refused at the HTTP
        edge (metrics, access line) and as an AMQP refusal of kind `delivery`."""
        outcome = Outcome(random_id(), protocol="amqp", fields=self._fields(state, event))
        edge = self._server.edge
        edge.observer.amqp_refused("delivery")
        record_outcome(outcome, edge, time.perf_counter(), state.name, [], error)
        if not event.settled:
            rejected = _rejected(amqp_rejection(error), error.message, outcome.request_id)
            self._settle(state.link, event.delivery_id, rejected)

    def _refused_at_engine(self, event: TransferRefused) -> None:
        """A delivery over the link's size, rejected by the engine: recorded as a request."""
        state = self._entity_links.get(id(event.link))
        name = state.name if state is not None else "_unknown"
        error = PayloadTooLarge(
            f"the delivery is {event.size} bytes; the limit is {event.link.max_message_size}"
        )
        outcome = Outcome(random_id(), protocol="amqp")
        record_outcome(outcome, self._server.edge, time.perf_counter(), name, [], error)
        if state is not None:
            self._replenish(state)

    # -- $cbs and $management ---------------------------------------------------------

    def _on_cbs_request(self, event: Transfer) -> None:
        request = _Request.parse(event.payload)
        if request is None or request.operation != conventions.CBS_OPERATION_PUT_TOKEN:
            status, description = 400, "expected a put-token request"
        else:
            put = self._grants.put_token(request.properties.get("name"), request.body)
            status, description = put.status, put.description
            result = "granted" if status == 200 else "refused"
            self._server.edge.observer.amqp_put_token(result)
            if status != 200:
                log.info("AMQP put-token refused (%s) from %s: %s", status, self._peer, description)
        if not event.settled:
            self._settle(event.link, event.delivery_id, Accepted())
        self._send_reply(
            event,
            request,
            conventions.CBS_NODE,
            {
                conventions.CBS_STATUS_CODE: Int(status),
                conventions.CBS_STATUS_DESCRIPTION: description,
            },
            None,
        )

    def _on_management_request(self, event: Transfer) -> None:
        """Scheduling runs as a task of its own (it waits for the primary); anything else is
        answered 501 at once (gateway.amqp.management)."""
        request = _Request.parse(event.payload)
        operation = request.operation if request is not None else None
        if not event.settled:
            self._settle(event.link, event.delivery_id, Accepted())
        if request is None:
            return
        if self._server.scheduler is None or not management.is_scheduling(operation):
            self._server.edge.observer.amqp_refused("management")
            self._reply(event, request, management.not_implemented(operation))
            return
        task = self._loop_().create_task(
            self._manage(event, request, operation), name=f"amqp management {operation}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _manage(self, event: Transfer, request: _Request, operation: str | None) -> None:
        node = entity_path(event.link.target_address or "")
        name = node[: -len(_MANAGEMENT_SUFFIX)]
        server = self._server
        try:
            reply = await management.answer(
                operation,
                request.body,
                name,
                catalog=server.edge.catalog,
                limits=server.settings_limits,
                authorize=self._grants.authorize_send,
                scheduler=server.scheduler,
            )
        except Exception:  # a bug: the client still gets an answer, not a 60 s hang
            log.exception("AMQP management request %s failed", operation)
            reply = management.Answer(500, "internal error", Condition.INTERNAL_ERROR)
        log.info(
            "AMQP %s on %s from %s: %s", operation, name, self._peer, reply.status,
            extra={"entity": name, "status": reply.status, "protocol": "amqp"},
        )  # fmt: skip
        self._reply(event, request, reply)
        self._flush_soon()

    def _reply(self, event: Transfer, request: _Request, answer: management.Answer) -> None:
        """Send a management reply on the link the conventions pick."""
        self._send_reply(
            event, request, event.link.target_address or "", answer.application_properties(),
            answer.body,
        )  # fmt: skip

    def _send_reply(
        self,
        event: Transfer,
        request: _Request | None,
        node: str,
        properties: dict[str, Any],
        body: Any,
    ) -> None:
        """Send a request's reply on the link the conventions pick (its reply-to)."""
        engine = self._engine
        if engine is None or request is None:
            return
        session = event.link.session
        target = reply_link(request.reply_to, node, session.links.values(), engine.links)
        if target is None:
            log.info("AMQP %s request from %s: no link to reply on", node, self._peer)
            return
        parts = [
            sections.section(
                sections.PROPERTIES, [None, None, None, None, None, request.message_id]
            ),
            sections.section(sections.APPLICATION_PROPERTIES, properties),
            sections.section(sections.AMQP_VALUE, body),
        ]
        engine.send(target, b"".join(parts))

    # -- credit, settlement, closing ----------------------------------------------------

    def _replenish(self, state: _EntityLink) -> None:
        """Top the link's credit up (see the module docstring)."""
        engine = self._engine
        if engine is None or self.closing:
            return
        link = state.link
        full = self._server.settings.link_credit
        if self._server.has_room():
            wanted = full - state.in_flight
        else:
            wanted = 1 if state.in_flight == 0 else 0  # never none with nothing in flight
        # Topped up when half is used, not after each delivery: one flow frame per half.
        if wanted > link.credit and (link.credit == 0 or link.credit <= full // 2):
            engine.grant_credit(link, wanted)

    def _settle(self, link: Link, delivery_id: int, outcome: DeliveryState) -> None:
        if self._engine is not None:
            self._engine.settle(link, delivery_id, outcome)

    def stop_credit(self) -> None:
        """Drain: every sender link to credit 0; deliveries in flight still finish."""
        self.closing = True
        engine = self._engine
        if engine is None:
            return
        for state in self._entity_links.values():
            engine.grant_credit(state.link, 0)
        self._flush()

    def close(self, description: str) -> None:
        """Close with `amqp:connection:forced` (the SDKs reconnect on their next send)."""
        self.closing = True
        if self._engine is not None and self._transport is not None:
            self._engine.close(Condition.CONNECTION_FORCED, description)
            self._flush()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> set[asyncio.Task[None]]:
        return self._tasks

    def age(self, now: float) -> float:
        return now - self._opened_at

    def _close_if_idle(self) -> None:
        """A connection past its maximum age is closed once nothing is in flight."""
        max_age = self._server.settings.max_connection_age
        if not max_age or self._tasks - {asyncio.current_task()}:
            return
        if self.age(self._now()) >= max_age:
            self.close("connection age limit: reconnect")

    async def wait_idle(self, within: float) -> None:
        """Wait up to `within` seconds for the deliveries in flight (then cancel them)."""
        await stop_after(list(self._tasks), within, f"AMQP connection {self._peer}")

    def _flush_soon(self) -> None:
        """Flush once the deliveries settling in this turn of the loop have settled: the
        dispatcher completes a micro-batch at once, and their dispositions (and any flow)
        then leave in one write, not a write (a syscall, the bulk of a delivery's CPU) each."""
        if self._flush_handle is None and self._transport is not None:
            self._flush_handle = self._loop_().call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        engine, transport = self._engine, self._transport
        if engine is None or transport is None:
            return
        data = engine.data_to_send()
        if data:
            transport.write(data)
            engine.sent(self._now())
        elif self._timer is not None and not engine.finished:
            # Nothing written (a transfer read, not yet settled): the engine's next deadline
            # can only have moved later (a frame read puts the idle deadline off; what moves
            # one earlier, a close, writes a frame), and a timer due no later is kept anyway.
            return
        if engine.finished:
            transport.close()
        else:
            self._schedule()

    def _schedule(self) -> None:
        engine = self._engine
        if engine is None:
            return
        now = self._now()
        deadline = engine.next_deadline(now)
        max_age = self._server.settings.max_connection_age
        aged = self._opened_at + max_age
        # Once past its age, a connection with deliveries in flight is closed by the last
        # one's settlement (`_deliver`), not by a timer firing again and again meanwhile.
        if max_age and not self.closing and aged > now:
            deadline = aged if deadline is None else min(deadline, aged)
        if self._timer is not None:
            # A timer due no later is kept: firing early is harmless (`tick` acts only on
            # what is due, and re-arms), and every write moves the heartbeat deadline, so
            # re-arming on each would cost a timer per delivery.
            if deadline is not None and self._timer.when() <= deadline:
                return
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            self._timer = self._loop_().call_at(max(deadline, now), self._tick)

    def _tick(self) -> None:
        self._timer = None
        engine = self._engine
        if engine is None or self._transport is None:
            return
        events = engine.tick(self._now())
        self._close_if_idle()
        self._handle(events)

    def _loop_(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def _now(self) -> float:
        return self._loop_().time()


@dataclass(frozen=True, slots=True)
class _Request:
    """A request on ``$cbs`` or ``$management``: what answering it needs."""

    message_id: Any
    reply_to: str | None
    properties: dict[str, Any]
    body: Any

    @property
    def operation(self) -> str | None:
        op = self.properties.get("operation")
        return str(op) if isinstance(op, str) else None

    @classmethod
    def parse(cls, payload: bytes) -> _Request | None:
        try:
            parts = sections.split(payload)
            props = parts.properties_view()
            app = {key: value for key, _raw, value in parts.application_properties_items()}
            body = None
            if parts.body_code == sections.AMQP_VALUE and parts.body:
                body = _value_of(parts.body[0])
        except DecodeError:
            return None
        return cls(props.message_id, props.reply_to, app, body)


def _value_of(raw: bytes) -> Any:
    """The value of an amqp-value section (its exact bytes, descriptor included)."""
    described = decode(raw)[0]
    return described.value if isinstance(described, Described) else None


def _read(event: Transfer) -> list[OutboundMessage]:
    """The delivery's messages: one, or a batch's (all or none)."""
    if event.message_format == conventions.BATCH_MESSAGE_FORMAT:
        return [messages.to_outbound(m) for m in messages.batch_messages(event.payload)]
    return [messages.to_outbound(event.payload)]


def _is_request_node(address: str) -> bool:
    path = entity_path(address)
    return path == conventions.CBS_NODE or path.lower().endswith(_MANAGEMENT_SUFFIX.lower())


def _rejected(condition: str, description: str, tracking_id: str | None = None) -> Rejected:
    info = {_TRACKING_ID: tracking_id} if tracking_id else {}
    return Rejected(Error(condition, description[:1000], info))


__all__ = ["SENDERS_ONLY", "AmqpConnection", "Limits"]
