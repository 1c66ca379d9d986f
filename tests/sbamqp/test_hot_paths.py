"""The per-delivery fast paths give what the generic decoding gives, and are taken for the
encodings the SDKs send (a path not taken costs the AMQP edge its CPU budget: bench/)."""

from __future__ import annotations

from typing import Any

import pytest

from sbamqp import frames, performatives
from sbamqp.codec import DecodeError, Described, Uint, Ulong, decode_all, encode
from sbamqp.performatives import Transfer

pytestmark = pytest.mark.unit

# A transfer as the Python SDK (7.15.0) sends it: all eleven fields, the last five null.
PYTHON_SDK_TRANSFER = [Uint(1), Uint(7), b"\x00\x00\x00\x01", Uint(0), False, False]
PYTHON_SDK_TRANSFER += [None, None, None, None, None]


def _generic_only(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every use of the generic (checked field by field) performative decoding."""
    used: list[Any] = []
    generic = performatives.Composite.from_described.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Any], value: Any) -> Any:
        used.append(cls)
        return generic(cls, value)

    monkeypatch.setattr(performatives.Composite, "from_described", classmethod(spy))
    return used


def test_the_python_sdks_transfer_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    used = _generic_only(monkeypatch)
    body = encode(Described(Ulong(0x14), PYTHON_SDK_TRANSFER)) + b"payload"
    transfer, payload = frames.decode_body(body, frames.FRAME_AMQP)
    assert used == []
    assert transfer == Transfer(1, 7, b"\x00\x00\x00\x01", 0, False, False)
    assert payload == b"payload"


def test_the_python_sdks_own_bytes_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyamqp writes a boolean as 0x56 and a byte (not 0x41/0x42): its transfer, encoded by
    its own encoder, is read byte by byte all the same."""
    _encode = pytest.importorskip("azure.servicebus._pyamqp._encode")
    from azure.servicebus._pyamqp.performatives import TransferFrame

    used = _generic_only(monkeypatch)
    for settled, more in ((None, None), (True, False), (False, True), (False, False)):
        frame = TransferFrame(
            handle=1, delivery_id=7, delivery_tag=b"\x00\x00\x00\x01", message_format=0,
            settled=settled, more=more, payload=b"payload",
        )  # fmt: skip
        _header, body = _encode.encode_frame(frame)
        assert frames._sdk_transfer(bytes(body)) is not None  # not the list decoded generically
        transfer, payload = frames.decode_body(bytes(body), frames.FRAME_AMQP)
        assert transfer == Transfer(1, 7, b"\x00\x00\x00\x01", 0, settled, more)
        assert payload == b"payload"
        head = len(body) - len(b"payload")
        for cut in range(1, head):  # truncated: refused, never misread
            with pytest.raises(DecodeError):
                frames.decode_body(bytes(body[:cut]), frames.FRAME_AMQP)
    assert used == []
    bad = bytearray(body)
    bad[bad.index(b"\x56") + 1] = 2  # neither 0 nor 1: the generic decoding refuses it
    with pytest.raises(DecodeError):
        frames.decode_body(bytes(bad), frames.FRAME_AMQP)


@pytest.mark.parametrize(
    "fields",
    [
        [*PYTHON_SDK_TRANSFER[:4], None, None, None, None, None, None, True],  # batchable
        [Uint(1), Uint(7), b"t", Uint(0), False, False, None, "not a state"],
    ],
)
def test_other_transfers_are_checked_field_by_field(
    monkeypatch: pytest.MonkeyPatch, fields: list[Any]
) -> None:
    used = _generic_only(monkeypatch)
    body = encode(Described(Ulong(0x14), fields))
    if fields[-1] is True:
        transfer, _ = frames.decode_body(body, frames.FRAME_AMQP)
        assert isinstance(transfer, Transfer) and transfer.batchable is True
    else:
        with pytest.raises(DecodeError):
            frames.decode_body(body, frames.FRAME_AMQP)
    assert used and used[0] is Transfer


def test_a_transfer_whose_list_is_described_is_refused() -> None:
    body = encode(Described(Ulong(0x14), Described(Ulong(1), PYTHON_SDK_TRANSFER)))
    with pytest.raises(DecodeError):
        frames.decode_body(body, frames.FRAME_AMQP)


def test_null_list_elements_decode_as_before() -> None:
    values = [None, Uint(3), None, [None, None], None]
    assert decode_all(encode(values)) == [values]


@pytest.mark.parametrize("number", [0, 5, 255, 70_000])
@pytest.mark.parametrize("flags", [[], [None], [True], [False, True], [True, None, None, None]])
def test_the_byte_level_transfer_reads_what_the_generic_decoding_reads(
    number: int, flags: list[Any]
) -> None:
    fields = [Uint(number), Uint(number + 1), b"tag", Uint(number), *flags]
    body = encode(Described(Ulong(0x14), fields)) + b"payload"
    transfer, payload = frames.decode_body(body, frames.FRAME_AMQP)
    assert transfer == Transfer.from_described(fields)
    assert payload == b"payload"
    for cut in range(1, len(body) - len(b"payload")):  # truncated: refused, never misread
        try:
            got, rest = frames.decode_body(body[:cut], frames.FRAME_AMQP)
        except DecodeError:
            continue
        assert (got, rest) == (transfer, b"") and cut == len(body) - len(b"payload")
