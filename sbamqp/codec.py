"""The AMQP 1.0 type system: a type-preserving, bounded decoder and an encoder.

Every decoded value keeps its AMQP type, so encoding it again gives a value of the same
type (not necessarily the same bytes: the encoder picks the shortest form):

=====================  ===========================================================
AMQP type              Python value
=====================  ===========================================================
null                   ``None``
boolean                ``bool``
ubyte/ushort/uint/     ``Ubyte``/``Ushort``/``Uint``/``Ulong`` (``int`` subclasses)
ulong
byte/short/int/long    ``Byte``/``Short``/``Int``/``Long`` (``int`` subclasses)
float/double           ``Float``/``Double`` (``float`` subclasses; a plain ``float``
                       encodes as double)
decimal32/64/128       ``Decimal32``/``Decimal64``/``Decimal128``: the raw bytes
char                   ``Char`` (a one-character ``str``)
timestamp              ``Timestamp``: milliseconds since the epoch (``int``), with
                       ``to_datetime()`` / ``from_datetime()``
uuid                   ``uuid.UUID``
binary                 ``bytes``
string                 ``str``
symbol                 ``Symbol`` (a ``str`` subclass)
list                   ``list``
map                    ``dict`` (a duplicate key is refused: it cannot be carried)
array                  ``Array``: a ``list`` that remembers its element constructor
described              ``Described(descriptor, value)``
=====================  ===========================================================

A plain ``int`` encodes as int when it fits in 32 bits, else as long.

The decoder is written for hostile input: every length and count is checked against the
bytes that remain *before* anything is allocated or sliced, compound values nest at most
``MAX_DEPTH`` deep, and every malformed input raises ``DecodeError`` (nothing else).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Self

__all__ = [
    "MAX_DEPTH",
    "Array",
    "Binary",
    "Byte",
    "Char",
    "Decimal32",
    "Decimal64",
    "Decimal128",
    "DecodeError",
    "Described",
    "Double",
    "EncodeError",
    "Float",
    "Int",
    "Long",
    "Short",
    "Symbol",
    "Timestamp",
    "Ubyte",
    "Uint",
    "Ulong",
    "Ushort",
    "decode",
    "decode_all",
    "encode",
    "skip",
]

# Nesting deeper than this is refused: no SDK nests beyond a handful of levels, and an
# unbounded depth would let a small frame exhaust the interpreter's stack.
MAX_DEPTH = 32


class DecodeError(ValueError):
    """The bytes are not a well-formed AMQP value (or break one of our bounds)."""


class EncodeError(ValueError):
    """The value has no AMQP encoding (an unknown type, or out of its type's range)."""


class Symbol(str):
    """An AMQP symbol (ASCII), distinct from a string."""

    __slots__ = ()


class Char(str):
    """An AMQP char: one Unicode code point."""

    __slots__ = ()


Binary = bytes


class Decimal32(bytes):
    """An AMQP decimal32, kept as its 4 raw bytes (IEEE 754 decimal, never interpreted)."""


class Decimal64(bytes):
    """An AMQP decimal64, kept as its 8 raw bytes."""


class Decimal128(bytes):
    """An AMQP decimal128, kept as its 16 raw bytes."""


class _Ranged(int):
    _lo = 0
    _hi = 0

    def __new__(cls, value: int = 0) -> Self:
        if not cls._lo <= value <= cls._hi:
            raise EncodeError(f"{cls.__name__} out of range: {value}")
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class Ubyte(_Ranged):
    """AMQP ubyte."""

    _hi = 0xFF


class Ushort(_Ranged):
    """AMQP ushort."""

    _hi = 0xFFFF


class Uint(_Ranged):
    """AMQP uint."""

    _hi = 0xFFFFFFFF


class Ulong(_Ranged):
    """AMQP ulong."""

    _hi = 0xFFFFFFFFFFFFFFFF


class Byte(_Ranged):
    """AMQP byte (signed)."""

    _lo, _hi = -0x80, 0x7F


class Short(_Ranged):
    """AMQP short."""

    _lo, _hi = -0x8000, 0x7FFF


class Int(_Ranged):
    """AMQP int."""

    _lo, _hi = -0x80000000, 0x7FFFFFFF


class Long(_Ranged):
    """AMQP long."""

    _lo, _hi = -0x8000000000000000, 0x7FFFFFFFFFFFFFFF


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Timestamp(Long):
    """AMQP timestamp: milliseconds since the Unix epoch (signed 64 bits)."""

    def to_datetime(self) -> datetime:
        """The instant as an aware UTC datetime; ``DecodeError`` beyond years 1..9999
        (a timestamp on the wire may hold any 64-bit value)."""
        try:
            return _EPOCH + timedelta(milliseconds=int(self))
        except OverflowError:
            raise DecodeError(f"timestamp {int(self)} is beyond the datetime range") from None

    @classmethod
    def from_datetime(cls, value: datetime) -> Timestamp:
        """Milliseconds of an aware (or UTC-naive) datetime, truncated."""
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        delta = value - _EPOCH
        return cls((delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000)


class Float(float):
    """AMQP float (32-bit); a plain ``float`` encodes as double."""

    __slots__ = ()


class Double(float):
    """AMQP double (64-bit)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Described:
    """A described value: ``descriptor`` (usually a ``Ulong`` or a ``Symbol``) and ``value``."""

    descriptor: Any
    value: Any


class Array(list[Any]):
    """An AMQP array: one constructor for every element.

    ``code`` is the element constructor's format code (0 for described elements, then
    ``descriptor`` is theirs); the encoder uses it, so an empty array keeps its type.
    """

    def __init__(self, items: Any = (), code: int | None = None, descriptor: Any = None) -> None:
        super().__init__(items)
        self.code = code
        self.descriptor = descriptor

    def __eq__(self, other: object) -> bool:
        # An unset code (an array built by hand) matches any: it is inferred on encoding.
        if isinstance(other, Array):
            if None not in (self.code, other.code) and self.code != other.code:
                return False
            return list.__eq__(self, other)
        return list.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Array({list.__repr__(self)}, code={self.code!r})"


# -- decoding -------------------------------------------------------------------------

_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_I8 = struct.Struct(">b").unpack_from
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_I64 = struct.Struct(">q").unpack_from
_F32 = struct.Struct(">f").unpack_from
_F64 = struct.Struct(">d").unpack_from
_U8U8 = struct.Struct(">BB").unpack_from
_U32U32 = struct.Struct(">II").unpack_from

Buffer = bytes | bytearray | memoryview
_Decoder = Callable[[Buffer, int, int], tuple[Any, int]]


def _need(buf: Buffer, off: int, n: int) -> None:
    if off + n > len(buf):
        raise DecodeError(f"truncated: {n} bytes needed at offset {off}, {len(buf) - off} left")


def _fixed(width: int, make: Callable[[Buffer, int], Any]) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        if off + width > len(buf):
            _need(buf, off, width)
        return make(buf, off), off + width

    return dec


def _const(value: Any) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        return value, off

    return dec


def _bool(buf: Buffer, off: int) -> bool:
    b = buf[off]
    if b > 1:
        raise DecodeError(f"boolean byte {b} is neither 0 nor 1")
    return b == 1


def _char(buf: Buffer, off: int) -> Char:
    cp = _U32(buf, off)[0]
    if cp > 0x10FFFF:
        raise DecodeError(f"char {cp:#x} is not a code point")
    return Char(chr(cp))


def _variable(width: int, make: Callable[[bytes], Any]) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        _need(buf, off, width)
        size = buf[off] if width == 1 else _U32(buf, off)[0]
        start = off + width
        end = start + size
        if end > len(buf):
            raise DecodeError(f"variable value of {size} bytes overruns the buffer")
        return make(bytes(buf[start:end])), end

    return dec


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"string is not UTF-8: {exc}") from None


def _symbol(raw: bytes) -> Symbol:
    try:
        return Symbol(raw.decode("ascii"))
    except UnicodeDecodeError:
        raise DecodeError("symbol is not ASCII") from None


def _compound_header(buf: Buffer, off: int, width: int) -> tuple[int, int, int]:
    """(count, offset of the first element, end offset), bounded by the buffer."""
    if width == 1:
        _need(buf, off, 2)
        size, count = _U8U8(buf, off)
        if size < 1:
            raise DecodeError("compound size smaller than its count field")
        first = off + 2
        end = off + 1 + size
    else:
        _need(buf, off, 8)
        size, count = _U32U32(buf, off)
        if size < 4:
            raise DecodeError("compound size smaller than its count field")
        first = off + 8
        end = off + 4 + size
    if end > len(buf):
        raise DecodeError(f"compound of {size} bytes overruns the buffer")
    # Every element takes at least one byte (its constructor): a count beyond the bytes
    # that remain is a lie, refused before any list is built.
    if count > end - first:
        raise DecodeError(f"compound count {count} exceeds its {end - first} bytes")
    return count, first, end


def _elements(buf: Buffer, off: int, end: int, count: int, depth: int) -> tuple[list[Any], int]:
    if depth >= MAX_DEPTH:
        raise DecodeError(f"nesting deeper than {MAX_DEPTH}")
    items: list[Any] = []
    append = items.append
    decoders = _DECODERS
    for _ in range(count):
        if off >= end:
            raise DecodeError("compound element overruns its declared size")
        code = buf[off]
        if code == 0x40:
            # null, inline: SDKs send lists (transfer, properties) mostly made of nulls.
            append(None)
            off += 1
            continue
        dec = decoders[code]
        if dec is None:
            raise DecodeError(f"unknown format code {code:#04x}")
        value, off = dec(buf, off + 1, depth + 1)
        append(value)
    if off != end:
        raise DecodeError("compound size does not match its elements")
    return items, off


def _list(width: int) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        count, first, end = _compound_header(buf, off, width)
        return _elements(buf, first, end, count, depth)

    return dec


def _map(width: int) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        count, first, end = _compound_header(buf, off, width)
        if count % 2:
            raise DecodeError("map with an odd number of elements")
        items, off = _elements(buf, first, end, count, depth)
        result: dict[Any, Any] = {}
        try:
            for i in range(0, count, 2):
                key = items[i]
                if key in result:
                    raise DecodeError(f"duplicate map key {key!r}")
                result[key] = items[i + 1]
        except TypeError:
            raise DecodeError("unhashable map key") from None
        return result, off

    return dec


# Element widths of the fixed-width constructors allowed in an array. Zero-width ones
# (null, true, false, uint0, ulong0, list0) are not: a count of them costs no bytes, so
# a few bytes could ask for billions of elements.
_ARRAY_FIXED = {
    0x50: 1, 0x51: 1, 0x56: 1, 0x52: 1, 0x53: 1, 0x54: 1, 0x55: 1,
    0x60: 2, 0x61: 2,
    0x70: 4, 0x71: 4, 0x72: 4, 0x73: 4, 0x74: 4,
    0x80: 8, 0x81: 8, 0x82: 8, 0x83: 8, 0x84: 8,
    0x94: 16, 0x98: 16,
}  # fmt: skip
_ARRAY_VARIABLE = {0xA0: 1, 0xA1: 1, 0xA3: 1, 0xB0: 4, 0xB1: 4, 0xB3: 4}
_ARRAY_COMPOUND = {0xC0: 2, 0xC1: 2, 0xD0: 8, 0xD1: 8, 0xE0: 3, 0xF0: 9}


def _array(width: int) -> _Decoder:
    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        count, first, end = _compound_header(buf, off, width)
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH}")
        if first >= end:
            raise DecodeError("array without an element constructor")
        descriptor = None
        code = buf[first]
        pos = first + 1
        if code == 0x00:
            descriptor, pos = _decode_at(buf, pos, depth + 1)
            if pos >= end:
                raise DecodeError("described array without an element constructor")
            code = buf[pos]
            pos += 1
        minimum = _ARRAY_FIXED.get(code) or _ARRAY_VARIABLE.get(code) or _ARRAY_COMPOUND.get(code)
        if minimum is None and count == 0 and code == 0x40:
            minimum = 0  # an empty array of unknown type, harmless
        if minimum is None:
            raise DecodeError(f"format code {code:#04x} cannot be an array element")
        if count * minimum > end - pos:
            raise DecodeError(f"array count {count} exceeds its bytes")
        dec_el = _DECODERS[code]
        assert dec_el is not None
        items = []
        for _ in range(count):
            value, pos = dec_el(buf, pos, depth + 1)
            if pos > end:
                raise DecodeError("array element overruns the array")
            items.append(value if descriptor is None else Described(descriptor, value))
        if pos != end:
            raise DecodeError("array size does not match its elements")
        if descriptor is not None:
            return Array(items, 0, descriptor), end
        return Array(items, _ARRAY_CODE.get(code, code)), end

    return dec


# Arrays remember the wide form of their constructor, so that re-encoding can hold any value.
_ARRAY_CODE = {
    0x41: 0x56, 0x42: 0x56, 0x43: 0x70, 0x44: 0x80, 0x45: 0xD0,
    0x52: 0x70, 0x53: 0x80, 0x54: 0x71, 0x55: 0x81,
    0xA0: 0xB0, 0xA1: 0xB1, 0xA3: 0xB3, 0xC0: 0xD0, 0xC1: 0xD1, 0xE0: 0xF0,
}  # fmt: skip


def _described(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if depth >= MAX_DEPTH:
        raise DecodeError(f"nesting deeper than {MAX_DEPTH}")
    descriptor, off = _decode_at(buf, off, depth + 1)
    if isinstance(descriptor, Described):
        raise DecodeError("a descriptor cannot itself be described")
    value, off = _decode_at(buf, off, depth + 1)
    return Described(descriptor, value), off


def _decode_at(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off >= len(buf):
        raise DecodeError(f"truncated: no constructor at offset {off}")
    code = buf[off]
    dec = _DECODERS[code]
    if dec is None:
        raise DecodeError(f"unknown format code {code:#04x}")
    return dec(buf, off + 1, depth)


# The values read from a fixed width are in range by construction: skip the range check.
_new = int.__new__

_DECODERS: list[_Decoder | None] = [None] * 256
_DECODERS[0x00] = _described
_DECODERS[0x40] = _const(None)
_DECODERS[0x41] = _const(True)
_DECODERS[0x42] = _const(False)
_DECODERS[0x43] = _const(Uint(0))
_DECODERS[0x44] = _const(Ulong(0))
_DECODERS[0x45] = lambda buf, off, depth: ([], off)
_DECODERS[0x50] = _fixed(1, lambda b, o: _new(Ubyte, b[o]))
_DECODERS[0x51] = _fixed(1, lambda b, o: _new(Byte, _I8(b, o)[0]))
_DECODERS[0x52] = _fixed(1, lambda b, o: _new(Uint, b[o]))
_DECODERS[0x53] = _fixed(1, lambda b, o: _new(Ulong, b[o]))
_DECODERS[0x54] = _fixed(1, lambda b, o: _new(Int, _I8(b, o)[0]))
_DECODERS[0x55] = _fixed(1, lambda b, o: _new(Long, _I8(b, o)[0]))
_DECODERS[0x56] = _fixed(1, _bool)
_DECODERS[0x60] = _fixed(2, lambda b, o: _new(Ushort, _U16(b, o)[0]))
_DECODERS[0x61] = _fixed(2, lambda b, o: _new(Short, _I16(b, o)[0]))
_DECODERS[0x70] = _fixed(4, lambda b, o: _new(Uint, _U32(b, o)[0]))
_DECODERS[0x71] = _fixed(4, lambda b, o: _new(Int, _I32(b, o)[0]))
_DECODERS[0x72] = _fixed(4, lambda b, o: Float(_F32(b, o)[0]))
_DECODERS[0x73] = _fixed(4, _char)
_DECODERS[0x74] = _fixed(4, lambda b, o: Decimal32(b[o : o + 4]))
_DECODERS[0x80] = _fixed(8, lambda b, o: _new(Ulong, _U64(b, o)[0]))
_DECODERS[0x81] = _fixed(8, lambda b, o: _new(Long, _I64(b, o)[0]))
_DECODERS[0x82] = _fixed(8, lambda b, o: Double(_F64(b, o)[0]))
_DECODERS[0x83] = _fixed(8, lambda b, o: _new(Timestamp, _I64(b, o)[0]))
_DECODERS[0x84] = _fixed(8, lambda b, o: Decimal64(b[o : o + 8]))
_DECODERS[0x94] = _fixed(16, lambda b, o: Decimal128(b[o : o + 16]))
_DECODERS[0x98] = _fixed(16, lambda b, o: uuid.UUID(bytes=bytes(b[o : o + 16])))
_DECODERS[0xA0] = _variable(1, bytes)
_DECODERS[0xA1] = _variable(1, _utf8)
_DECODERS[0xA3] = _variable(1, _symbol)
_DECODERS[0xB0] = _variable(4, bytes)
_DECODERS[0xB1] = _variable(4, _utf8)
_DECODERS[0xB3] = _variable(4, _symbol)
_DECODERS[0xC0] = _list(1)
_DECODERS[0xD0] = _list(4)
_DECODERS[0xC1] = _map(1)
_DECODERS[0xD1] = _map(4)
_DECODERS[0xE0] = _array(1)
_DECODERS[0xF0] = _array(4)


# Hand-written decoders for the encodings SDKs use most (one call each instead of two):
# the generic ones above stay for the rest.
def _str8(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off >= len(buf):
        raise DecodeError("truncated str8")
    end = off + 1 + buf[off]
    if end > len(buf):
        raise DecodeError("str8 overruns the buffer")
    try:
        return bytes(buf[off + 1 : end]).decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise DecodeError(f"string is not UTF-8: {exc}") from None


def _sym8(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off >= len(buf):
        raise DecodeError("truncated sym8")
    end = off + 1 + buf[off]
    if end > len(buf):
        raise DecodeError("sym8 overruns the buffer")
    try:
        return Symbol(bytes(buf[off + 1 : end]).decode("ascii")), end
    except UnicodeDecodeError:
        raise DecodeError("symbol is not ASCII") from None


def _vbin8(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off >= len(buf):
        raise DecodeError("truncated vbin8")
    end = off + 1 + buf[off]
    if end > len(buf):
        raise DecodeError("vbin8 overruns the buffer")
    return bytes(buf[off + 1 : end]), end


def _small(cls: type) -> _Decoder:
    unsigned = cls in (Uint, Ulong)

    def dec(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
        if off >= len(buf):
            raise DecodeError("truncated small integer")
        value = buf[off]
        if not unsigned and value > 127:
            value -= 256
        return _new(cls, value), off + 1

    return dec


def _uint32(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off + 4 > len(buf):
        raise DecodeError("truncated uint")
    return _new(Uint, _U32(buf, off)[0]), off + 4


def _timestamp(buf: Buffer, off: int, depth: int) -> tuple[Any, int]:
    if off + 8 > len(buf):
        raise DecodeError("truncated timestamp")
    return _new(Timestamp, _I64(buf, off)[0]), off + 8


_DECODERS[0xA0] = _vbin8
_DECODERS[0xA1] = _str8
_DECODERS[0xA3] = _sym8
_DECODERS[0x52] = _small(Uint)
_DECODERS[0x53] = _small(Ulong)
_DECODERS[0x54] = _small(Int)
_DECODERS[0x55] = _small(Long)
_DECODERS[0x70] = _uint32
_DECODERS[0x83] = _timestamp


def decode(buf: Buffer, offset: int = 0) -> tuple[Any, int]:
    """Decode one value at ``offset``: ``(value, offset just past it)``.

    Raises ``DecodeError`` for anything malformed, truncated or beyond our bounds.
    """
    try:
        return _decode_at(buf, offset, 0)
    except DecodeError:
        raise
    except (struct.error, IndexError, ValueError, OverflowError) as exc:
        # Defence in depth: a bound we missed must still surface as a DecodeError.
        raise DecodeError(f"malformed value: {exc}") from None


def decode_all(buf: Buffer) -> list[Any]:
    """Decode every value in ``buf`` (consecutive encodings, nothing left over)."""
    values = []
    off = 0
    while off < len(buf):
        value, off = decode(buf, off)
        values.append(value)
    return values


# Constructors whose values are exactly `width` bytes after the code (for `skip`).
_SKIP_FIXED = {code: width for code, width in _ARRAY_FIXED.items()}
_SKIP_FIXED.update({0x40: 0, 0x41: 0, 0x42: 0, 0x43: 0, 0x44: 0, 0x45: 0})


def skip(buf: Buffer, offset: int = 0) -> int:
    """The offset just past the value at ``offset``, without building it.

    Sizes are checked against the buffer; the insides of compounds are not validated
    (``decode`` them for that). Raises ``DecodeError``.
    """
    depth = 0
    while True:
        if offset >= len(buf):
            raise DecodeError(f"truncated: no constructor at offset {offset}")
        code = buf[offset]
        offset += 1
        if code == 0x00:  # a descriptor, then the described value
            depth += 1
            if depth > MAX_DEPTH:
                raise DecodeError(f"nesting deeper than {MAX_DEPTH}")
            if offset < len(buf) and buf[offset] == 0x00:
                # Refused as decode refuses it; it also keeps the call below one level deep.
                raise DecodeError("a descriptor cannot itself be described")
            offset = skip(buf, offset)
            continue
        width = _SKIP_FIXED.get(code)
        if width is not None:
            end = offset + width
        elif code in (0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0):
            _need(buf, offset, 1)
            end = offset + 1 + buf[offset]
        elif code in (0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0):
            _need(buf, offset, 4)
            end = offset + 4 + _U32(buf, offset)[0]
        else:
            raise DecodeError(f"unknown format code {code:#04x}")
        if end > len(buf):
            raise DecodeError("value overruns the buffer")
        return end


# -- encoding -------------------------------------------------------------------------

_P8 = struct.Struct(">B").pack
_P16 = struct.Struct(">H").pack
_P32 = struct.Struct(">I").pack
_P64 = struct.Struct(">Q").pack
_S8 = struct.Struct(">b").pack
_S16 = struct.Struct(">h").pack
_S32 = struct.Struct(">i").pack
_S64 = struct.Struct(">q").pack
_PF = struct.Struct(">f").pack
_PD = struct.Struct(">d").pack


def _enc_uint(v: int) -> bytes:
    if v == 0:
        return b"\x43"
    if v < 256:
        return b"\x52" + _P8(v)
    return b"\x70" + _P32(v)


def _enc_ulong(v: int) -> bytes:
    if v == 0:
        return b"\x44"
    if v < 256:
        return b"\x53" + _P8(v)
    return b"\x80" + _P64(v)


def _enc_int(v: int) -> bytes:
    if -128 <= v <= 127:
        return b"\x54" + _S8(v)
    return b"\x71" + _S32(v)


def _enc_long(v: int) -> bytes:
    if -128 <= v <= 127:
        return b"\x55" + _S8(v)
    return b"\x81" + _S64(v)


def _enc_variable(small: int, raw: bytes) -> bytes:
    n = len(raw)
    if n < 256:
        return bytes((small, n)) + raw
    return bytes((small + 0x10,)) + _P32(n) + raw


def _enc_compound(small: int, count: int, body: bytes) -> bytes:
    # The size counts the count field too: 1 byte in the short form, 4 in the long one.
    if len(body) + 1 < 256 and count < 256:
        return bytes((small, len(body) + 1, count)) + body
    return bytes((small + 0x10,)) + _P32(len(body) + 4) + _P32(count) + body


def _enc_list(values: list[Any]) -> bytes:
    if not values:
        return b"\x45"
    return _enc_compound(0xC0, len(values), b"".join([encode(v) for v in values]))


def _enc_map(values: dict[Any, Any]) -> bytes:
    parts = []
    for key, value in values.items():
        parts.append(encode(key))
        parts.append(encode(value))
    return _enc_compound(0xC1, 2 * len(values), b"".join(parts))


# An array element's value without its constructor, for each wide constructor.
_ELEMENT: dict[int, Callable[[Any], bytes]] = {
    0x40: lambda v: b"",
    0x50: _P8,
    0x51: _S8,
    0x56: lambda v: b"\x01" if v else b"\x00",
    0x60: _P16,
    0x61: _S16,
    0x70: _P32,
    0x71: _S32,
    0x72: _PF,
    0x73: lambda v: _P32(ord(v)),
    0x74: bytes,
    0x80: _P64,
    0x81: _S64,
    0x82: _PD,
    0x83: _S64,
    0x84: bytes,
    0x94: bytes,
    0x98: lambda v: v.bytes,
    0xB0: lambda v: _P32(len(v)) + v,
    0xB1: lambda v: _P32(len(v.encode())) + v.encode(),
    0xB3: lambda v: _P32(len(v)) + v.encode("ascii"),
    0xD0: lambda v: _enc_list_wide(v) if isinstance(v, list) else _no_encoding(v),
    0xD1: lambda v: _enc_map_wide(v) if isinstance(v, dict) else _no_encoding(v),
    0xF0: lambda v: _enc_array(v, wide=True)[1:] if isinstance(v, Array) else _no_encoding(v),
}


def _no_encoding(value: Any) -> bytes:
    raise EncodeError(f"no AMQP encoding for {type(value).__name__}")


def _enc_list_wide(values: list[Any]) -> bytes:
    body = b"".join([encode(v) for v in values])
    return _P32(len(body) + 4) + _P32(len(values)) + body


def _enc_map_wide(values: dict[Any, Any]) -> bytes:
    body = b"".join([encode(k) + encode(v) for k, v in values.items()])
    return _P32(len(body) + 4) + _P32(2 * len(values)) + body


def _array_code(values: Array) -> int:
    if values.code is not None:
        return _ARRAY_CODE.get(values.code, values.code)
    if not values:
        return 0x40
    first = values[0]
    if isinstance(first, Described):
        return 0
    return _ARRAY_CODE.get(encode(first)[0], encode(first)[0])


def _enc_array(values: Array, *, wide: bool = False) -> bytes:
    """An array; ``wide`` forces the 32-bit form (an array inside an array needs it)."""
    code = _array_code(values)
    if code == 0:
        if not all(isinstance(v, Described) for v in values):
            raise EncodeError("a described array holds a value that is not described")
        descriptor = values.descriptor
        if descriptor is None and values:
            descriptor = values[0].descriptor
        inner = Array([v.value for v in values])
        if inner:
            inner.code = _array_code(inner)
        else:
            inner.code = 0x40
        body = b"\x00" + encode(descriptor) + _enc_array_body(inner, inner.code or 0x40)
        count = len(values)
    else:
        body = _enc_array_body(values, code)
        count = len(values)
    if not wide and len(body) + 1 < 256 and count < 256:
        return bytes((0xE0, len(body) + 1, count)) + body
    return b"\xf0" + _P32(len(body) + 4) + _P32(count) + body


def _enc_array_body(values: list[Any], code: int) -> bytes:
    element = _ELEMENT.get(code)
    if element is None:
        raise EncodeError(f"format code {code:#04x} cannot be an array element")
    try:
        return bytes((code,)) + b"".join([element(v) for v in values])
    except (struct.error, AttributeError, TypeError) as exc:
        raise EncodeError(f"array elements do not fit {code:#04x}: {exc}") from None


def _enc_str(v: str) -> bytes:
    try:
        raw = v.encode("utf-8")
    except UnicodeEncodeError:
        raise EncodeError("string holds a lone surrogate") from None
    return _enc_variable(0xA1, raw)


def _enc_symbol(v: str) -> bytes:
    try:
        return _enc_variable(0xA3, v.encode("ascii"))
    except UnicodeEncodeError:
        raise EncodeError("symbol is not ASCII") from None


_BY_TYPE: dict[type, Callable[[Any], bytes]] = {
    bool: lambda v: b"\x41" if v else b"\x42",
    Ubyte: lambda v: b"\x50" + _P8(v),
    Ushort: lambda v: b"\x60" + _P16(v),
    Uint: _enc_uint,
    Ulong: _enc_ulong,
    Byte: lambda v: b"\x51" + _S8(v),
    Short: lambda v: b"\x61" + _S16(v),
    Int: _enc_int,
    Long: _enc_long,
    Timestamp: lambda v: b"\x83" + _S64(v),
    Float: lambda v: b"\x72" + _PF(v),
    Double: lambda v: b"\x82" + _PD(v),
    float: lambda v: b"\x82" + _PD(v),
    Decimal32: lambda v: b"\x74" + v,
    Decimal64: lambda v: b"\x84" + v,
    Decimal128: lambda v: b"\x94" + v,
    Char: lambda v: b"\x73" + _P32(ord(v)),
    uuid.UUID: lambda v: b"\x98" + v.bytes,
    bytes: lambda v: _enc_variable(0xA0, v),
    bytearray: lambda v: _enc_variable(0xA0, bytes(v)),
    str: _enc_str,
    Symbol: _enc_symbol,
    list: _enc_list,
    Array: _enc_array,
    dict: _enc_map,
    Described: lambda v: b"\x00" + encode(v.descriptor) + encode(v.value),
}

_DECIMAL_WIDTH: dict[type, int] = {Decimal32: 4, Decimal64: 8, Decimal128: 16}


def _enc_int_plain(v: int) -> bytes:
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return _enc_int(v)
    if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        return _enc_long(v)
    raise EncodeError(f"int out of the long range: {v}")


def encode(value: Any) -> bytes:
    """The AMQP encoding of ``value`` (see the module docstring for the type mapping).

    Raises ``EncodeError`` for a value with no AMQP type (a set, a naive object, a decimal
    of the wrong width, a symbol that is not ASCII, ...).
    """
    if value is None:
        return b"\x40"
    kind = type(value)
    enc = _BY_TYPE.get(kind)
    if enc is not None:
        width = _DECIMAL_WIDTH.get(kind)
        if width is not None and len(value) != width:
            raise EncodeError(f"{kind.__name__} needs {width} bytes")
        try:
            return enc(value)
        except struct.error as exc:
            raise EncodeError(f"{kind.__name__} out of range: {exc}") from None
    if kind is int:
        return _enc_int_plain(value)
    if isinstance(value, datetime):
        return _BY_TYPE[Timestamp](Timestamp.from_datetime(value))
    for base, enc in _BY_TYPE.items():  # subclasses of the types above
        if isinstance(value, base) and base is not bool:
            return enc(value)
    if isinstance(value, int):  # an IntEnum, say
        return _enc_int_plain(int(value))
    raise EncodeError(f"no AMQP encoding for {kind.__name__}")
