"""The frames connection sharing writes are pyamqp's own.

gateway/servicebus/internals/pyamqp_sharing.py encodes a TRANSFER performative once where
pyamqp encodes it twice; these hold its bytes to pyamqp's encoder. The SDK code it relies on
is hashed with the rest of the seam's (tests/gateway/test_sdk_seam.py).
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from azure.servicebus._pyamqp import _encode
from azure.servicebus._pyamqp.performatives import FlowFrame, TransferFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.servicebus.internals import pyamqp_sharing

TRANSFERS = [
    TransferFrame(
        handle=0,
        delivery_id=0,
        delivery_tag=b"\x00\x00\x00\x01",
        message_format=0,
        settled=False,
        more=False,
    ),
    TransferFrame(
        handle=7,
        delivery_id=300,
        delivery_tag=struct.pack(">I", 70000),
        message_format=0,
        settled=True,
        more=False,
        batchable=True,
    ),
    TransferFrame(
        handle=2**20,
        delivery_id=2**31,
        delivery_tag=b"t" * 300,
        message_format=0x80013700,
        settled=False,
        more=True,
    ),
]


@pytest.mark.parametrize("frame", TRANSFERS)
@pytest.mark.parametrize("payload", [b"", b"x", b"y" * 70_000])
def test_a_measured_transfer_is_sent_as_pyamqp_encodes_it(frame: Any, payload: bytes) -> None:
    """The session measures a TRANSFER (empty payload), then sends it with its payload: the
    transport's bytes are pyamqp's own for that frame, without encoding it twice."""
    sent = frame._replace(payload=memoryview(payload))
    expected = pyamqp_sharing._encode_frame(sent)
    pyamqp_sharing._measured_frame(frame._replace(payload=b""))
    assert pyamqp_sharing._sent_frame(sent) == expected
    assert pyamqp_sharing._last_transfer[0] == frame[:-1]


def test_any_other_frame_is_encoded_by_pyamqp() -> None:
    pyamqp_sharing._measured_frame(TRANSFERS[0]._replace(payload=b""))
    other = TRANSFERS[0]._replace(delivery_id=1, payload=b"p")  # not the measured one
    assert pyamqp_sharing._sent_frame(other) == pyamqp_sharing._encode_frame(other)
    flow = FlowFrame(next_incoming_id=1, incoming_window=5, next_outgoing_id=1, outgoing_window=5)
    assert pyamqp_sharing._sent_frame(flow) == _encode.encode_frame(flow)
    assert pyamqp_sharing._sent_frame(None) == _encode.encode_frame(None)


_maybe_bool = st.none() | st.booleans()


@given(
    frame=st.builds(
        TransferFrame,
        handle=st.none() | st.integers(0, 2**32 - 1),
        delivery_id=st.none() | st.integers(0, 2**32 - 1),
        delivery_tag=st.none() | st.binary(max_size=300),
        message_format=st.none() | st.integers(0, 2**32 - 1),
        settled=_maybe_bool,
        more=_maybe_bool,
        rcv_settle_mode=st.none() | st.integers(0, 1),
        state=st.none(),
        resume=_maybe_bool,
        aborted=_maybe_bool,
        batchable=_maybe_bool,
        payload=st.just(b""),
    )
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_transfer_performative_encodes_as_pyamqp_encodes_it(frame: Any) -> None:
    assert pyamqp_sharing._measured_frame(frame) == _encode.encode_frame(frame)
    assert pyamqp_sharing._last_transfer[0] == frame[:-1], "encoded field by field, and kept"


@pytest.mark.parametrize("number", [0, 1, 255, 256, 2**32 - 1])
@pytest.mark.parametrize("tag", [b"", b"\x00\x00\x00\x01", b"t" * 200])
@pytest.mark.parametrize("flags", [(None, None), (False, False), (True, False), (False, True)])
def test_the_transfer_every_send_writes_takes_the_short_encoding(
    number: int, tag: bytes, flags: tuple[bool | None, bool | None]
) -> None:
    """Plain ints, a short tag and the two flags: written without the walk over the eleven
    encoders (`_plain_transfer`), and still pyamqp's bytes."""
    settled, more = flags
    frame = TransferFrame(
        handle=number, delivery_id=number, delivery_tag=tag, message_format=number,
        settled=settled, more=more, payload=b"",
    )  # fmt: skip
    assert pyamqp_sharing._plain_transfer(frame[:-1]) is not None
    assert pyamqp_sharing._measured_frame(frame) == _encode.encode_frame(frame)
