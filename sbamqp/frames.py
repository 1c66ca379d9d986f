"""AMQP 1.0 framing: protocol headers, frame headers and frame bodies.

A frame is an 8-byte header (size, data offset in 4-byte words, type, channel), optional
extended header bytes, then the body: a performative, and for a transfer its payload. An
empty body is a heartbeat. ``parse_header`` checks the declared size against the
negotiated maximum *before* the body is read, so a hostile size costs nothing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from sbamqp.codec import Buffer, DecodeError, Described, Uint, decode
from sbamqp.performatives import (
    PERFORMATIVES,
    SASL_FRAMES,
    Performative,
    Transfer,
    descriptor_code,
)

__all__ = [
    "AMQP_HEADER",
    "FRAME_AMQP",
    "FRAME_SASL",
    "HEADER_SIZE",
    "MIN_MAX_FRAME_SIZE",
    "SASL_HEADER",
    "TLS_HEADER",
    "FrameError",
    "FrameHeader",
    "decode_body",
    "encode_frame",
    "heartbeat",
    "parse_header",
]

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
TLS_HEADER = b"AMQP\x02\x01\x00\x00"
HEADER_SIZE = 8
FRAME_AMQP = 0
FRAME_SASL = 1
# The smallest max-frame-size a peer may set; every open must fit in it.
MIN_MAX_FRAME_SIZE = 512

_HEADER = struct.Struct(">IBBH")
_TRANSFER_DESCRIPTOR = bytes((0x00, 0x53, Transfer.DESCRIPTOR))  # small ulong 0x14


class FrameError(DecodeError):
    """A frame header or body breaks the framing rules (the connection cannot go on)."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A parsed frame header: ``size`` is the whole frame, ``body_offset`` from its start."""

    size: int
    body_offset: int
    frame_type: int
    channel: int


def parse_header(buf: Buffer, offset: int, max_frame_size: int) -> FrameHeader | None:
    """The frame header at ``offset``, or None when fewer than 8 bytes are there yet.

    Raises ``FrameError`` for a size below 8 or above ``max_frame_size``, a data offset
    below 2 (inside the header) or past the frame, or an unknown frame type.
    """
    if len(buf) - offset < HEADER_SIZE:
        return None
    size, doff, frame_type, channel = _HEADER.unpack_from(buf, offset)
    if size < HEADER_SIZE or size > max_frame_size:
        raise FrameError(f"frame size {size} outside 8..{max_frame_size}")
    if doff < 2 or doff * 4 > size:
        raise FrameError(f"data offset {doff} outside the frame")
    if frame_type not in (FRAME_AMQP, FRAME_SASL):
        raise FrameError(f"unknown frame type {frame_type}")
    return FrameHeader(size, doff * 4, frame_type, channel)


def decode_body(body: Buffer, frame_type: int) -> tuple[Performative | None, bytes]:
    """The performative and the payload after it; ``(None, b"")`` for a heartbeat.

    Raises ``DecodeError`` (or ``FrameError``) for a body that is not one known
    performative of the frame's type.
    """
    if not body:
        return None, b""
    if body[:3] == _TRANSFER_DESCRIPTOR and frame_type == FRAME_AMQP:
        # The hot path, one per delivery: the SDKs' encoding read byte by byte, else the
        # list straight to the transfer, without building the `Described` and looking its
        # class up (the same checks follow).
        fast = _sdk_transfer(body)
        if fast is not None:
            return fast[0], bytes(body[fast[1] :])
        items, end = decode(body, 3)
        if type(items) is list:
            return Transfer.from_described(items), bytes(body[end:])
    value, end = decode(body, 0)
    if not isinstance(value, Described):
        raise FrameError("frame body is not a described performative")
    table = SASL_FRAMES if frame_type == FRAME_SASL else PERFORMATIVES
    cls = table.get(descriptor_code(value.descriptor) or -1)
    if cls is None:
        raise FrameError(f"unknown performative {value.descriptor!r:.60}")
    return cls.from_described(value), bytes(body[end:])


def _sdk_uint(body: Buffer, pos: int) -> tuple[int, int] | None:
    code = body[pos]
    if code == 0x43:
        return 0, pos + 1
    if code == 0x52:
        return body[pos + 1], pos + 2
    if code == 0x70:
        return int.from_bytes(body[pos + 1 : pos + 5], "big"), pos + 5
    return None


def _sdk_bool(body: Buffer, pos: int) -> tuple[bool | None, int] | None:
    code = body[pos]
    if code == 0x42:
        return False, pos + 1
    if code == 0x41:
        return True, pos + 1
    if code == 0x40:
        return None, pos + 1
    if code == 0x56:  # a boolean as a byte: how pyamqp (the Python SDK) writes one
        value = body[pos + 1]
        return (True, pos + 2) if value == 1 else (False, pos + 2) if value == 0 else None
    return None


_NULLS = b"\x40" * 11  # a transfer's trailing null fields (at most all eleven)


def _sdk_transfer(body: Buffer) -> tuple[Transfer, int] | None:
    """A transfer as the SDKs encode it (a list8 of uint handle, delivery id and format, a
    vbin8 tag, booleans (0x41/0x42, or pyamqp's 0x56 and a byte), nulls): the transfer and
    where its payload starts; None for any other encoding, which is then decoded
    generically. Every read stays inside the list."""
    if len(body) < 6 or body[3] != 0xC0:
        return None
    end, count = 5 + body[4], body[5]
    if not 4 <= count <= 11 or end > len(body) or end - 6 < count:
        return None
    try:
        handle = _sdk_uint(body, 6)
        if handle is None:
            return None
        delivery_id = _sdk_uint(body, handle[1])
        if delivery_id is None or body[delivery_id[1]] != 0xA0:
            return None
        tag_end = delivery_id[1] + 2 + body[delivery_id[1] + 1]
        tag = bytes(body[delivery_id[1] + 2 : tag_end])
        message_format = _sdk_uint(body, tag_end)
        if message_format is None:
            return None
        pos = message_format[1]
        flags: list[bool | None] = []
        for _ in range(min(count, 6) - 4):
            flag = _sdk_bool(body, pos)
            if flag is None:
                return None
            flags.append(flag[0])
            pos = flag[1]
    except IndexError:
        return None
    rest = count - 4 - len(flags)
    if (
        pos + rest != end
        or body[pos:end] != _NULLS[:rest]
        or len(tag) != tag_end - (delivery_id[1] + 2)
    ):
        return None
    settled = flags[0] if flags else None
    more = flags[1] if len(flags) > 1 else None
    transfer = Transfer(
        Uint(handle[0]), Uint(delivery_id[0]), tag, Uint(message_format[0]), settled, more
    )
    return transfer, end


def encode_frame(
    channel: int, performative: Performative | bytes, payload: bytes = b"", frame_type: int = 0
) -> bytes:
    """One frame: the header, then the performative (or its encoding) and the payload."""
    body = performative if isinstance(performative, bytes) else performative.encode()
    return _HEADER.pack(HEADER_SIZE + len(body) + len(payload), 2, frame_type, channel) + (
        body + payload
    )


def heartbeat() -> bytes:
    """An empty frame on channel 0: keeps an idle connection alive."""
    return _HEADER.pack(HEADER_SIZE, 2, FRAME_AMQP, 0)


def header_bytes(size: int, channel: int, frame_type: int = FRAME_AMQP) -> bytes:
    """A bare frame header for a frame of ``size`` bytes (for hand-built frames)."""
    return _HEADER.pack(size, 2, frame_type, channel)


def describe(value: Any) -> str:
    """A short, safe text for logging a value from the wire."""
    return repr(value)[:200]
