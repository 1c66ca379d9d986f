"""The guard on what connection sharing relies on in the pinned SDK's pyamqp.

gateway/servicebus/pyamqp_sharing.py replaces or wraps a few pyamqp methods, and
gateway/servicebus/pool.py drives the SDK's sender and pyamqp's connection below their
public API, and gateway/servicebus/shared_cbs.py the SDK's CBS authenticator and `$cbs`
link pair; all were checked against this exact code (azure-servicebus 7.15.0). A change
here means: re-read the function, re-check those modules, update the hash.
"""

from __future__ import annotations

import hashlib
import inspect
import struct
from typing import Any

import pytest
from azure.servicebus._pyamqp import _encode
from azure.servicebus._pyamqp.aio import Connection
from azure.servicebus._pyamqp.aio._cbs_async import CBSAuthenticator
from azure.servicebus._pyamqp.aio._client_async import AMQPClientAsync, SendClientAsync
from azure.servicebus._pyamqp.aio._management_link_async import ManagementLink
from azure.servicebus._pyamqp.aio._transport_async import AsyncTransport, AsyncTransportMixin
from azure.servicebus._pyamqp.performatives import FlowFrame, TransferFrame
from azure.servicebus.aio import ServiceBusSender
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.servicebus import pyamqp_sharing

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

# sha256 (first 16 hex digits) of each function's source.
RELIED_ON: dict[str, str] = {
    "Session._outgoing_attach": "0afde8afd340ab6f",
    "Session.begin": "695f6df6d84d8f6f",
    "Session.end": "45a549bfd3c378e1",
    "Session._outgoing_transfer": "6e829b3d9233b8d0",
    "Link.attach": "d0da5bcec37bfe08",
    "Link.detach": "5635d70a98fe43b6",
    "Link._set_state": "48a729cd4c6ac9af",
    "Link._on_session_state_change": "557e0d7d65db7371",
    "Link._outgoing_attach": "ca406b303c5755d5",
    "SenderLink._outgoing_transfer": "5cb1b9a74a54535e",
    "SenderLink.update_pending_deliveries": "a560b7f95dc3e302",
    "SenderLink._incoming_attach": "a280c21a87877c2f",
    "_encode.encode_frame": "a943d5000389c6a1",
    "AsyncTransportMixin.send_frame": "4ed681a31dd74988",
    "ServiceBusSender._open": "75ea88dee0119aba",
    "ServiceBusSender._create_handler": "9335ab1d2e2c4b80",
    "AMQPClientAsync.open_async": "dd1a3d4ff9645693",
    "AMQPClientAsync.close_async": "f0d0f8d8ce5abfaf",
    "AMQPClientAsync.client_ready_async": "1b1589bf969b7fa9",
    "AMQPClientAsync.auth_complete_async": "9829ffa7655017aa",
    "SendClientAsync._client_ready_async": "f1ead58047b369af",
    "Connection.listen": "7044b5a2b2337d3d",
    "Connection._read_frame": "3f769504f8d7fec4",
    "Connection._process_incoming_frame": "fe16ec45aba163b2",
    "Connection.create_session": "aaac04040fe61c3c",
    "Connection.open": "ce876fe27199e181",
    "AsyncTransportMixin.read": "cce3f7da868bc405",
    "AsyncTransportMixin.receive_frame": "4ed0732687e53030",
    "AsyncTransportMixin.write": "59781c195270c175",
    "AsyncTransport._write": "7efff3e8d7d05df2",
    "CBSAuthenticator.__init__": "35652ec43ff6bcbc",
    "CBSAuthenticator._put_token": "d4ad58c3d563498c",
    "CBSAuthenticator._on_execute_operation_complete": "2d04a57ba98da5fd",
    "CBSAuthenticator._update_status": "23c32a8a2c9654e1",
    "CBSAuthenticator._cbs_link_ready": "10e83a15cbb86497",
    "CBSAuthenticator.open": "1aeb62633d544dfb",
    "CBSAuthenticator.close": "ae3c7cbbaaba25c2",
    "CBSAuthenticator.update_token": "4d70b3272c006097",
    "CBSAuthenticator.handle_token": "f1872de4986d6d1f",
    "ManagementLink.__init__": "a279309491ba8b8f",
    "ManagementLink.open": "35e93a3a70447581",
    "ManagementLink.execute_operation": "7722624197b67c86",
    "ManagementLink.cancel_operation": "d75cb0c19b13fb25",
    "ManagementLink._on_message_received": "8a8835464b1a4c6e",
    "ManagementLink._on_send_complete": "cf7c67167313a9a4",
    "AMQPClientAsync._keep_alive_async": "7257c34b2981cd2b",
}


def _relied_on() -> dict[str, Any]:
    return {
        **pyamqp_sharing.ORIGINALS,
        "ServiceBusSender._open": ServiceBusSender._open,
        "ServiceBusSender._create_handler": ServiceBusSender._create_handler,
        "AMQPClientAsync.open_async": AMQPClientAsync.open_async,
        "AMQPClientAsync.close_async": AMQPClientAsync.close_async,
        "AMQPClientAsync.client_ready_async": AMQPClientAsync.client_ready_async,
        "AMQPClientAsync.auth_complete_async": AMQPClientAsync.auth_complete_async,
        "SendClientAsync._client_ready_async": SendClientAsync._client_ready_async,
        "Connection.listen": Connection.listen,
        "Connection._read_frame": Connection._read_frame,
        "Connection._process_incoming_frame": Connection._process_incoming_frame,
        "Connection.create_session": Connection.create_session,
        "Connection.open": Connection.open,
        "AsyncTransportMixin.read": AsyncTransportMixin.read,
        "AsyncTransportMixin.receive_frame": AsyncTransportMixin.receive_frame,
        "AsyncTransportMixin.write": AsyncTransportMixin.write,
        "AsyncTransport._write": AsyncTransport._write,
        "CBSAuthenticator.__init__": CBSAuthenticator.__init__,
        "CBSAuthenticator._put_token": CBSAuthenticator._put_token,
        "CBSAuthenticator._on_execute_operation_complete": (
            CBSAuthenticator._on_execute_operation_complete
        ),
        "CBSAuthenticator._update_status": CBSAuthenticator._update_status,
        "CBSAuthenticator._cbs_link_ready": CBSAuthenticator._cbs_link_ready,
        "CBSAuthenticator.open": CBSAuthenticator.open,
        "CBSAuthenticator.close": CBSAuthenticator.close,
        "CBSAuthenticator.update_token": CBSAuthenticator.update_token,
        "CBSAuthenticator.handle_token": CBSAuthenticator.handle_token,
        "ManagementLink.__init__": ManagementLink.__init__,
        "ManagementLink.open": ManagementLink.open,
        "ManagementLink.execute_operation": ManagementLink.execute_operation,
        "ManagementLink.cancel_operation": ManagementLink.cancel_operation,
        "ManagementLink._on_message_received": ManagementLink._on_message_received,
        "ManagementLink._on_send_complete": ManagementLink._on_send_complete,
        "AMQPClientAsync._keep_alive_async": AMQPClientAsync._keep_alive_async,
    }


def _hashes() -> dict[str, str]:
    return {
        name: hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        for name, obj in _relied_on().items()
    }


def test_sharing_is_installed_with_the_pinned_sdk() -> None:
    assert pyamqp_sharing.install()
    from azure.servicebus._pyamqp.aio._session_async import Session

    assert Session.begin is pyamqp_sharing._session_begin


def test_the_sdk_internals_sharing_relies_on_are_unchanged() -> None:
    got = _hashes()
    changed = sorted(name for name in got if got[name] != RELIED_ON.get(name))
    assert not changed, (
        "SDK internals changed, re-check gateway/servicebus/pyamqp_sharing.py and pool.py: "
        f"{changed}"
    )


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
