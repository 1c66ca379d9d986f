"""The bytes between a client's socket and proton's transport.

proton's own SASL server offers only the mechanisms it implements, its Python binding does
not tell a delivery's message format, and the broker wants TLS from the standard library's
`ssl` (the development certificate of `sblocal.certs`). So every accepted socket goes
through a `FrontLayer`, which proton's I/O handler drives as if it were the transport:

* **TLS** (optional): an `ssl.SSLObject` over memory buffers; proton sees plaintext.
* **SASL**: answered here, offering ``MSSBCBS`` and ``ANONYMOUS``. The .NET SDK's only
  mechanism is an anonymous one named ``MSSBCBS``; Python and Node pick ``ANONYMOUS``. Either
  way the client is not authenticated here: its `$cbs` token is what authorizes it. A
  client that skips SASL (an AMQP header first) goes straight to proton.
* **Message formats**: `FrameSniffer` reads the performative of each incoming frame and
  keeps the message format of every transfer that is not 0 (a Service Bus batch is
  0x80013700), keyed by link name and delivery tag, for the delivery handler to ask.

The proton transport behind it has no SASL layer of its own.
"""

from __future__ import annotations

import logging
import ssl
import struct
from typing import Any, cast

from proton import Data, Described, Transport, symbol, ubyte, ulong

from sblocal import codec

_log = logging.getLogger(__name__)

MECHANISMS = ("MSSBCBS", "ANONYMOUS")
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
BATCH_FORMAT = 0x80013700

_SASL_MECHANISMS = 0x40
_SASL_INIT = 0x41
_SASL_OUTCOME = 0x44
_SASL_OK = 0
_SASL_AUTH = 1
_MAX_SASL_FRAME = 64 * 1024

_ATTACH = 0x12
_TRANSFER = 0x14
_DETACH = 0x16
_END = 0x17
_WATCHED = frozenset({_ATTACH, _TRANSFER, _DETACH, _END})
# Transfers whose delivery never completes (an aborted batch) leave an entry behind: past
# this many the table is cleared, which at worst reads one such batch as a single message.
_MAX_PENDING_FORMATS = 10_000


def _sasl_frame(code: int, fields: list[Any]) -> bytes:
    body = codec.encode_value(Described(ulong(code), fields))
    return struct.pack(">IBBH", 8 + len(body), 2, 1, 0) + body


def _mechanisms_frame() -> bytes:
    from proton import UNDESCRIBED, Array

    offered = Array(cast(Any, UNDESCRIBED), Data.SYMBOL, *[symbol(m) for m in MECHANISMS])
    return _sasl_frame(_SASL_MECHANISMS, [offered])


def _performative(body: bytes) -> tuple[int, list[Any]] | None:
    """The descriptor code and fields of a frame body's performative, or None."""
    value = codec.decode_value(body)
    if not isinstance(value, Described) or not isinstance(value.value, list):
        return None
    try:
        return int(cast(Any, value.descriptor)), value.value
    except (TypeError, ValueError):
        return None


def delivery_tag(delivery: Any) -> bytes:
    """A delivery's tag as bytes: the binding's `Delivery.tag` decodes it as UTF-8, which
    fails on a binary tag (a GUID's, say)."""
    from cproton_ffi import ffi, lib  # type: ignore[import-not-found]

    tag = lib.pn_delivery_tag(delivery._impl)
    return bytes(ffi.unpack(tag.start, tag.size))


class FrameSniffer:
    """Follows the client's frames (after the AMQP header) to learn transfer formats."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._header_left = len(AMQP_HEADER)
        self._links: dict[tuple[int, int], str] = {}  # (channel, handle) -> sender link name
        self._formats: dict[tuple[str, bytes], int] = {}

    def message_format(self, link_name: str, delivery: Any) -> int:
        """The format of ``delivery`` on link ``link_name`` (once: it is then forgotten)."""
        if not self._formats:
            return 0
        return self._formats.pop((link_name, delivery_tag(delivery)), 0)

    def feed(self, data: bytes) -> None:
        if self._header_left:
            skipped = min(self._header_left, len(data))
            self._header_left -= skipped
            data = data[skipped:]
        self._buf += data
        while len(self._buf) >= 8:
            size, doff, ftype, channel = struct.unpack_from(">IBBH", self._buf)
            if size < 8 or doff < 2:
                self._buf.clear()  # malformed: proton closes the connection itself
                return
            if len(self._buf) < size:
                return
            start = doff * 4
            if ftype == 0 and size > start:
                self._frame(channel, bytes(self._buf[start:size]))
            del self._buf[:size]

    def _frame(self, channel: int, body: bytes) -> None:
        # The common encoding of a performative's descriptor: 0x00 0x53 <code>.
        if len(body) >= 3 and body[0] == 0x00 and body[1] == 0x53 and body[2] not in _WATCHED:
            return
        try:
            parsed = _performative(body)
        except Exception:  # proton raises several types on malformed input
            return
        if parsed is None:
            return
        code, fields = parsed
        if code == _ATTACH and len(fields) >= 3 and fields[2] is False:
            self._links[(channel, int(fields[1]))] = str(fields[0])
        elif code == _TRANSFER and len(fields) >= 3 and fields[2] is not None:
            name = self._links.get((channel, int(fields[0])))
            if name is None:
                return
            key = (name, bytes(fields[2]))
            fmt = int(fields[3]) if len(fields) > 3 and fields[3] is not None else 0
            if fmt:
                if len(self._formats) >= _MAX_PENDING_FORMATS:
                    self._formats.clear()
                self._formats[key] = fmt
            else:
                self._formats.pop(key, None)
        elif code == _DETACH and fields:
            self._links.pop((channel, int(fields[0])), None)
        elif code == _END:
            for link_key in [k for k in self._links if k[0] == channel]:
                del self._links[link_key]


class FrontLayer:
    """Stands for the proton transport in front of proton's I/O handler (the selectable's
    ``_transport``): the same calls, with TLS, SASL and the sniffer in between."""

    def __init__(self, transport: Transport, tls: ssl.SSLContext | None = None) -> None:
        self.transport = transport
        self.sniffer = FrameSniffer()
        self._phase = "header"  # then "sasl", then "amqp" (bytes go to proton)
        self._pre = bytearray()  # client bytes before the "amqp" phase
        self._held = bytearray()  # bytes for proton that it had no room for yet
        self._out = bytearray()  # bytes for the socket ahead of proton's
        self._failing = False
        self._tls: ssl.SSLObject | None = None
        self._handshaken = False
        self._encrypted = 0  # proton's bytes in `_out` as TLS records, not yet written
        if tls is not None:
            self._in_bio = ssl.MemoryBIO()
            self._out_bio = ssl.MemoryBIO()
            self._tls = tls.wrap_bio(self._in_bio, self._out_bio, server_side=True)

    # proton's IOHandler sets and clears this on whatever it holds as the transport.
    @property
    def _selectable(self) -> Any:
        return self.transport._selectable

    @_selectable.setter
    def _selectable(self, value: Any) -> None:
        self.transport._selectable = value

    @property
    def closed(self) -> bool:
        return bool(self.transport.closed)

    def tick(self, now: float) -> float:
        return float(self.transport.tick(now))

    def close_tail(self) -> None:
        self.transport.close_tail()

    def close_head(self) -> None:
        self.transport.close_head()

    # -- input -----------------------------------------------------------------------------

    def capacity(self) -> int:
        self._flush_held()
        cap = int(self.transport.capacity())
        if cap < 0 or self._failing:
            return cap if cap < 0 else 0
        if self._phase != "amqp":
            return _MAX_SASL_FRAME
        return max(cap - len(self._held), 0)

    def push(self, data: bytes) -> None:
        if self._tls is None:
            self._plain_in(data)
            return
        self._in_bio.write(data)
        plain = bytearray()
        try:
            if not self._handshaken:
                self._tls.do_handshake()
                self._handshaken = True
            while chunk := self._tls.read(65536):
                plain += chunk
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass  # a partial record or handshake message: more bytes will come
        except ssl.SSLZeroReturnError:
            self.transport.close_tail()
        except ssl.SSLError as exc:
            _log.info("TLS failed: %s", exc)
            self._drain_tls_output()  # the alert, for the client to see why
            self._fail()
            return
        self._drain_tls_output()
        if plain:
            self._plain_in(bytes(plain))

    def _plain_in(self, data: bytes) -> None:
        if self._failing:
            return
        if self._phase == "amqp":
            self.sniffer.feed(data)
            self._held += data
            self._flush_held()
            return
        self._pre += data
        if self._phase == "header":
            if len(self._pre) < len(SASL_HEADER):
                return
            if self._pre[:8] != SASL_HEADER:
                # An AMQP header (no SASL) or anything else: proton answers it.
                self._to_amqp(bytes(self._pre))
                return
            del self._pre[:8]
            self._phase = "sasl"
            self._emit(SASL_HEADER + _mechanisms_frame())
        self._sasl()

    def _sasl(self) -> None:
        if len(self._pre) < 8:
            return
        size = struct.unpack_from(">I", self._pre)[0]
        if size < 8 or size > _MAX_SASL_FRAME:
            self._fail()
            return
        if len(self._pre) < size:
            return
        doff = self._pre[4]
        try:
            parsed = _performative(bytes(self._pre[doff * 4 : size]))
        except Exception:  # proton raises several types on malformed input
            parsed = None
        rest = bytes(self._pre[size:])
        if parsed is None or parsed[0] != _SASL_INIT or not parsed[1]:
            self._fail()
            return
        mechanism = str(parsed[1][0])
        if mechanism not in MECHANISMS:
            _log.info("SASL mechanism %r refused (offered: %s)", mechanism, MECHANISMS)
            self._fail()
            return
        self._emit(_sasl_frame(_SASL_OUTCOME, [ubyte(_SASL_OK)]))
        self._to_amqp(rest)

    def _to_amqp(self, data: bytes) -> None:
        self._phase = "amqp"
        self._pre.clear()
        if data:
            self._plain_in(data)

    def _flush_held(self) -> None:
        if not self._held:
            return
        cap = int(self.transport.capacity())
        if cap <= 0:
            return
        n = min(cap, len(self._held))
        self.transport.push(bytes(self._held[:n]))
        del self._held[:n]

    def _fail(self) -> None:
        """Refuse the client: a SASL outcome `auth` when SASL had started, then close."""
        if self._phase == "sasl":
            self._emit(_sasl_frame(_SASL_OUTCOME, [ubyte(_SASL_AUTH)]))
        self._failing = True
        self.transport.close_tail()

    # -- output ----------------------------------------------------------------------------

    def _emit(self, data: bytes) -> None:
        if self._tls is None:
            self._out += data
            return
        self._tls.write(data)
        self._drain_tls_output()

    def _drain_tls_output(self) -> None:
        if self._tls is not None and self._out_bio.pending:
            self._out += self._out_bio.read()

    def pending(self) -> int:
        if self._phase == "amqp" and self._tls is not None and not self._encrypted:
            waiting = int(self.transport.pending())
            if waiting > 0:
                # Taken from proton only once written (`pop`): a transport with nothing left
                # to write and its head closed is done, and its socket closed at once.
                self._emit(bytes(self.transport.peek(waiting) or b""))
                self._encrypted = waiting
            elif waiting < 0 and not self._out:
                return waiting
        if self._out:
            return len(self._out)
        if self._failing:
            self.transport.close_head()
            return -1
        if self._phase != "amqp" or self._tls is not None:
            return 0
        return int(self.transport.pending())

    def peek(self, size: int) -> bytes | None:
        if self._out:
            return bytes(self._out[:size])
        return self.transport.peek(size)

    def pop(self, size: int) -> None:
        if not self._out:
            self.transport.pop(size)
            return
        del self._out[:size]
        if not self._out and self._encrypted:
            self.transport.pop(self._encrypted)
            self._encrypted = 0
