"""A scripted AMQP client: proton's engine driven by hand over one socket, so a test can
reproduce another SDK's wire habits exactly (its SASL mechanism, link names, reply-to,
message-id types, sessions, message formats) without that SDK.

Every wait has a deadline: a broker that never answers fails the test with TimeoutError.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from proton import (
    UNDESCRIBED,
    Array,
    Collector,
    Connection,
    Data,
    Described,
    Endpoint,
    Link,
    Message,
    Transport,
    symbol,
    ulong,
)

from sblocal import codec

SASL_HEADER = b"AMQP\x03\x01\x00\x00"
_SASL_INIT = 0x41
_SASL_MECHANISMS = 0x40
_SASL_OUTCOME = 0x44


def sasl_frame(code: int, fields: list[Any]) -> bytes:
    body = codec.encode_value(Described(ulong(code), fields))
    return struct.pack(">IBBH", 8 + len(body), 2, 1, 0) + body


def read_frame(sock: socket.socket | ssl.SSLSocket) -> tuple[int, Any]:
    """One SASL frame: (descriptor code, fields)."""
    head = _read_exactly(sock, 8)
    size = struct.unpack(">I", head[:4])[0]
    body = _read_exactly(sock, size - 8)
    data = Data()
    data.decode(body)
    value = data.get_object()
    return int(value.descriptor), list(value.value)


def _read_exactly(sock: socket.socket | ssl.SSLSocket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def raw_sasl(sock: socket.socket | ssl.SSLSocket, mechanism: str) -> tuple[list[str], int]:
    """The SASL exchange written by hand: returns (the mechanisms offered, the outcome code)."""
    sock.sendall(SASL_HEADER)
    header = _read_exactly(sock, 8)
    assert header == SASL_HEADER, header
    code, fields = read_frame(sock)
    assert code == _SASL_MECHANISMS, code
    offered = fields[0]
    mechanisms = [str(m) for m in (offered if isinstance(offered, list | Array) else [offered])]
    if isinstance(offered, Array):
        mechanisms = [str(m) for m in offered.elements]
    sock.sendall(sasl_frame(_SASL_INIT, [symbol(mechanism), b"", "localhost"]))
    code, fields = read_frame(sock)
    assert code == _SASL_OUTCOME, code
    return mechanisms, int(fields[0])


def symbols(*names: str) -> Array:
    return Array(UNDESCRIBED, Data.SYMBOL, *[symbol(n) for n in names])


class ScriptedPeer:
    """One client connection: ``mechanism=None`` lets proton's own SASL client pick
    ANONYMOUS; a name runs the exchange by hand with that mechanism first."""

    def __init__(
        self,
        port: int,
        *,
        mechanism: str | None = None,
        tls: ssl.SSLContext | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.timeout = timeout
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock: socket.socket | ssl.SSLSocket = (
            tls.wrap_socket(raw, server_hostname="localhost") if tls is not None else raw
        )
        self.offered: list[str] = []
        self.transport = Transport()
        if mechanism is None:
            self.transport.sasl().allowed_mechs("ANONYMOUS")
        else:
            self.offered, outcome = raw_sasl(self.sock, mechanism)
            if outcome != 0:
                raise ConnectionRefusedError(f"SASL outcome {outcome}")
        self.connection = Connection()
        self.connection.container = "scripted-peer"
        self.connection.hostname = "localhost"
        self.collector = Collector()
        self.connection.collect(self.collector)
        self.transport.bind(self.connection)
        self.sock.setblocking(False)
        self.connection.open()
        self.wait(lambda: bool(self.connection.state & Endpoint.REMOTE_ACTIVE))

    def close(self) -> None:
        self.connection.close()
        try:
            self.pump(0.05)
        except (OSError, TimeoutError):
            pass
        self.sock.close()

    def pump(self, seconds: float) -> None:
        """Move bytes both ways for up to ``seconds``."""
        end = time.monotonic() + seconds
        while True:
            pending = self.transport.pending()
            while pending > 0:
                try:
                    sent = self.sock.send(self.transport.peek(pending))
                except (BlockingIOError, ssl.SSLWantWriteError):
                    break
                self.transport.pop(sent)
                pending = self.transport.pending()
            left = end - time.monotonic()
            if left <= 0:
                return
            pending_tls = isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0
            if not pending_tls:
                readable, _, _ = select.select([self.sock], [], [], min(left, 0.02))
                if not readable:
                    continue
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            if not data:
                raise ConnectionError("the broker closed the socket")
            self.transport.push(data)
            while self.collector.peek() is not None:
                self.collector.pop()

    def wait(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the broker did not answer in time")
            self.pump(0.02)

    # -- links -----------------------------------------------------------------------------

    def sender(
        self,
        name: str,
        target: str,
        *,
        session: Any = None,
    ) -> Link:
        ssn = session or self.session()
        link = ssn.sender(name)
        link.target.address = target
        link.source.address = name
        link.open()
        self.wait(lambda: bool(link.state & Endpoint.REMOTE_ACTIVE))
        return link

    def receiver(
        self,
        name: str,
        source: str,
        *,
        target: str | None = None,
        session: Any = None,
        credit: int = 10,
    ) -> Link:
        ssn = session or self.session()
        link = ssn.receiver(name)
        link.source.address = source
        if target is not None:
            link.target.address = target
        link.open()
        self.wait(lambda: bool(link.state & Endpoint.REMOTE_ACTIVE))
        link.flow(credit)
        return link

    def session(self) -> Any:
        ssn = self.connection.session()
        ssn.open()
        return ssn

    def send(self, link: Link, payload: bytes, *, tag: bytes, message_format: int = 0) -> Any:
        """One transfer; returns its delivery once the broker settled it."""
        delivery = link.delivery(tag)
        if message_format:
            _set_message_format(delivery, message_format)
        link.send(payload)
        link.advance()
        self.wait(lambda: bool(delivery.remote_state) or delivery.settled)
        return delivery

    def request(self, sender: Link, receiver: Link, request: Message) -> Message:
        """Send a request (``$cbs`` or ``$management``) and wait for its reply."""
        self.send(sender, request.encode(), tag=str(time.monotonic_ns()).encode())
        self.wait(lambda: receiver.current is not None and not receiver.current.partial)
        delivery = receiver.current
        data = receiver.recv(delivery.pending)
        receiver.advance()
        delivery.update(delivery.ACCEPTED)
        delivery.settle()
        reply = Message()
        reply.decode(data)
        return reply


def _set_message_format(delivery: Any, message_format: int) -> None:
    """proton's Python binding has no setter for a delivery's message format: the C call is
    made through the binding's own FFI library, where it is declared."""
    from cproton_ffi import lib

    setter = getattr(lib, "pn_delivery_set_message_format", None)
    if setter is None:
        raise RuntimeError("this proton build cannot set a delivery's message format")
    setter(delivery._impl, message_format)
