"""What the SDK's pyamqp needs to let several handlers share one connection safely.

pyamqp has no reader task: each handler polls the socket itself (`connection.listen`), and
a frame it reads is dispatched to whichever session and link it belongs to. On a connection
of its own a handler is the only poller, so pyamqp can write a frame and set the endpoint's
state *after* the write returns. On a shared connection another handler polls meanwhile and
may read the peer's answer in that window, which then meets the old state:

* `Link.attach` writes ATTACH, then sets ATTACH_SENT: the peer's ATTACH read in between
  leaves ATTACHED, which the late ATTACH_SENT overwrites — the link never becomes ready and
  its open times out. And the session's BEGIN answer, read while `attach` waits for the
  socket, makes the session attach its still-DETACHED links a second time: the peer closes
  the whole connection ("link name already attached"), failing every link on it.
* `Session.begin` writes BEGIN, then sets BEGIN_SENT: an answer read in between finds the
  session UNMAPPED, takes it for the peer's own BEGIN and answers with a second one.
* `Session.end` and `Link.detach` likewise: the answer read in between finds the endpoint
  still mapped or attached, and pyamqp answers a close that needs none — a frame on an
  ended channel or a detached handle, which the peer may treat as a protocol error.
* A queued delivery is marked sent, and the session's next delivery id advanced, only after
  its TRANSFER is written: a link ATTACH answer read meanwhile sends the same delivery again
  (`update_pending_deliveries`) with the same delivery id, and the peer closes the
  connection ("sequencing error").

`install` makes each of these set the state first and write second (the frame is built from
the same fields), sends each delivery once, and writes one TRANSFER at a time per session;
answers then always meet the state the frame implies. Two more, for
CPU only: a TRANSFER whose message is already encoded (`Encoded`, from
`gateway.servicebus.internals.lean`) is sent as it is, and a TRANSFER performative is encoded once
where pyamqp encodes it twice (the session measures it, then the transport encodes it again:
`_measured_frame`, `_sent_frame`). It patches the
classes of the pinned azure-servicebus (`encoding.SDK_VERSION`) only, once per process;
with any other version it returns False and the pool does not share connections
(`gateway.servicebus.internals.pool`). tests/broker/test_pooled_links.py and
tests/gateway/test_many_entities.py fail without it.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from azure.servicebus._pyamqp import _encode
from azure.servicebus._pyamqp.aio import _session_async, _transport_async
from azure.servicebus._pyamqp.aio._link_async import Link
from azure.servicebus._pyamqp.aio._sender_async import SenderLink
from azure.servicebus._pyamqp.aio._session_async import Session
from azure.servicebus._pyamqp.constants import (
    OUTGOING_WINDOW,
    LinkDeliverySettleReason,
    LinkState,
    SessionState,
    SessionTransferState,
)
from azure.servicebus._pyamqp.performatives import TransferFrame

from gateway.servicebus.internals.encoding import _described_list
from gateway.servicebus.internals.switch import version_matches

_installed = False


# What `install` replaces or wraps, as they were before any patch, by dotted name: the guard
# (`relied_on.RELIED_ON`, tests/gateway/test_sdk_seam.py) hashes these, not our replacements.
def _named(*functions: Any) -> dict[str, Any]:
    return {f"{f.__module__}.{f.__qualname__}": f for f in functions}


ORIGINALS: dict[str, Any] = _named(
    Session._outgoing_attach,
    Session.begin,
    Session.end,
    Session._outgoing_transfer,
    Link.attach,
    Link.detach,
    Link._set_state,
    SenderLink._outgoing_transfer,
    _encode.encode_frame,
)


async def _session_outgoing_attach(self: Any, frame: Any) -> None:
    # The frame is built (with the DETACHED-only fields); mark its link sent before writing.
    link = self.links.get(frame.name)
    if link is not None and link.state == LinkState.DETACHED:
        link.state = LinkState.ATTACH_SENT
    await self._connection._process_outgoing_frame(self.channel, frame)


async def _link_attach(self: Any) -> None:
    if self._is_closed:
        raise ValueError("Link already closed.")
    if self.state != LinkState.DETACHED:
        return  # the session attached it when its BEGIN answer was read
    await self._outgoing_attach()
    await self._set_state(LinkState.ATTACH_SENT)


_link_set_state: Any = Link._set_state


async def _link_set_state_patched(self: Any, new_state: Any) -> None:
    if new_state == LinkState.ATTACH_SENT and self.state == LinkState.ATTACHED:
        return  # the answer was read while the ATTACH was being written
    await _link_set_state(self, new_state)


async def _link_detach(self: Any, close: bool = False, error: Any = None) -> None:
    if self.state in (LinkState.DETACHED, LinkState.DETACH_SENT, LinkState.ERROR):
        return
    try:
        self._check_if_closed()
        if self.state in (LinkState.ATTACH_SENT, LinkState.ATTACH_RCVD):
            await self._outgoing_detach(close=close, error=error)
            await self._set_state(LinkState.DETACHED)
        elif self.state == LinkState.ATTACHED:
            await self._set_state(LinkState.DETACH_SENT)
            await self._outgoing_detach(close=close, error=error)
    except Exception:  # as pyamqp: a failed detach leaves the link detached
        await self._set_state(LinkState.DETACHED)


async def _session_begin(self: Any, wait: bool = False) -> None:
    if self.state == SessionState.UNMAPPED:
        await self._set_state(SessionState.BEGIN_SENT)
        await self._outgoing_begin()
    else:  # answering the peer's BEGIN: pyamqp's own order (its frame reads the state)
        await self._outgoing_begin()
        await self._set_state(SessionState.BEGIN_SENT)
    if wait:
        await self._wait_for_response(wait, SessionState.BEGIN_SENT)
    elif not self.allow_pipelined_open:
        raise ValueError(
            "Connection has been configured to not allow piplined-open. "
            "Please set 'wait' parameter."
        )


async def _session_end(self: Any, error: Any = None, wait: bool = False) -> None:
    try:
        new_state = SessionState.DISCARDING if error else SessionState.END_SENT
        if self.state not in (SessionState.UNMAPPED, SessionState.DISCARDING):
            links = list(self.links.values())
            for link in links:  # before END: no DETACH may follow it on this channel
                await link.detach()
            await self._set_state(new_state)
            await self._outgoing_end(error=error)
        else:
            await self._set_state(new_state)
        await self._wait_for_response(wait, SessionState.UNMAPPED)
    except Exception:  # as pyamqp: a failed end leaves the session unmapped
        await self._set_state(SessionState.UNMAPPED)


_session_transfer: Any = Session._outgoing_transfer
_sender_transfer: Any = SenderLink._outgoing_transfer


async def _session_outgoing_transfer(self: Any, delivery: Any, trace: Any) -> None:
    # One TRANSFER at a time per session: the delivery id is read before the write and
    # advanced after it.
    lock = self.__dict__.get("_sbgate_transfers")
    if lock is None:
        lock = self.__dict__["_sbgate_transfers"] = asyncio.Lock()
    async with lock:
        await _session_transfer(self, delivery, trace)
        # pyamqp counts the outgoing window down at every transfer and never back up (it
        # only tells the peer, in BEGIN and FLOW, how many more transfers may come), and
        # encodes a window below -255 as an error: the session's next FLOW would raise in
        # whichever task writes it — for a connection's shared `$cbs` session, which sends a
        # put-token per sender open and a FLOW per answer, its reader. Open it again.
        if self.outgoing_window < 1:
            self.outgoing_window = OUTGOING_WINDOW


class Encoded:
    """A message's payload, already encoded (`encoding.encode`), given to
    `SenderLink.send_transfer` in place of a pyamqp `Message` (`lean`)."""

    __slots__ = ("payload",)
    _code = 0  # the message format: pyamqp's `Message._code`

    def __init__(self, payload: bytearray) -> None:
        self.payload = payload


async def _encoded_transfer(self: Any, delivery: Any) -> bool:
    """`SenderLink._outgoing_transfer` for an `Encoded` message: the same frame, the payload
    as it is instead of `encode_payload(message)`."""
    delivery_count = self.delivery_count + 1
    delivery.frame = {
        "handle": self.handle,
        "delivery_tag": struct.pack(">I", abs(delivery_count)),
        "message_format": delivery.message._code,
        "settled": delivery.settled,
        "more": False,
        "rcv_settle_mode": None,
        "state": None,
        "resume": None,
        "aborted": None,
        "batchable": None,
        "payload": delivery.message.payload,
    }
    await self._session._outgoing_transfer(
        delivery, self.network_trace_params if self.network_trace else None
    )
    sent_and_settled = False
    if delivery.transfer_state == SessionTransferState.OKAY:
        self.delivery_count = delivery_count
        self.current_link_credit -= 1
        delivery.sent = True
        if delivery.settled:
            await delivery.on_settled(LinkDeliverySettleReason.SETTLED, None)
            sent_and_settled = True
    return sent_and_settled


async def _sender_outgoing_transfer(self: Any, delivery: Any) -> bool:
    # Each delivery once: `sent` is only set after the write, so mark it before.
    if delivery.__dict__.get("_sbgate_sending"):
        return False
    delivery.__dict__["_sbgate_sending"] = True
    try:
        if isinstance(delivery.message, Encoded):
            return await _encoded_transfer(self, delivery)
        return bool(await _sender_transfer(self, delivery))
    finally:
        if not delivery.sent:  # not written (session busy or unmapped): may be sent later
            delivery.__dict__["_sbgate_sending"] = False


_encode_frame: Any = _encode.encode_frame
_FRAME_HEAD = _encode._FRAME_OFFSET + _encode._FRAME_TYPE  # after the size: an AMQP frame
# The last TRANSFER performative the session measured: its fields but the payload, and its
# encoding (`_measured_frame`).
_last_transfer: list[Any] = [None, b""]


# TransferFrame's fields but the payload (`TransferFrame._definition`) with the encoder
# `encode_value` picks for each declared type; `state` (a described delivery state) has none
# here: a frame with one is encoded by pyamqp.
_TRANSFER_FIELDS = (
    _encode.encode_uint,  # handle
    _encode.encode_uint,  # delivery_id
    _encode.encode_binary,  # delivery_tag
    _encode.encode_uint,  # message_format
    _encode.encode_boolean,  # settled
    _encode.encode_boolean,  # more
    _encode.encode_ubyte,  # rcv_settle_mode
    None,  # state
    _encode.encode_boolean,  # resume
    _encode.encode_boolean,  # aborted
    _encode.encode_boolean,  # batchable
)
_TRANSFER_DESCRIPTOR = b"\x00\x53\x14"  # described, smallulong 0x14


def _measured_frame(frame: Any, **kwargs: Any) -> Any:
    """`encode_frame` where `Session._outgoing_transfer` measures the TRANSFER performative
    (the frame with an empty payload) before it sends it: encoded field by field, without
    pyamqp's generic walk (`encoding._described_list`, as for a message's properties), and
    kept for `_sent_frame`, which sends that same frame next."""
    if kwargs or not isinstance(frame, TransferFrame) or frame.payload or frame.state is not None:
        return _encode_frame(frame, **kwargs)
    fields = frame[:-1]
    encoded = _plain_transfer(fields)
    if encoded is None:
        performative = bytearray()
        try:
            _described_list(performative, _TRANSFER_DESCRIPTOR, fields, _TRANSFER_FIELDS)
        except (TypeError, ValueError, struct.error):  # a field not of its type: pyamqp decides
            return _encode_frame(frame, **kwargs)
        encoded = bytes(performative)
    _last_transfer[:] = [fields, encoded]
    return (len(encoded) + 8).to_bytes(4, "big") + _FRAME_HEAD, encoded


# pyamqp's encodings of a boolean field (`encode_boolean`, with its constructor) and of null.
_BOOLEAN = {None: b"\x40", True: b"\x56\x01", False: b"\x56\x00"}
_UINT_LIMIT = 2**32


def _uint(value: Any) -> bytes:
    """`encode_uint` of a plain int in range (anything else raises KeyError: not here)."""
    if type(value) is not int or not 0 <= value < _UINT_LIMIT:
        raise KeyError(value)
    if value == 0:
        return b"\x43"
    if value <= 255:
        return bytes((0x52, value))
    return b"\x70" + value.to_bytes(4, "big")


def _plain_transfer(fields: Any) -> bytes | None:
    """The TRANSFER performative every send writes (plain ints, a short binary tag, the
    settled and more flags, nothing else), as `_described_list` encodes it, byte for byte,
    without its walk over eleven encoders; None for any other, which takes that walk."""
    handle, delivery_id, tag, message_format, settled, more, *rest = fields
    if rest != _FIVE_NULLS or type(tag) is not bytes or len(tag) > 255:
        return None
    try:
        body = b"".join(
            (
                _uint(handle),
                _uint(delivery_id),
                b"\xa0",
                bytes((len(tag),)),
                tag,
                _uint(message_format),
                _BOOLEAN[settled],
                _BOOLEAN[more],
                b"\x40\x40\x40\x40\x40",
            )
        )
    except KeyError:
        return None
    if len(body) >= 255:  # a list32 then: the walk decides
        return None
    return _TRANSFER_DESCRIPTOR + bytes((0xC0, len(body) + 1, 11)) + body


_FIVE_NULLS = [None] * 5


def _sent_frame(frame: Any, **kwargs: Any) -> Any:
    """`encode_frame` for the transport: a TRANSFER whose fields are those just measured is
    that encoding plus its payload (encoding is a function of the fields), instead of being
    encoded a second time; any other frame as pyamqp encodes it."""
    if kwargs or not isinstance(frame, TransferFrame) or frame[:-1] != _last_transfer[0]:
        return _encode_frame(frame, **kwargs)
    data = bytearray(_last_transfer[1])
    data += frame.payload or b""
    return (len(data) + 8).to_bytes(4, "big") + _FRAME_HEAD, data


def installed() -> bool:
    """Whether `install` patched pyamqp in this process (the pool shares connections then)."""
    return _installed


def install() -> bool:
    """Patch pyamqp for shared connections (idempotent); False when the installed SDK is
    not the pinned one (the pool then gives each sender its own connection). Process-wide:
    every pyamqp session and link from then on runs on the patched methods, the syphon's
    receivers' too. Called by the app's wiring (`gateway.servicebus.internals.install`)."""
    global _installed
    if not version_matches():
        return False
    if not _installed:
        patched: Any = Session
        patched._outgoing_attach = _session_outgoing_attach
        patched.begin = _session_begin
        patched.end = _session_end
        link: Any = Link
        link.attach = _link_attach
        link._set_state = _link_set_state_patched
        link.detach = _link_detach
        patched._outgoing_transfer = _session_outgoing_transfer
        sender: Any = SenderLink
        sender._outgoing_transfer = _sender_outgoing_transfer
        session_module: Any = _session_async
        session_module.encode_frame = _measured_frame
        transport_module: Any = _transport_async
        transport_module.encode_frame = _sent_frame
        _installed = True
    return True
