"""A sans-IO AMQP 1.0 server connection: the subset a Service Bus sender needs.

``ServerConnection`` does no I/O and keeps no clock of its own. Its driver (an asyncio
``Protocol`` in the gateway, a plain loop in tests) feeds it bytes with ``receive_data``
and gets back events, writes ``data_to_send()`` to the socket, and calls ``tick(now)``
when ``next_deadline(now)`` comes. The application answers events with commands:
``accept_attach`` or ``refuse_link`` for a new link, ``grant_credit``, ``settle``,
``send`` (replies on links where this side sends, such as ``$cbs``), ``detach``, ``end``,
``close``.

What it does by itself:

* SASL: offers MSSBCBS and ANONYMOUS (and nothing that needs a challenge), accepts either
  with outcome ok. A client may pipeline the AMQP header, open, begin and attach behind
  its SASL frames, or before the server's own header.
* Answers open (never advertising an idle timeout of its own unless ``Limits`` says so),
  begin, end and close; sends heartbeats at half the idle timeout the peer asks for.
* Reassembles multi-frame transfers, bounded by the link's and the connection's maximum
  message size: a larger delivery is rejected ``amqp:link:message-size-exceeded`` by the
  engine itself (``TransferRefused``), its frames dropped as they come.
* Keeps the session windows open (a flow when half the incoming window is used).
* Tolerates frames on a channel that has ended (pyamqp sends detach after end).
* A protocol violation emits ``ProtocolViolation`` and closes the connection with the
  matching condition; the driver then flushes ``data_to_send()`` and, once
  ``finished`` is true, closes the transport.

What it refuses or ignores: SASL mechanisms other than the two above; TLS negotiated
inside AMQP (``AMQP\\x02``: use TLS on the socket); link recovery (``unsettled`` maps and
``resume`` are ignored: every delivery is new); transactional delivery states are passed
on for the application to reject. Resource caps (``Limits``) close the connection with
``amqp:resource-limit-exceeded``.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any

from sbamqp import conventions
from sbamqp.codec import Array, DecodeError, Symbol, Uint, Ulong
from sbamqp.conventions import Condition
from sbamqp.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    HEADER_SIZE,
    SASL_HEADER,
    FrameError,
    decode_body,
    encode_frame,
    heartbeat,
    parse_header,
)
from sbamqp.performatives import (
    Accepted,
    Attach,
    Begin,
    Close,
    Coordinator,
    DeliveryState,
    Detach,
    Disposition,
    End,
    Error,
    Flow,
    Open,
    Performative,
    Rejected,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    Source,
    Target,
)
from sbamqp.performatives import Transfer as TransferFrame

__all__ = [
    "Closed",
    "Event",
    "Flowed",
    "Limits",
    "Link",
    "LinkAttached",
    "LinkDetached",
    "Opened",
    "ProtocolViolation",
    "SaslDone",
    "ServerConnection",
    "Session",
    "SessionBegun",
    "SessionEnded",
    "Settled",
    "Transfer",
    "TransferRefused",
]

log = logging.getLogger(__name__)

ROLE_SENDER = False
ROLE_RECEIVER = True
_UINT_MOD = 1 << 32


@dataclass(frozen=True)
class Limits:
    """What one connection may use. Exceeding a cap closes the connection with
    ``amqp:resource-limit-exceeded`` (a message over ``max_message_size`` is only
    rejected)."""

    max_frame_size: int = 1 << 20  # advertised; a larger incoming frame is a framing error
    channel_max: int = 255  # advertised: the highest channel number, so 256 sessions
    max_sessions: int = 64
    handle_max: int = 63  # advertised per session: the highest handle, so 64 links
    max_links: int = 256  # per connection
    max_message_size: int = 1 << 20  # a delivery's whole payload, all its frames
    incoming_window: int = 2048  # frames a session may send before we open the window again
    # Seconds from the first byte until the connection is open (SASL and open exchanged);
    # None for no deadline. The driver may add its own (a first put-token, say).
    handshake_timeout: float | None = 10.0
    # Advertised idle timeout in seconds, and the connection is closed when nothing arrives
    # for that long. None (the default) advertises none: a Python client only pumps its
    # socket when it sends, and would be cut off.
    idle_timeout: float | None = None
    # Seconds to wait for the peer's close after ours before the transport may be dropped.
    close_grace: float = 2.0
    # Bytes held in unfinished multi-frame deliveries, all links together (never less than
    # max_message_size): without it, each link could hold up to max_message_size at once.
    max_buffered_bytes: int = 4 << 20
    # Replies (``send``) waiting for credit on one link; a peer that asks and never grants
    # credit is closed beyond this, so that its replies cannot pile up.
    max_queued_replies: int = 64
    container_id: str = "sbamqp"
    sasl_mechanisms: tuple[str, ...] = (conventions.SASL_MSSBCBS, conventions.SASL_ANONYMOUS)
    require_sasl: bool = True

    def __post_init__(self) -> None:
        problems = [
            name
            for name, ok in (
                ("max_frame_size (512 .. 2**32-1)", 512 <= self.max_frame_size < 1 << 32),
                ("channel_max (0 .. 65535)", 0 <= self.channel_max <= 0xFFFF),
                ("max_sessions (1 or more)", self.max_sessions >= 1),
                ("handle_max (0 .. 2**32-1)", 0 <= self.handle_max < 1 << 32),
                ("max_links (1 or more)", self.max_links >= 1),
                ("max_message_size (1 or more)", self.max_message_size >= 1),
                ("max_buffered_bytes (1 or more)", self.max_buffered_bytes >= 1),
                ("incoming_window (2 or more)", self.incoming_window >= 2),
                ("idle_timeout (positive)", self.idle_timeout is None or self.idle_timeout > 0),
                ("close_grace (positive)", self.close_grace > 0),
            )
            if not ok
        ]
        if problems:
            raise ValueError("invalid AMQP limits: " + ", ".join(problems))


# -- state objects --------------------------------------------------------------------


@dataclass(eq=False)
class Session:
    """One session: ``channel`` is ours, ``remote_channel`` the peer's."""

    channel: int
    remote_channel: int
    links: dict[int, Link] = field(default_factory=dict, repr=False)  # by the peer's handle
    next_incoming_id: int = 0
    incoming_window: int = 0
    next_outgoing_id: int = 0
    remote_incoming_window: int = 0
    remote_outgoing_window: int = 0
    ended: bool = False
    # Peer handles we detached whose answering detach has not arrived yet.
    detaching: set[int] = field(default_factory=set, repr=False)
    # The delivery in progress per handle (multi-frame); see _Partial.
    properties: dict[Any, Any] | None = None


@dataclass(eq=False)
class Link:
    """One link. ``role`` is the peer's: False (sender) when the client sends to us.

    ``credit`` is what this side granted (the peer's sender) or was granted (our sender);
    ``delivery_count`` follows the standard's meaning for each role.
    """

    name: str
    handle: int  # the peer's handle
    role: bool
    session: Session = field(repr=False)
    source: Source | None
    target: Target | Coordinator | None
    properties: dict[Any, Any] | None
    snd_settle_mode: int
    rcv_settle_mode: int
    peer_max_message_size: int | None
    local_handle: int = -1
    attached: bool = False  # our attach went out
    detached: bool = False
    credit: int = 0
    delivery_count: int = 0
    max_message_size: int = 0
    desired_capabilities: Any = None
    _partial: _Partial | None = field(default=None, repr=False)
    _queued: list[tuple[bytes, int]] = field(default_factory=list, repr=False)

    @property
    def is_server_sender(self) -> bool:
        """True when this side sends on the link (the peer attached a receiver)."""
        return self.role == ROLE_RECEIVER

    @property
    def source_address(self) -> str | None:
        """The source's address, if any."""
        return self.source.address if self.source is not None else None

    @property
    def target_address(self) -> str | None:
        """The target's address, if any (None for a coordinator)."""
        return self.target.address if isinstance(self.target, Target) else None

    @property
    def filters(self) -> dict[Any, Any]:
        """The source's filter set (a session receiver names its session there)."""
        return (self.source.filter or {}) if self.source is not None else {}

    @property
    def is_coordinator(self) -> bool:
        """A transaction coordinator link (.NET's transactions)."""
        return isinstance(self.target, Coordinator)


@dataclass(eq=False)
class _Partial:
    delivery_id: int
    delivery_tag: bytes
    message_format: int
    settled: bool
    state: DeliveryState | None
    chunks: list[bytes]
    size: int
    oversize: bool = False


# -- events ---------------------------------------------------------------------------


class Event:
    """The base of what ``receive_data`` and ``tick`` report."""


@dataclass
class SaslDone(Event):
    """The SASL exchange succeeded with ``mechanism`` (the peer's SASL hostname, if any)."""

    mechanism: str
    hostname: str | None
    initial_response: bytes | None = None


@dataclass
class Opened(Event):
    """The peer's open arrived; ours is already queued in answer."""

    hostname: str | None
    container_id: str
    idle_timeout_ms: int | None
    max_frame_size: int
    properties: dict[Any, Any]


@dataclass
class SessionBegun(Event):
    """A session began (answered already)."""

    session: Session


@dataclass
class LinkAttached(Event):
    """The peer attached a link: answer with ``accept_attach`` or ``refuse_link``."""

    link: Link


@dataclass
class Flowed(Event):
    """A flow for a link (the peer granted credit to our sender, or drained)."""

    link: Link | None
    flow: Flow


@dataclass
class Transfer(Event):
    """A complete delivery from the peer's sender: settle it unless ``settled``.

    ``over_credit`` is true when it came without credit (a race with credit 0): the
    application should reject it (``server-busy``)."""

    link: Link
    delivery_id: int
    delivery_tag: bytes
    message_format: int
    payload: bytes
    settled: bool
    state: DeliveryState | None = None
    over_credit: bool = False


@dataclass
class TransferRefused(Event):
    """A delivery the engine rejected itself (``condition``): over the size limit."""

    link: Link
    delivery_id: int
    condition: str
    size: int


@dataclass
class Settled(Event):
    """The peer's disposition of deliveries this side sent (replies)."""

    session: Session
    first: int
    last: int
    state: DeliveryState | None


@dataclass
class LinkDetached(Event):
    """The peer detached a link (answered already); ``error`` is the peer's, if any."""

    link: Link
    error: Error | None


@dataclass
class SessionEnded(Event):
    """The peer ended a session (answered already)."""

    session: Session
    error: Error | None


@dataclass
class Closed(Event):
    """The connection is closed (the peer's close, answered; or the answer to ours)."""

    error: Error | None


@dataclass
class ProtocolViolation(Event):
    """The peer broke the protocol or a limit; the engine closes with ``condition``."""

    condition: str
    description: str


# -- the connection -------------------------------------------------------------------

_ST_HEADER, _ST_SASL, _ST_AMQP_HEADER, _ST_OPEN, _ST_OPENED, _ST_CLOSE_SENT, _ST_DONE = range(7)

# Hand-built frames for the hot path (a delivery settled, credit granted): the same bytes
# the generic encoder would make with the wide forms, at a fraction of the cost.
_DISP_ACCEPTED = struct.Struct(">IBBH" + "BBB" + "BBB" + "B" + "BI" + "B" + "B" + "BBBB")
_DISP_SIZE = 8 + 3 + 3 + 1 + 5 + 1 + 1 + 4
_FLOW = struct.Struct(">IBBH" + "BBB" + "BBB" + "BI" + "BI" + "BI" + "BI" + "BI" + "BI" + "BI")
_FLOW_SIZE = _FLOW.size


def _accepted_disposition(channel: int, delivery_id: int) -> bytes:
    """disposition(role=receiver, first=id, settled=true, state=accepted)."""
    # list8: size, count 4: role true, first uint, last null, settled true, accepted.
    return _DISP_ACCEPTED.pack(
        _DISP_SIZE, 2, 0, channel,
        0x00, 0x53, 0x15,
        0xC0, 1 + 1 + 5 + 1 + 1 + 4, 5,
        0x41,
        0x70, delivery_id,
        0x40,
        0x41,
        0x00, 0x53, 0x24, 0x45,
    )  # fmt: skip


def _flow_frame(channel: int, fields: tuple[int, int, int, int, int, int, int]) -> bytes:
    """flow with its seven uint fields set (next-incoming-id .. link-credit)."""
    args: list[int] = [_FLOW_SIZE, 2, 0, channel, 0x00, 0x53, 0x13, 0xC0, 1 + 7 * 5, 7]
    for value in fields:
        args += (0x70, value)
    return _FLOW.pack(*args)


class ServerConnection:
    """The server side of one AMQP connection (see the module docstring)."""

    def __init__(self, limits: Limits | None = None, *, now: float = 0.0) -> None:
        self.limits = limits or Limits()
        self._state = _ST_HEADER
        self._sasl_done = False
        self._in = bytearray()
        self._out: list[bytes] = []
        self._events: list[Event] = []
        self.sessions: dict[int, Session] = {}  # by the peer's channel
        self._ended: set[int] = set()  # peer channels that ended: late frames are ignored
        self._link_count = 0
        self._buffered = 0  # bytes held in unfinished multi-frame deliveries
        self.peer_max_frame_size = 512
        self.peer_idle_timeout: float | None = None
        self.hostname: str | None = None
        self.container_id: str | None = None
        self._started = now
        self._last_received = now
        self._last_sent = now
        self._close_sent_at: float | None = None
        self.opened = False
        self._deaf = False
        self.finished = False  # the transport may be closed (after flushing)

    # -- driver interface -------------------------------------------------------------

    def receive_data(self, data: bytes, now: float | None = None) -> list[Event]:
        """Feed bytes from the socket; the events they complete, in order.

        Never raises for bad input: a violation becomes a ``ProtocolViolation`` event and
        a close (or, before the AMQP header, ``finished``). Bytes after a close are ignored.
        """
        if now is not None:
            self._last_received = now
        if self._state == _ST_DONE or self._deaf or not data:
            return self._take_events()
        self._in += data
        try:
            self._process()
        except (DecodeError, _Violation) as exc:
            condition = exc.condition if isinstance(exc, _Violation) else _decode_condition(exc)
            self._in.clear()
            # Unless the frame header itself was bad, the framing still holds: the peer's
            # close is still read.
            self._violation(condition, str(exc))
        return self._take_events()

    def data_to_send(self) -> bytes:
        """The bytes to write to the socket (and forget)."""
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    def next_deadline(self, now: float) -> float | None:
        """When ``tick`` must run next (monotonic seconds), or None for never."""
        deadlines = []
        lim = self.limits
        self._start_close_grace(now)
        if not self.opened and lim.handshake_timeout is not None:
            deadlines.append(self._started + lim.handshake_timeout)
        if self.peer_idle_timeout:
            deadlines.append(self._last_sent + self.peer_idle_timeout / 2)
        if self.opened and lim.idle_timeout:
            deadlines.append(self._last_received + lim.idle_timeout)
        if self._close_sent_at is not None:
            deadlines.append(self._close_sent_at + lim.close_grace)
        if self.finished:
            return None
        return min(deadlines) if deadlines else None

    def tick(self, now: float) -> list[Event]:
        """Heartbeats, the handshake deadline, idle detection, the close grace."""
        lim = self.limits
        if self.finished:
            return []
        self._start_close_grace(now)
        if self._close_sent_at is not None and now >= self._close_sent_at + lim.close_grace:
            self._finish()
        elif (
            not self.opened
            and lim.handshake_timeout is not None
            and (now >= self._started + lim.handshake_timeout)
        ):
            self._violation(Condition.RESOURCE_LIMIT_EXCEEDED, "handshake took too long")
        elif self.opened and lim.idle_timeout and now >= self._last_received + lim.idle_timeout:
            self._violation(Condition.RESOURCE_LIMIT_EXCEEDED, "idle timeout")
        if self.peer_idle_timeout and now >= self._last_sent + self.peer_idle_timeout / 2:
            if not self._out and self._state in (_ST_OPENED, _ST_CLOSE_SENT):
                self._out.append(heartbeat())
        if self._out:
            self._last_sent = now
        return self._take_events()

    def _start_close_grace(self, now: float) -> None:
        if self._state == _ST_CLOSE_SENT and self._close_sent_at is None:
            self._close_sent_at = now

    def sent(self, now: float) -> None:
        """Tell the engine that bytes went out at ``now`` (postpones the next heartbeat)."""
        self._last_sent = now

    # -- commands ---------------------------------------------------------------------

    def accept_attach(
        self,
        link: Link,
        *,
        max_message_size: int | None = None,
        properties: dict[Any, Any] | None = None,
        offered_capabilities: Any = None,
    ) -> None:
        """Answer the peer's attach: the link is usable.

        ``max_message_size`` is advertised (always: some SDKs read an absent one as 0) and
        enforced on the link's deliveries, capped by ``Limits.max_message_size``.
        """
        if link.attached or link.detached or self._state != _ST_OPENED:
            return
        size = min(max_message_size or self.limits.max_message_size, self.limits.max_message_size)
        link.max_message_size = size
        self._send_attach(link, size, properties, offered_capabilities, refused=False)

    def refuse_link(self, link: Link, condition: str, description: str) -> None:
        """Refuse a link: our attach (without the terminus the peer asked for), then a
        detach with the error, as the standard has a refusal look."""
        if link.detached or self._state != _ST_OPENED:
            return
        if not link.attached:
            self._send_attach(link, None, None, None, refused=True)
        self._send_detach(link, Error(condition, description, {}), closed=True)
        self._forget(link)

    def grant_credit(self, link: Link, credit: int) -> None:
        """Set the peer sender's credit to ``credit`` (deliveries it may send from now)."""
        if not link.attached or link.detached or link.is_server_sender:
            return
        link.credit = max(0, credit)
        self._send_link_flow(link)

    def settle(self, link: Link, delivery_id: int, outcome: DeliveryState) -> None:
        """Settle a delivery from the peer with ``outcome`` (accepted, or rejected with an
        error whose ``info`` is always sent as a map)."""
        if self._state not in (_ST_OPENED,) or link.session.ended:
            return
        session = link.session
        if isinstance(outcome, Accepted):
            self._out.append(_accepted_disposition(session.channel, delivery_id))
            return
        frame = Disposition(role=ROLE_RECEIVER, first=delivery_id, settled=True, state=outcome)
        self._out.append(encode_frame(session.channel, frame))

    def send(self, link: Link, payload: bytes, *, message_format: int = 0) -> None:
        """Send a message on a link where this side sends (a ``$cbs`` reply, say); settled
        by us. Waits for credit: queued until the peer grants some."""
        if not link.is_server_sender or link.detached or self._state != _ST_OPENED:
            return
        link._queued.append((payload, message_format))
        self._pump(link)
        if len(link._queued) > self.limits.max_queued_replies:
            self._violation(Condition.RESOURCE_LIMIT_EXCEEDED, "replies wait for credit")

    def detach(self, link: Link, condition: str | None = None, description: str = "") -> None:
        """Detach (close) a link, with an error when ``condition`` is given."""
        if link.detached or self._state != _ST_OPENED:
            return
        error = Error(condition, description, {}) if condition else None
        if not link.attached:
            self._send_attach(link, None, None, None, refused=True)
        self._send_detach(link, error, closed=True)
        self._forget(link)

    def end(self, session: Session, condition: str | None = None, description: str = "") -> None:
        """End a session (its links go with it)."""
        if session.ended or self._state != _ST_OPENED:
            return
        error = Error(condition, description, {}) if condition else None
        self._out.append(encode_frame(session.channel, End(error)))
        self._drop_session(session)

    def close(self, condition: str | None = None, description: str = "") -> None:
        """Close the connection (with an error when ``condition`` is given); ``finished``
        turns true when the peer answers, or after ``Limits.close_grace``."""
        if self._state in (_ST_CLOSE_SENT, _ST_DONE):
            return
        error = Error(condition, description, {}) if condition else None
        if self._state in (_ST_OPEN, _ST_OPENED) or self.opened:
            if not self.opened:  # close needs our open first
                self._send_open()
            self._out.append(encode_frame(0, Close(error)))
            self._state = _ST_CLOSE_SENT  # the grace starts at the next deadline asked
        else:
            self._finish()

    @property
    def links(self) -> list[Link]:
        """Every live link of the connection."""
        return [link for s in self.sessions.values() for link in s.links.values()]

    # -- input processing -------------------------------------------------------------

    def _take_events(self) -> list[Event]:
        events = self._events
        self._events = []
        return events

    def _process(self) -> None:
        buf = self._in
        off = 0
        try:
            while self._state != _ST_DONE:
                if self._state in (_ST_HEADER, _ST_AMQP_HEADER):
                    if len(buf) - off < HEADER_SIZE:
                        break
                    self._on_protocol_header(bytes(buf[off : off + HEADER_SIZE]))
                    off += HEADER_SIZE
                    continue
                try:
                    header = parse_header(buf, off, self.limits.max_frame_size)
                except FrameError:
                    # The byte stream cannot be trusted any more: read nothing else
                    # (the close grace ends the connection).
                    self._deaf = True
                    raise
                if header is None or len(buf) - off < header.size:
                    break
                body = bytes(buf[off + header.body_offset : off + header.size])
                off += header.size
                self._on_frame(header.frame_type, header.channel, body)
        finally:
            del buf[:off]

    def _on_protocol_header(self, header: bytes) -> None:
        if self._state == _ST_HEADER and header == SASL_HEADER:
            self._out.append(SASL_HEADER)
            mechanisms = Array([Symbol(m) for m in self.limits.sasl_mechanisms], code=0xB3)
            self._out.append(encode_frame(0, SaslMechanisms(mechanisms), frame_type=FRAME_SASL))
            self._state = _ST_SASL
        elif header == AMQP_HEADER and (self._sasl_done or not self.limits.require_sasl):
            self._out.append(AMQP_HEADER)
            self._state = _ST_OPEN
        else:
            # The standard's answer to an unwanted header: ours, then the socket closes.
            self._out.append(SASL_HEADER if self.limits.require_sasl else AMQP_HEADER)
            self._events.append(
                ProtocolViolation(Condition.NOT_ALLOWED, f"unexpected protocol header {header!r}")
            )
            self._finish()

    def _on_frame(self, frame_type: int, channel: int, body: bytes) -> None:
        if self._state == _ST_SASL:
            if frame_type != FRAME_SASL:
                raise _Violation(Condition.FRAMING_ERROR, "an AMQP frame during SASL")
            self._on_sasl(decode_body(body, FRAME_SASL)[0])
            return
        if frame_type != FRAME_AMQP:
            raise _Violation(Condition.FRAMING_ERROR, "a SASL frame after SASL")
        if self._state == _ST_CLOSE_SENT:
            # After our close only the peer's close matters.
            perf, _ = decode_body(body, FRAME_AMQP) if body else (None, b"")
            if isinstance(perf, Close):
                self._events.append(Closed(perf.error))
                self._finish()
            return
        if not body:
            return  # a heartbeat
        perf, payload = decode_body(body, FRAME_AMQP)
        if self._state == _ST_OPEN:
            if not isinstance(perf, Open):
                raise _Violation(Condition.FRAMING_ERROR, "the first frame must be open")
            self._on_open(perf)
            return
        handler = _HANDLERS.get(type(perf))
        if handler is None:
            raise _Violation(Condition.FRAMING_ERROR, f"unexpected {type(perf).__name__}")
        handler(self, channel, perf, payload)

    def _on_sasl(self, perf: Performative | None) -> None:
        if not isinstance(perf, SaslInit):
            raise _Violation(Condition.FRAMING_ERROR, "expected sasl-init")
        if perf.mechanism not in self.limits.sasl_mechanisms:
            self._out.append(encode_frame(0, SaslOutcome(code=1), frame_type=FRAME_SASL))
            self._events.append(
                ProtocolViolation(Condition.UNAUTHORIZED_ACCESS, "SASL mechanism not offered")
            )
            self._finish()
            return
        self._out.append(encode_frame(0, SaslOutcome(code=0), frame_type=FRAME_SASL))
        self._sasl_done = True
        self._state = _ST_AMQP_HEADER
        self._events.append(SaslDone(perf.mechanism, perf.hostname, perf.initial_response))

    def _on_open(self, perf: Open) -> None:
        self.peer_max_frame_size = max(512, min(perf.max_frame_size or 0xFFFFFFFF, 1 << 30))
        if perf.idle_time_out:
            self.peer_idle_timeout = perf.idle_time_out / 1000
        self.hostname = perf.hostname
        self.container_id = perf.container_id
        self._send_open()
        self._state = _ST_OPENED
        self._events.append(
            Opened(
                perf.hostname,
                perf.container_id,
                perf.idle_time_out,
                self.peer_max_frame_size,
                perf.properties or {},
            )
        )

    def _send_open(self) -> None:
        lim = self.limits
        self.opened = True
        idle = None if lim.idle_timeout is None else Uint(int(lim.idle_timeout * 1000))
        self._out.append(
            encode_frame(
                0,
                Open(
                    container_id=lim.container_id,
                    max_frame_size=lim.max_frame_size,
                    channel_max=lim.channel_max,
                    idle_time_out=idle,
                ),
            )
        )

    def _on_begin(self, channel: int, perf: Begin, payload: bytes) -> None:
        if channel in self.sessions or channel > self.limits.channel_max:
            raise _Violation(Condition.FRAMING_ERROR, f"begin on channel {channel} in use")
        if perf.remote_channel is not None:
            raise _Violation(Condition.NOT_ALLOWED, "this server does not begin sessions")
        if len(self.sessions) >= self.limits.max_sessions:
            raise _Violation(Condition.RESOURCE_LIMIT_EXCEEDED, "too many sessions")
        used = {s.channel for s in self.sessions.values()}
        local = next(c for c in range(self.limits.channel_max + 1) if c not in used)
        session = Session(local, channel, properties=perf.properties)
        session.next_incoming_id = perf.next_outgoing_id
        session.incoming_window = self.limits.incoming_window
        session.remote_incoming_window = perf.incoming_window
        session.remote_outgoing_window = perf.outgoing_window
        self.sessions[channel] = session
        self._ended.discard(channel)
        self._out.append(
            encode_frame(
                local,
                Begin(
                    remote_channel=channel,
                    next_outgoing_id=0,
                    incoming_window=session.incoming_window,
                    outgoing_window=0x7FFFFFFF,
                    handle_max=self.limits.handle_max,
                ),
            )
        )
        self._events.append(SessionBegun(session))

    def _session(self, channel: int) -> Session | None:
        session = self.sessions.get(channel)
        if session is None and channel not in self._ended:
            raise _Violation(Condition.FRAMING_ERROR, f"no session on channel {channel}")
        return session  # None: a late frame on an ended channel, ignored

    def _on_attach(self, channel: int, perf: Attach, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        if perf.handle > self.limits.handle_max:
            raise _Violation(Condition.RESOURCE_LIMIT_EXCEEDED, "handle above handle-max")
        if perf.handle in session.links:
            raise _Violation(Condition.HANDLE_IN_USE, f"handle {perf.handle} in use")
        session.detaching.discard(perf.handle)
        if self._link_count >= self.limits.max_links:
            raise _Violation(Condition.RESOURCE_LIMIT_EXCEEDED, "too many links")
        link = Link(
            name=perf.name,
            handle=perf.handle,
            role=perf.role,
            session=session,
            source=perf.source,
            target=perf.target,
            properties=perf.properties,
            snd_settle_mode=perf.snd_settle_mode if perf.snd_settle_mode is not None else 2,
            rcv_settle_mode=perf.rcv_settle_mode or 0,
            peer_max_message_size=perf.max_message_size,
            desired_capabilities=perf.desired_capabilities,
        )
        if perf.role == ROLE_SENDER:
            link.delivery_count = perf.initial_delivery_count or 0
        session.links[perf.handle] = link
        self._link_count += 1
        self._events.append(LinkAttached(link))

    def _send_attach(
        self,
        link: Link,
        max_message_size: int | None,
        properties: dict[Any, Any] | None,
        offered_capabilities: Any,
        *,
        refused: bool,
    ) -> None:
        used = {x.local_handle for x in link.session.links.values()}
        link.local_handle = next(h for h in range(self.limits.handle_max + 1) if h not in used)
        ours_sender = link.is_server_sender
        attach = Attach(
            name=link.name,
            handle=link.local_handle,
            role=not link.role,
            snd_settle_mode=link.snd_settle_mode,
            rcv_settle_mode=0,
            # A refusal leaves out the terminus the peer asked us to create.
            source=None if refused and ours_sender else link.source,
            target=None if refused and not ours_sender else link.target,  # type: ignore[arg-type]
            initial_delivery_count=0 if ours_sender else None,
            max_message_size=None if max_message_size is None else Ulong(max_message_size),
            offered_capabilities=offered_capabilities,
            properties=properties,
        )
        link.attached = True
        self._out.append(encode_frame(link.session.channel, attach))

    def _on_flow(self, channel: int, perf: Flow, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        if perf.next_incoming_id is not None:
            session.remote_incoming_window = (
                perf.next_incoming_id + perf.incoming_window - session.next_outgoing_id
            ) % _UINT_MOD
        else:
            session.remote_incoming_window = perf.incoming_window
        session.remote_outgoing_window = perf.outgoing_window
        link = None
        answered = False
        if perf.handle is not None:
            link = session.links.get(perf.handle)
            if link is None:
                if perf.handle in session.detaching:
                    return  # sent before our detach reached the peer
                raise _Violation(Condition.UNATTACHED_HANDLE, f"flow for handle {perf.handle}")
            if link.is_server_sender and perf.link_credit is not None:
                # The receiver's view: credit counts from its delivery-count.
                their_count = perf.delivery_count if perf.delivery_count is not None else 0
                link.credit = max(0, their_count + perf.link_credit - link.delivery_count)
                self._pump(link)
                if perf.drain and link.credit:
                    # Nothing more to send: use up the credit and say so.
                    link.delivery_count = (link.delivery_count + link.credit) % _UINT_MOD
                    link.credit = 0
                    self._send_drained(link)
                    answered = True
            if perf.echo and link.attached and not answered:
                self._send_link_flow(link)
        elif perf.echo:
            self._send_session_flow(session)
        self._events.append(Flowed(link, perf))

    def _on_transfer(self, channel: int, perf: TransferFrame, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        link = session.links.get(perf.handle)
        session.next_incoming_id = (session.next_incoming_id + 1) % _UINT_MOD
        if link is None and perf.handle in session.detaching:
            # Sent before our detach reached the peer: dropped (the peer learns from the
            # detach that the delivery went nowhere).
            session.incoming_window -= 1
            self._reopen_window(session)
            return
        if link is None or link.detached:
            raise _Violation(Condition.UNATTACHED_HANDLE, f"transfer on handle {perf.handle}")
        if link.is_server_sender:
            raise _Violation(Condition.NOT_ALLOWED, "transfer on a link where we send")
        session.incoming_window -= 1
        self._reopen_window(session)
        self._on_delivery_frame(link, perf, payload)

    def _reopen_window(self, session: Session) -> None:
        if session.incoming_window < 0:
            raise _Violation(Condition.WINDOW_VIOLATION, "transfer beyond the incoming window")
        if session.incoming_window <= self.limits.incoming_window // 2:
            session.incoming_window = self.limits.incoming_window
            self._send_session_flow(session)

    def _on_delivery_frame(self, link: Link, perf: TransferFrame, payload: bytes) -> None:
        part = link._partial
        if part is None:
            if perf.delivery_id is None or perf.delivery_tag is None:
                raise _Violation(Condition.NOT_ALLOWED, "a delivery without id or tag")
            part = _Partial(
                perf.delivery_id,
                perf.delivery_tag,
                perf.message_format or 0,
                bool(perf.settled),
                perf.state,
                [],
                0,
            )
            link._partial = part
        elif perf.delivery_id is not None and perf.delivery_id != part.delivery_id:
            raise _Violation(Condition.NOT_ALLOWED, "a new delivery before the last one ended")
        if perf.settled:
            part.settled = True
        if perf.state is not None:
            part.state = perf.state
        part.size += len(payload)
        if part.size > _size_limit(link, self.limits):
            part.oversize = True
            self._buffered -= sum(len(c) for c in part.chunks)
            part.chunks.clear()  # its bytes are dropped as they come
        elif payload:
            part.chunks.append(payload)
            self._buffered += len(payload)
        if perf.aborted:
            self._drop_partial(link)
            return
        if perf.more:
            # Never below one whole message: that one is only rejected, at its end.
            if self._buffered > max(self.limits.max_buffered_bytes, self.limits.max_message_size):
                raise _Violation(
                    Condition.RESOURCE_LIMIT_EXCEEDED, "too many bytes in unfinished deliveries"
                )
            return
        self._drop_partial(link)
        self._complete(link, part)

    def _drop_partial(self, link: Link) -> None:
        part = link._partial
        if part is not None:
            self._buffered -= sum(len(c) for c in part.chunks)
            link._partial = None

    def _complete(self, link: Link, part: _Partial) -> None:
        over_credit = link.credit <= 0
        link.credit = max(0, link.credit - 1)
        link.delivery_count = (link.delivery_count + 1) % _UINT_MOD
        if part.oversize:
            if not part.settled:
                self.settle(
                    link,
                    part.delivery_id,
                    _rejected_size(part.size, _size_limit(link, self.limits)),
                )
            self._events.append(
                TransferRefused(link, part.delivery_id, Condition.MESSAGE_SIZE_EXCEEDED, part.size)
            )
            return
        payload = part.chunks[0] if len(part.chunks) == 1 else b"".join(part.chunks)
        self._events.append(
            Transfer(
                link,
                part.delivery_id,
                part.delivery_tag,
                part.message_format,
                payload,
                part.settled,
                part.state,
                over_credit,
            )
        )

    def _on_disposition(self, channel: int, perf: Disposition, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        last = perf.last if perf.last is not None else perf.first
        self._events.append(Settled(session, perf.first, last, perf.state))

    def _on_detach(self, channel: int, perf: Detach, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        link = session.links.get(perf.handle)
        if link is None:
            session.detaching.discard(perf.handle)
            return  # the answer to our detach, or one crossing it: nothing more to say
        if not link.attached:
            self._send_attach(link, None, None, None, refused=True)
        self._send_detach(link, None, closed=bool(perf.closed))
        self._forget(link, peer_detached=True)
        self._events.append(LinkDetached(link, perf.error))

    def _on_end(self, channel: int, perf: End, payload: bytes) -> None:
        session = self._session(channel)
        if session is None:
            return
        self._out.append(encode_frame(session.channel, End()))
        self._drop_session(session)
        self._events.append(SessionEnded(session, perf.error))

    def _on_close(self, channel: int, perf: Close, payload: bytes) -> None:
        self._out.append(encode_frame(0, Close()))
        self._events.append(Closed(perf.error))
        self._finish()

    # -- output helpers ---------------------------------------------------------------

    def _send_detach(self, link: Link, error: Error | None, *, closed: bool) -> None:
        link.detached = True
        frame = Detach(handle=link.local_handle, closed=closed, error=error)
        self._out.append(encode_frame(link.session.channel, frame))

    def _forget(self, link: Link, *, peer_detached: bool = False) -> None:
        self._drop_partial(link)
        if not peer_detached:
            # Until the peer's detach arrives, its frames for this handle are dropped.
            link.session.detaching.add(link.handle)
        if link.session.links.pop(link.handle, None) is not None:
            self._link_count -= 1

    def _drop_session(self, session: Session) -> None:
        session.ended = True
        for link in session.links.values():
            link.detached = True
            self._drop_partial(link)
        self._link_count -= len(session.links)
        session.links.clear()
        self.sessions.pop(session.remote_channel, None)
        self._ended.add(session.remote_channel)

    def _send_session_flow(self, session: Session) -> None:
        frame = Flow(
            next_incoming_id=session.next_incoming_id,
            incoming_window=session.incoming_window,
            next_outgoing_id=session.next_outgoing_id,
            outgoing_window=0x7FFFFFFF,
        )
        self._out.append(encode_frame(session.channel, frame))

    def _send_link_flow(self, link: Link) -> None:
        s = link.session
        self._out.append(
            _flow_frame(
                s.channel,
                (
                    s.next_incoming_id,
                    s.incoming_window,
                    s.next_outgoing_id,
                    0x7FFFFFFF,
                    link.local_handle,
                    link.delivery_count,
                    link.credit,
                ),
            )
        )

    def _send_drained(self, link: Link) -> None:
        s = link.session
        frame = Flow(
            next_incoming_id=s.next_incoming_id,
            incoming_window=s.incoming_window,
            next_outgoing_id=s.next_outgoing_id,
            outgoing_window=0x7FFFFFFF,
            handle=link.local_handle,
            delivery_count=link.delivery_count,
            link_credit=0,
            drain=True,
        )
        self._out.append(encode_frame(s.channel, frame))

    def _pump(self, link: Link) -> None:
        """Send queued replies while the peer's credit lasts."""
        session = link.session
        while link._queued and link.credit > 0 and not link.detached:
            payload, message_format = link._queued.pop(0)
            tag = link.delivery_count.to_bytes(4, "big")
            self._send_transfer(link, session, tag, payload, message_format)
            link.credit -= 1
            link.delivery_count = (link.delivery_count + 1) % _UINT_MOD

    def _send_transfer(
        self, link: Link, session: Session, tag: bytes, payload: bytes, message_format: int
    ) -> None:
        delivery_id = session.next_outgoing_id
        room = self.peer_max_frame_size - 64 - len(tag)  # header and performative
        first = True
        pos = 0
        while True:
            chunk = payload[pos : pos + room]
            pos += len(chunk)
            more = pos < len(payload)
            frame = TransferFrame(
                handle=link.local_handle,
                delivery_id=delivery_id if first else None,
                delivery_tag=tag if first else None,
                message_format=message_format if first else None,
                settled=True if first else None,
                more=more,
            )
            self._out.append(encode_frame(session.channel, frame, chunk))
            session.next_outgoing_id = (session.next_outgoing_id + 1) % _UINT_MOD
            first = False
            if not more:
                return

    def _violation(self, condition: str, description: str) -> None:
        log.info("AMQP protocol violation: %s: %s", condition, description)
        self._events.append(ProtocolViolation(condition, description))
        if self.opened or self._state == _ST_OPEN:
            self.close(condition, description)
        else:
            self._finish()

    def _finish(self) -> None:
        self._state = _ST_DONE
        self.finished = True
        self._in.clear()


class _Violation(Exception):
    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.condition = condition


def _decode_condition(exc: DecodeError) -> str:
    return Condition.FRAMING_ERROR if isinstance(exc, FrameError) else Condition.DECODE_ERROR


def _size_limit(link: Link, limits: Limits) -> int:
    """A link's message size limit: what `accept_attach` set, or, for a transfer pipelined
    behind its attach before the application answered it, the connection's own limit."""
    return link.max_message_size if link.attached else limits.max_message_size


def _rejected_size(size: int, limit: int) -> DeliveryState:
    return Rejected(
        Error(
            Condition.MESSAGE_SIZE_EXCEEDED,
            f"the message is {size} bytes, over the link's limit of {limit}",
            {},
        )
    )


_HANDLERS: dict[type, Any] = {
    Begin: ServerConnection._on_begin,
    Attach: ServerConnection._on_attach,
    Flow: ServerConnection._on_flow,
    TransferFrame: ServerConnection._on_transfer,
    Disposition: ServerConnection._on_disposition,
    Detach: ServerConnection._on_detach,
    End: ServerConnection._on_end,
    Close: ServerConnection._on_close,
}
