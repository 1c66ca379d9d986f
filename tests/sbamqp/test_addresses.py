"""sbamqp.addresses: every target form, audiences, and where a request's reply goes for each
SDK's habit (Python: no reply-to; Node: the receiver's link name; .NET: its target address)."""

from __future__ import annotations

import pytest

from sbamqp import addresses, engine, frames
from sbamqp.performatives import Attach, Begin, SaslInit, Source, Target
from tests.sbamqp.test_engine import OPEN, parse

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("address", "path"),
    [
        ("amqps://gw.example.com:5671/orders", "orders"),  # Python, even in plain mode
        ("amqp://localhost:5672/orders", "orders"),
        ("orders", "orders"),  # Node
        ("/orders", "orders"),  # .NET
        ("orders/$management", "orders/$management"),
        ("amqps://h/topic/Subscriptions/s", "topic/Subscriptions/s"),
        ("amqps://h", ""),
        ("$cbs", "$cbs"),
    ],
)
def test_entity_path(address: str, path: str) -> None:
    assert addresses.entity_path(address) == path


def test_audience_path() -> None:
    assert addresses.audience_path("sb://localhost:5672/orders") == "orders"
    assert addresses.audience_path("sb://gw.example.com/orders/$management") == (
        "orders/$management"
    )


def _connection() -> engine.ServerConnection:
    init = frames.encode_frame(0, SaslInit(mechanism="MSSBCBS"), frame_type=frames.FRAME_SASL)
    conn = engine.ServerConnection()
    conn.receive_data(frames.SASL_HEADER + init + frames.AMQP_HEADER + OPEN)
    return conn


def _begin(channel: int) -> bytes:
    return frames.encode_frame(
        channel, Begin(next_outgoing_id=0, incoming_window=100, outgoing_window=100)
    )


def _attach(channel: int, handle: int, name: str, role: bool, source: str, target: str) -> bytes:
    perf = Attach(
        name=name,
        handle=handle,
        role=role,
        source=Source(address=source),
        target=Target(address=target),
        properties={"com.microsoft:timeout": 60000},  # .NET's, accepted and ignored
    )
    return frames.encode_frame(channel, perf)


def _links(conn: engine.ServerConnection, data: bytes) -> list[engine.Link]:
    events = conn.receive_data(data)
    links = [e.link for e in events if isinstance(e, engine.LinkAttached)]
    for link in links:
        conn.accept_attach(link)
    return links


def test_python_no_reply_to_answers_on_the_cbs_source_of_the_same_session() -> None:
    conn = _connection()
    links = _links(
        conn,
        _begin(0)
        + _attach(0, 0, "cbs-send", False, "cbs-src", "$cbs")
        + _attach(0, 1, "cbs-recv", True, "$cbs", "cbs-tgt")
        + _begin(1)
        + _attach(1, 0, "other-recv", True, "$cbs", "x"),  # another session's: not this one
    )
    request, reply, other = links
    found = addresses.reply_link(None, "$cbs", request.session.links.values(), conn.links)
    assert found is reply
    assert other.session is not request.session


def test_node_reply_to_is_the_receiver_link_name() -> None:
    conn = _connection()
    request, reply = _links(
        conn,
        _begin(0)
        + _attach(0, 0, "cbs-sender-1", False, "cbs-sender-1", "$cbs")
        + _begin(1)  # Node may use another session for the receiver
        + _attach(1, 0, "cbs-receiver-1", True, "$cbs", "cbs-receiver-1"),
    )
    found = addresses.reply_link(
        "cbs-receiver-1", "$cbs", request.session.links.values(), conn.links
    )
    assert found is reply


def test_dotnet_reply_to_is_the_receiver_target_address_and_targets_start_with_a_slash() -> None:
    conn = _connection()
    request, reply, sender = _links(
        conn,
        _begin(0)
        + _attach(0, 0, "duplex-sender", False, "sender-src", "$cbs")
        + _attach(0, 1, "duplex-receiver", True, "$cbs", "cbs-reply-1b2c")
        + _begin(1)  # a session per link
        + _attach(1, 0, "orders-sender", False, "src", "/orders"),
    )
    found = addresses.reply_link(
        "cbs-reply-1b2c", "$cbs", request.session.links.values(), conn.links
    )
    assert found is reply
    assert addresses.entity_path(sender.target_address or "") == "orders"
    assert sender.properties == {"com.microsoft:timeout": 60000}
    out = parse(conn.data_to_send())
    assert sum(isinstance(p, Attach) for p in out) == 3


def test_an_unknown_reply_to_finds_nothing() -> None:
    conn = _connection()
    (request,) = _links(conn, _begin(0) + _attach(0, 0, "s", False, "s", "$cbs"))
    assert (
        addresses.reply_link("nobody", "$cbs", request.session.links.values(), conn.links) is None
    )
    assert addresses.reply_link(None, "$cbs", request.session.links.values(), conn.links) is None
