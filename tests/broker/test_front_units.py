"""`sblocal.amqp.front`: the frame sniffer and the SASL exchange, on bytes alone."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from proton import Described, Transport, symbol, ubyte, uint, ulong

from sblocal import codec
from sblocal.amqp.front import AMQP_HEADER, BATCH_FORMAT, SASL_HEADER, FrameSniffer, FrontLayer

pytestmark = pytest.mark.unit


def _frame(
    channel: int, code: int, fields: list[Any], payload: bytes = b"", ftype: int = 0
) -> bytes:
    body = codec.encode_value(Described(ulong(code), fields)) + payload
    return struct.pack(">IBBH", 8 + len(body), 2, ftype, channel) + body


def _attach(channel: int, name: str, handle: int) -> bytes:
    return _frame(channel, 0x12, [name, uint(handle), False])


def _transfer(channel: int, handle: int, tag: bytes, fmt: int) -> bytes:
    return _frame(channel, 0x14, [uint(handle), uint(0), tag, uint(fmt)], payload=b"x" * 300)


def _formats(sniffer: FrameSniffer) -> dict[tuple[str, bytes], int]:
    return dict(sniffer._formats)


def test_the_sniffer_keeps_batch_formats_across_any_chunking() -> None:
    stream = (
        AMQP_HEADER
        + _attach(1, "sender-a", 0)
        + _attach(2, "sender-b", 0)
        + _transfer(1, 0, b"\x01", BATCH_FORMAT)
        + _transfer(2, 0, b"\x01", 0)
        + _transfer(2, 0, b"\x02", BATCH_FORMAT)
    )
    for step in (1, 7, 64, len(stream)):
        sniffer = FrameSniffer()
        for i in range(0, len(stream), step):
            sniffer.feed(stream[i : i + step])
        assert _formats(sniffer) == {
            ("sender-a", b"\x01"): BATCH_FORMAT,
            ("sender-b", b"\x02"): BATCH_FORMAT,
        }


def test_a_format_0_transfer_clears_a_stale_entry_and_a_detach_forgets_the_link() -> None:
    sniffer = FrameSniffer()
    sniffer.feed(AMQP_HEADER + _attach(0, "s", 5) + _transfer(0, 5, b"t", BATCH_FORMAT))
    sniffer.feed(_transfer(0, 5, b"t", 0))  # the tag reused by a single message
    assert _formats(sniffer) == {}
    sniffer.feed(_frame(0, 0x16, [uint(5), True]) + _transfer(0, 5, b"u", BATCH_FORMAT))
    assert _formats(sniffer) == {}  # no link with that handle any more


def _pump_out(front: FrontLayer) -> bytes:
    out = b""
    while (n := front.pending()) > 0:
        chunk = front.peek(n) or b""
        front.pop(len(chunk))
        out += chunk
    return out


def _sasl_init(mechanism: str) -> bytes:
    return _frame(0, 0x41, [symbol(mechanism), b""], ftype=1)


def test_sasl_offers_both_mechanisms_then_hands_over_to_proton() -> None:
    front = FrontLayer(Transport(Transport.SERVER))
    # A client may pipeline its init and its AMQP header behind the SASL header.
    front.push(SASL_HEADER + _sasl_init("MSSBCBS") + AMQP_HEADER)
    out = _pump_out(front)
    assert out.startswith(SASL_HEADER)
    assert b"MSSBCBS" in out and b"ANONYMOUS" in out
    outcome = _frame(0, 0x44, [ubyte(0)], ftype=1)
    assert outcome in out
    assert out.endswith(AMQP_HEADER)  # proton's own header, after the SASL outcome


def test_an_unoffered_mechanism_gets_outcome_auth_and_the_transport_closes() -> None:
    front = FrontLayer(Transport(Transport.SERVER))
    front.push(SASL_HEADER + _sasl_init("PLAIN"))
    out = _pump_out(front)
    assert out.endswith(_frame(0, 0x44, [ubyte(1)], ftype=1))
    assert front.pending() < 0 and front.capacity() <= 0
