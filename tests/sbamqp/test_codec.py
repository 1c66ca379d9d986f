"""sbamqp.codec: type-preserving round trips, agreement with the pinned SDK's encoder, and
bounds on hostile input (a lying length or count fails fast, without allocating)."""

from __future__ import annotations

import math
import time
import tracemalloc
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from azure.servicebus._pyamqp import _encode as pyamqp_encode
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from hypothesis import given, settings
from hypothesis import strategies as st

from sbamqp import codec
from sbamqp.codec import (
    Array,
    Byte,
    Char,
    Decimal32,
    Decimal64,
    Decimal128,
    DecodeError,
    Described,
    Double,
    EncodeError,
    Float,
    Int,
    Long,
    Short,
    Symbol,
    Timestamp,
    Ubyte,
    Uint,
    Ulong,
    Ushort,
    decode,
    encode,
    skip,
)

pytestmark = pytest.mark.unit


def _ranged(cls: type, lo: int, hi: int) -> st.SearchStrategy[Any]:
    return st.integers(lo, hi).map(cls)


_symbols = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20)
_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40
)  # no lone surrogates: UTF-8 cannot carry them

scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ranged(Ubyte, 0, 0xFF),
    _ranged(Ushort, 0, 0xFFFF),
    _ranged(Uint, 0, 0xFFFFFFFF),
    _ranged(Ulong, 0, 2**64 - 1),
    _ranged(Byte, -128, 127),
    _ranged(Short, -(2**15), 2**15 - 1),
    _ranged(Int, -(2**31), 2**31 - 1),
    _ranged(Long, -(2**63), 2**63 - 1),
    _ranged(Timestamp, -(2**63), 2**63 - 1),
    st.floats(allow_nan=False, width=32).map(Float),
    st.floats(allow_nan=False).map(Double),
    st.characters(blacklist_categories=("Cs",)).map(Char),
    st.binary(min_size=4, max_size=4).map(Decimal32),
    st.binary(min_size=8, max_size=8).map(Decimal64),
    st.binary(min_size=16, max_size=16).map(Decimal128),
    st.uuids(),
    st.binary(max_size=300),
    _text,
    _symbols.map(Symbol),
)
_keys = st.one_of(_symbols.map(Symbol), _text, _ranged(Ulong, 0, 2**64 - 1))
_arrays = st.one_of(
    st.lists(_symbols.map(Symbol), max_size=5).map(lambda v: Array(v, code=0xB3)),
    st.lists(_ranged(Int, -(2**31), 2**31 - 1), max_size=5).map(lambda v: Array(v, code=0x71)),
    st.lists(st.uuids(), max_size=5).map(lambda v: Array(v, code=0x98)),
    st.lists(st.binary(max_size=10), max_size=5).map(lambda v: Array(v, code=0xB0)),
    st.lists(st.booleans(), max_size=5).map(lambda v: Array(v, code=0x56)),
    st.lists(_ranged(Uint, 0, 2**32 - 1), max_size=5).map(lambda v: Array(v, code=0x70)),
    st.lists(
        st.lists(_ranged(Long, -(2**63), 2**63 - 1), max_size=3).map(lambda v: Array(v, code=0x81)),
        max_size=3,
    ).map(lambda v: Array(v, code=0xF0)),
    st.lists(st.lists(_text, max_size=3), max_size=3).map(lambda v: Array(v, code=0xD0)),
    st.lists(st.dictionaries(_text, _text, max_size=2), max_size=3).map(
        lambda v: Array(v, code=0xD1)
    ),
    st.lists(_ranged(Int, -(2**31), 2**31 - 1), max_size=3).map(
        lambda v: Array([Described(Symbol("d"), x) for x in v], code=0, descriptor=Symbol("d"))
    ),
)
values = st.recursive(
    st.one_of(scalars, _arrays),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(_keys, inner, max_size=5),
        st.tuples(st.one_of(_ranged(Ulong, 0, 2**64 - 1), _symbols.map(Symbol)), inner).map(
            lambda t: Described(*t)
        ),
    ),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same type all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, Array):
        return a.code == b.code and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(a[ka], b[kb]) for ka, kb in zip(a, b, strict=True)
        )
    if isinstance(a, Described):
        return same(a.descriptor, b.descriptor) and same(a.value, b.value)
    return bool(a == b)


@settings(max_examples=400, deadline=None)
@given(values)
def test_decode_of_encode_keeps_value_and_type(value: Any) -> None:
    raw = encode(value)
    decoded, end = decode(raw)
    assert end == len(raw)
    assert same(decoded, value), (value, decoded)
    assert skip(raw) == len(raw)
    assert encode(decoded) == raw  # a decoded value encodes to the same bytes again


@settings(max_examples=200, deadline=None)
@given(values, st.binary(max_size=8))
def test_decode_at_an_offset_stops_at_the_value(value: Any, tail: bytes) -> None:
    raw = b"\x40\x40" + encode(value) + tail
    decoded, end = decode(raw, 2)
    assert same(decoded, value) and end == len(raw) - len(tail)


def test_plain_python_values_encode_as_their_natural_type() -> None:
    assert type(decode(encode(5))[0]) is Int
    assert type(decode(encode(2**40))[0]) is Long
    assert type(decode(encode(1.5))[0]) is Double
    assert decode(encode("x"))[0] == "x" and type(decode(encode("x"))[0]) is str
    when = datetime(2024, 5, 1, 12, 0, 0, 123000, tzinfo=UTC)
    stamp = decode(encode(when))[0]
    assert type(stamp) is Timestamp and stamp.to_datetime() == when
    with pytest.raises(DecodeError):
        Timestamp(2**63 - 1).to_datetime()
    with pytest.raises(EncodeError):
        encode(2**64)
    with pytest.raises(EncodeError):
        encode({1, 2})
    with pytest.raises(EncodeError):
        encode(Symbol("é"))
    with pytest.raises(EncodeError):
        Uint(-1)


# -- the pinned SDK's encoder: what clients send decodes to the typed values ------------

_PYAMQP_CASES: list[tuple[dict[str, Any] | Any, Any]] = [
    ({TYPE: AMQPTypes.ubyte, VALUE: 7}, Ubyte(7)),
    ({TYPE: AMQPTypes.ushort, VALUE: 700}, Ushort(700)),
    ({TYPE: AMQPTypes.uint, VALUE: 0}, Uint(0)),
    ({TYPE: AMQPTypes.uint, VALUE: 200}, Uint(200)),
    ({TYPE: AMQPTypes.uint, VALUE: 70000}, Uint(70000)),
    ({TYPE: AMQPTypes.ulong, VALUE: 0}, Ulong(0)),
    ({TYPE: AMQPTypes.ulong, VALUE: 2**60}, Ulong(2**60)),
    ({TYPE: AMQPTypes.byte, VALUE: -5}, Byte(-5)),
    ({TYPE: AMQPTypes.short, VALUE: -500}, Short(-500)),
    ({TYPE: AMQPTypes.int, VALUE: -70000}, Int(-70000)),
    ({TYPE: AMQPTypes.long, VALUE: -(2**40)}, Long(-(2**40))),
    ({TYPE: AMQPTypes.long, VALUE: 3}, Long(3)),
    ({TYPE: AMQPTypes.float, VALUE: 1.5}, Float(1.5)),
    ({TYPE: AMQPTypes.double, VALUE: 2.25}, Double(2.25)),
    ({TYPE: AMQPTypes.timestamp, VALUE: 1_700_000_000_123}, Timestamp(1_700_000_000_123)),
    ({TYPE: AMQPTypes.symbol, VALUE: b"sym"}, Symbol("sym")),
    ({TYPE: AMQPTypes.symbol, VALUE: b"s" * 300}, Symbol("s" * 300)),
    ({TYPE: AMQPTypes.string, VALUE: "héllo"}, "héllo"),
    ({TYPE: AMQPTypes.binary, VALUE: b"\x00\x01"}, b"\x00\x01"),
    ({TYPE: AMQPTypes.binary, VALUE: b"x" * 300}, b"x" * 300),
    (True, True),
    (False, False),
    (None, None),
    (5, Int(5)),
    (1.25, Double(1.25)),
    (uuid.UUID(int=42), uuid.UUID(int=42)),
    ("plain", "plain"),
    (b"raw", b"raw"),
    ([1, "a", None], [Int(1), "a", None]),
    ({"k": 1, "j": [True]}, {"k": Int(1), "j": [True]}),
    (list(range(100)), [Int(i) for i in range(100)]),
    (
        {
            TYPE: AMQPTypes.array,
            VALUE: [{TYPE: AMQPTypes.symbol, VALUE: b"a"}, {TYPE: AMQPTypes.symbol, VALUE: b"b"}],
        },
        Array([Symbol("a"), Symbol("b")], code=0xB3),
    ),
    (
        {TYPE: AMQPTypes.described, VALUE: ({TYPE: AMQPTypes.ulong, VALUE: 0x24}, [])},
        Described(Ulong(0x24), []),
    ),
]


@pytest.mark.parametrize(("sdk_value", "expected"), _PYAMQP_CASES, ids=repr)
def test_the_sdk_encoder_decodes_to_typed_values(sdk_value: Any, expected: Any) -> None:
    out = bytearray()
    pyamqp_encode.encode_value(out, sdk_value)
    decoded, end = decode(bytes(out))
    assert end == len(out)
    if isinstance(expected, Array):  # the symbol array as the SDK writes it (sym32)
        assert decoded == expected and decoded.code == 0xB3
    else:
        assert same(decoded, expected), decoded


def test_the_sdk_decimal128_stays_raw() -> None:

    out = bytearray()
    pyamqp_encode.encode_value(out, Decimal("1.5"))
    decoded, _ = decode(bytes(out))
    assert type(decoded) is Decimal128 and len(decoded) == 16
    assert encode(decoded) == bytes(out)


# -- hostile input ---------------------------------------------------------------------

_HOSTILE = [
    b"",
    b"\xff",  # an unknown constructor
    b"\xa1",  # a str8 without its size
    b"\xa1\x05abc",  # a size beyond the buffer
    b"\xb0\xff\xff\xff\xffabc",  # a 4 GiB binary in 7 bytes
    b"\xd0\xff\xff\xff\xff\xff\xff\xff\xff",  # a list claiming 4 GiB and 4 G elements
    b"\xd0\x00\x00\x00\x08\xff\xff\xff\xff\x40\x40\x40\x40",  # count far beyond its bytes
    b"\xc0\x01\x05",  # a count beyond the size
    b"\xc1\x03\x01\x40\x40",  # a map with an odd count
    b"\xc1\x05\x02\x40\x40",  # size larger than the buffer
    b"\xf0\x00\x00\x00\x05\xff\xff\xff\xff\x40",  # 4 G nulls: zero-width array elements
    b"\xf0\x00\x00\x00\x05\xff\xff\xff\xff\x41",  # 4 G trues
    b"\xf0\x00\x00\x00\x05\x00\x0f\xff\xff\x71",  # a million ints in no bytes
    b"\xe0\x02\x01\x45",  # an array of list0
    b"\xa1\x02\xc3\x28",  # invalid UTF-8
    b"\xa3\x01\xff",  # a symbol that is not ASCII
    b"\x56\x02",  # a boolean that is neither
    b"\x73\x00\x11\x00\x00",  # a char beyond Unicode
    b"\x00\x00\x53\x01\x40\x40",  # a described descriptor
    b"\xc1\x05\x04\xa1\x00\xa1\x00",  # duplicate map key... with missing values: truncated
    b"\xc1\x09\x04\xa1\x01k\x40\xa1\x01k\x40",  # a duplicate key
    b"\xc1\x05\x02\xc0\x01\x00\x40",  # an unhashable key (a list)
    b"\x00" * 200 + b"\x40",  # descriptors nested beyond the depth cap
    b"\xc0\xff\x01" + b"\xc0\xfc\x01" * 40,  # lists nested beyond the depth cap
]


@pytest.mark.parametrize("raw", _HOSTILE, ids=lambda r: r[:12].hex())
def test_hostile_input_raises_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(raw)


def test_a_lying_length_fails_fast_without_allocating() -> None:

    hostile = [
        b"\xf0\xff\xff\xff\xf0\xff\xff\xff\xf0\x71",
        b"\xd0\xff\xff\xff\xf0\xff\xff\xff\xf0" + b"\x40" * 100,
        b"\xb1\xff\xff\xff\xf0" + b"a" * 100,
    ]
    tracemalloc.start()
    started = time.perf_counter()
    try:
        for raw in hostile * 100:
            with pytest.raises(DecodeError):
                decode(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 1.0
    assert peak < 1_000_000, peak


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00" * 5000 + b"\x40",  # descriptors of descriptors, deeper than the stack
        b"\x00\x53\x01" * 100 + b"\x40",  # described values of described values
        b"\x00\xa1",  # a truncated descriptor
    ],
    ids=["nested descriptors", "chained described", "truncated"],
)
def test_skip_refuses_what_decode_refuses(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        skip(raw)
    with pytest.raises(DecodeError):
        decode(raw)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_decode_error(raw: bytes) -> None:
    try:
        decode(raw)
    except DecodeError:
        pass
    try:
        skip(raw)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_a_truncated_encoding_raises_decode_error(value: Any, data: st.DataObject) -> None:
    raw = encode(value)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DecodeError):
        decode(raw[:cut])


def test_depth_is_capped() -> None:
    deep: Any = None
    for _ in range(codec.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(DecodeError):
        decode(encode(deep))
    shallow: Any = None
    for _ in range(codec.MAX_DEPTH - 2):
        shallow = [shallow]
    assert decode(encode(shallow))[0] == shallow
