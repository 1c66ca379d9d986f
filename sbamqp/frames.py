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

from sbamqp.codec import Buffer, DecodeError, Described, decode
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
        # The hot path, one per delivery: the list straight to the transfer, without
        # building the `Described` and looking its class up (the same checks follow).
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
