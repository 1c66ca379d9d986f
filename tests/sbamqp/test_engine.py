"""sbamqp.engine without a socket: frames in, events and frames out."""

from __future__ import annotations

from typing import Any

import pytest

from sbamqp import conventions, engine, frames
from sbamqp.codec import Described, Symbol, Ulong, encode
from sbamqp.conventions import Condition
from sbamqp.performatives import (
    Accepted,
    Attach,
    Begin,
    Close,
    Coordinator,
    Detach,
    Disposition,
    End,
    Error,
    Flow,
    Open,
    Performative,
    Rejected,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    Source,
    Target,
)
from sbamqp.performatives import Transfer as TransferFrame

pytestmark = pytest.mark.unit

SASL_INIT = frames.encode_frame(0, SaslInit(mechanism="ANONYMOUS"), frame_type=frames.FRAME_SASL)
OPEN = frames.encode_frame(0, Open(container_id="client", hostname="localhost"))
BEGIN = frames.encode_frame(
    0, Begin(next_outgoing_id=0, incoming_window=5000, outgoing_window=5000)
)


def attach(handle: int = 0, address: str = "amqps://localhost:5671/orders", **kw: Any) -> bytes:
    perf = Attach(
        name=kw.pop("name", f"sender-{handle}"),
        handle=handle,
        role=kw.pop("role", False),
        source=Source(address="client-src"),
        target=Target(address=address),
        **kw,
    )
    return frames.encode_frame(kw.pop("channel", 0), perf)


def transfer(payload: bytes, delivery_id: int | None = 0, handle: int = 0, **kw: Any) -> bytes:
    first = delivery_id is not None
    perf = TransferFrame(
        handle=handle,
        delivery_id=delivery_id,
        delivery_tag=(b"tag%d" % delivery_id) if first else None,
        message_format=kw.pop("message_format", 0 if first else None),
        **kw,
    )
    return frames.encode_frame(0, perf, payload)


def parse(out: bytes) -> list[Performative | bytes | None]:
    """The protocol headers (bytes), performatives and heartbeats (None) in `out`."""
    result: list[Performative | bytes | None] = []
    off = 0
    while off < len(out):
        if out[off : off + 4] == b"AMQP":
            result.append(out[off : off + 8])
            off += 8
            continue
        header = frames.parse_header(out, off, 1 << 30)
        assert header is not None
        body = out[off + header.body_offset : off + header.size]
        perf, _ = frames.decode_body(body, header.frame_type)
        result.append(perf)
        off += header.size
    return result


def opened(limits: engine.Limits | None = None, pipeline: bytes = b"") -> engine.ServerConnection:
    conn = engine.ServerConnection(limits)
    conn.receive_data(frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + OPEN + pipeline)
    return conn


def attached(conn: engine.ServerConnection, handle: int = 0) -> engine.Link:
    events = conn.receive_data(attach(handle))
    link = next(e.link for e in events if isinstance(e, engine.LinkAttached))
    conn.accept_attach(link, max_message_size=1000)
    conn.grant_credit(link, 10)
    conn.data_to_send()
    return link


def test_a_pipelined_handshake_gets_sasl_open_begin_and_the_attach_event() -> None:
    conn = engine.ServerConnection()
    # Everything at once: the client does not wait for the server's headers.
    events = conn.receive_data(
        frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + OPEN + BEGIN + attach()
    )
    kinds = [type(e) for e in events]
    assert kinds == [engine.SaslDone, engine.Opened, engine.SessionBegun, engine.LinkAttached]
    assert events[0].mechanism == "ANONYMOUS" and events[1].hostname == "localhost"
    out = parse(conn.data_to_send())
    assert out[0] == frames.SASL_HEADER
    mechanisms = out[1]
    assert isinstance(mechanisms, SaslMechanisms)
    assert list(mechanisms.sasl_server_mechanisms) == ["MSSBCBS", "ANONYMOUS"]
    assert isinstance(out[2], SaslOutcome) and out[2].code == 0
    assert out[3] == frames.AMQP_HEADER
    assert isinstance(out[4], Open) and out[4].idle_time_out is None  # we never ask
    assert isinstance(out[5], Begin) and out[5].remote_channel == 0
    assert len(out) == 6  # the attach waits for the application
    link = events[3].link
    conn.accept_attach(link, max_message_size=4096, properties={"p": 1})
    (answer,) = parse(conn.data_to_send())
    assert isinstance(answer, Attach) and answer.role is True
    assert answer.max_message_size == 4096 and answer.properties == {"p": 1}
    assert isinstance(answer.target, Target) and answer.target.address == link.target_address


def test_mssbcbs_is_accepted_and_an_unoffered_mechanism_refused() -> None:
    conn = engine.ServerConnection()
    init = frames.encode_frame(0, SaslInit(mechanism="MSSBCBS"), frame_type=frames.FRAME_SASL)
    events = conn.receive_data(frames.SASL_HEADER + init)
    assert isinstance(events[0], engine.SaslDone) and events[0].mechanism == "MSSBCBS"
    conn = engine.ServerConnection()
    init = frames.encode_frame(0, SaslInit(mechanism="PLAIN"), frame_type=frames.FRAME_SASL)
    events = conn.receive_data(frames.SASL_HEADER + init)
    assert isinstance(events[0], engine.ProtocolViolation) and conn.finished
    outcome = parse(conn.data_to_send())[-1]
    assert isinstance(outcome, SaslOutcome) and outcome.code == 1


def test_an_amqp_header_without_sasl_gets_the_sasl_header_and_the_end() -> None:
    conn = engine.ServerConnection()
    events = conn.receive_data(frames.AMQP_HEADER + OPEN)
    assert isinstance(events[0], engine.ProtocolViolation) and conn.finished
    assert conn.data_to_send() == frames.SASL_HEADER


def test_a_multi_frame_transfer_is_reassembled_and_settled() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    events = conn.receive_data(
        transfer(b"abc", more=True) + transfer(b"def", None, more=True) + transfer(b"g", None)
    )
    (delivery,) = events
    assert isinstance(delivery, engine.Transfer)
    assert delivery.payload == b"abcdefg" and delivery.delivery_tag == b"tag0"
    assert not delivery.settled and not delivery.over_credit
    conn.settle(link, delivery.delivery_id, Accepted())
    conn.settle(link, 1, Rejected(Error(Condition.SERVER_BUSY, "busy")))
    accepted, rejected = parse(conn.data_to_send())
    assert accepted == Disposition(role=True, first=0, settled=True, state=Accepted())
    assert isinstance(rejected, Disposition) and isinstance(rejected.state, Rejected)
    assert rejected.state.error == Error(Condition.SERVER_BUSY, "busy", {})  # info: a map


def test_the_hot_path_frames_equal_the_generic_encoding() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    conn.settle(link, 7, Accepted())
    (frame,) = parse(conn.data_to_send())
    assert frame == Disposition(role=True, first=7, settled=True, state=Accepted())
    conn.grant_credit(link, 3)
    (flow,) = parse(conn.data_to_send())
    assert isinstance(flow, Flow) and flow.handle == link.local_handle and flow.link_credit == 3


def test_a_delivery_over_the_size_limit_is_rejected_by_the_engine() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)  # max_message_size 1000
    events = conn.receive_data(
        transfer(b"x" * 600, more=True) + transfer(b"x" * 600, None, more=False)
    )
    (refused,) = events
    assert isinstance(refused, engine.TransferRefused) and refused.size == 1200
    (disposition,) = parse(conn.data_to_send())
    assert isinstance(disposition, Disposition) and isinstance(disposition.state, Rejected)
    assert disposition.state.error is not None
    assert disposition.state.error.condition == Condition.MESSAGE_SIZE_EXCEEDED
    assert link.max_message_size == 1000


def test_a_transfer_pipelined_behind_its_attach_is_held_to_the_connections_limit() -> None:
    """Before the application answers an attach, a transfer in the same read was judged
    against the link's limit, still 0: refused as oversize. Until the answer, the
    connection's own limit applies (the edge checks the message's size itself)."""
    conn = opened(engine.Limits(max_message_size=5000), pipeline=BEGIN)
    events = conn.receive_data(attach() + transfer(b"x" * 600))
    kinds = [type(e) for e in events]
    assert kinds == [engine.LinkAttached, engine.Transfer], events
    assert events[1].payload == b"x" * 600 and events[1].over_credit
    conn = opened(engine.Limits(max_message_size=5000), pipeline=BEGIN)
    (_, refused) = conn.receive_data(attach() + transfer(b"x" * 6000))
    assert isinstance(refused, engine.TransferRefused) and refused.size == 6000


def test_an_aborted_delivery_is_dropped() -> None:
    conn = opened(pipeline=BEGIN)
    attached(conn)
    assert conn.receive_data(transfer(b"abc", more=True) + transfer(b"", None, aborted=True)) == []
    (delivery,) = conn.receive_data(transfer(b"next", delivery_id=1))
    assert isinstance(delivery, engine.Transfer) and delivery.payload == b"next"


def test_a_transfer_without_credit_is_flagged() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    conn.grant_credit(link, 1)
    first, second = conn.receive_data(transfer(b"a", 0) + transfer(b"b", 1))
    assert isinstance(first, engine.Transfer) and not first.over_credit
    assert isinstance(second, engine.Transfer) and second.over_credit


def test_the_session_window_is_reopened() -> None:
    conn = opened(engine.Limits(incoming_window=4), pipeline=BEGIN)
    attached(conn)
    for i in range(10):
        conn.receive_data(transfer(b"a", i))
    flows = [f for f in parse(conn.data_to_send()) if isinstance(f, Flow)]
    assert flows and all(f.handle is None and f.incoming_window == 4 for f in flows)


def test_heartbeats_at_half_the_peer_idle_timeout() -> None:
    conn = engine.ServerConnection(now=0.0)
    open_idle = frames.encode_frame(0, Open(container_id="node", idle_time_out=60_000))
    conn.receive_data(frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + open_idle, now=0.0)
    conn.data_to_send()
    conn.sent(0.0)
    assert conn.next_deadline(0.0) == 30.0
    assert conn.tick(29.0) == [] and conn.data_to_send() == b""
    conn.tick(30.0)
    assert conn.data_to_send() == frames.heartbeat()
    assert conn.next_deadline(30.0) == 60.0


def test_no_idle_timeout_means_no_deadline_after_the_handshake() -> None:
    conn = opened()
    assert conn.next_deadline(1.0) is None


def test_the_handshake_deadline_ends_a_silent_connection() -> None:
    conn = engine.ServerConnection(engine.Limits(handshake_timeout=5), now=0.0)
    conn.receive_data(frames.SASL_HEADER, now=0.0)
    assert conn.next_deadline(0.0) == 5.0
    events = conn.tick(5.0)
    assert isinstance(events[0], engine.ProtocolViolation) and conn.finished


def test_frames_after_end_are_tolerated() -> None:
    conn = opened(pipeline=BEGIN)
    attached(conn)
    events = conn.receive_data(
        frames.encode_frame(0, End())
        + frames.encode_frame(0, Detach(handle=0, closed=False))  # pyamqp does this
    )
    assert [type(e) for e in events] == [engine.SessionEnded]
    assert not conn.finished
    assert isinstance(parse(conn.data_to_send())[-1], End)


def test_a_detach_is_answered_and_reported() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    (event,) = conn.receive_data(frames.encode_frame(0, Detach(handle=0, closed=True)))
    assert isinstance(event, engine.LinkDetached) and event.link is link
    (answer,) = parse(conn.data_to_send())
    assert answer == Detach(handle=link.local_handle, closed=True)
    # The handle may be used again.
    assert isinstance(conn.receive_data(attach(0))[0], engine.LinkAttached)


def test_a_refused_link_is_attached_then_detached_with_the_error() -> None:
    conn = opened(pipeline=BEGIN)
    conn.data_to_send()
    (event,) = conn.receive_data(attach(0, role=True))  # a receiver
    conn.refuse_link(event.link, Condition.NOT_IMPLEMENTED, "only senders")
    answer, detach = parse(conn.data_to_send())
    assert isinstance(answer, Attach) and answer.source is None
    assert detach == Detach(
        handle=answer.handle,
        closed=True,
        error=Error(Condition.NOT_IMPLEMENTED, "only senders", {}),
    )


def test_a_coordinator_is_recognised() -> None:
    conn = opened(pipeline=BEGIN)
    perf = Attach(name="txn", handle=0, role=False, source=Source(), target=Coordinator())
    (event,) = conn.receive_data(frames.encode_frame(0, perf))
    assert isinstance(event, engine.LinkAttached) and event.link.is_coordinator


def test_replies_wait_for_credit_then_go_settled() -> None:
    conn = opened(pipeline=BEGIN)
    (event,) = conn.receive_data(attach(0, role=True, address="$cbs", name="cbs-reply"))
    link = event.link
    conn.accept_attach(link)
    conn.data_to_send()
    conn.send(link, b"\x00\x53\x77\x40")
    assert conn.data_to_send() == b""  # no credit yet
    flow = Flow(
        next_incoming_id=0,
        incoming_window=10,
        next_outgoing_id=0,
        outgoing_window=10,
        handle=0,
        delivery_count=0,
        link_credit=5,
    )
    conn.receive_data(frames.encode_frame(0, flow))
    (frame,) = parse(conn.data_to_send())
    assert isinstance(frame, TransferFrame) and frame.settled and frame.delivery_id == 0


def test_a_reply_larger_than_the_peer_frame_is_split() -> None:
    open_small = frames.encode_frame(0, Open(container_id="c", max_frame_size=512))
    conn = engine.ServerConnection()
    conn.receive_data(
        frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + open_small + BEGIN
        + attach(0, role=True, address="$cbs")
    )  # fmt: skip
    link = conn.links[0]
    conn.accept_attach(link)
    flow = Flow(incoming_window=9, next_outgoing_id=0, outgoing_window=9, handle=0, link_credit=1)
    conn.receive_data(frames.encode_frame(0, flow))
    conn.data_to_send()
    conn.send(link, b"x" * 2000)
    out = conn.data_to_send()
    transfers = [p for p in parse(out) if isinstance(p, TransferFrame)]
    assert len(transfers) > 3 and transfers[-1].more is False
    assert all(t.more for t in transfers[:-1])


@pytest.mark.parametrize(
    ("data", "condition"),
    [
        (b"\x00\x00\x00\x05\x02\x00\x00\x00", Condition.FRAMING_ERROR),  # size < 8
        (b"\x7f\xff\xff\xff\x02\x00\x00\x00", Condition.FRAMING_ERROR),  # size > max
        (frames.encode_frame(0, b"\x00\x53\x77\x40"), Condition.FRAMING_ERROR),  # not a perf.
        (frames.encode_frame(0, b"\xb0\xff\xff\xff\xff"), Condition.DECODE_ERROR),
        (frames.encode_frame(9, Begin(remote_channel=1)), Condition.NOT_ALLOWED),
        (frames.encode_frame(5, End()), Condition.FRAMING_ERROR),  # never begun
        (BEGIN + BEGIN, Condition.FRAMING_ERROR),
        (BEGIN + attach(0) + attach(0), Condition.HANDLE_IN_USE),
        (BEGIN + attach(99), Condition.RESOURCE_LIMIT_EXCEEDED),
        (BEGIN + transfer(b"x"), Condition.UNATTACHED_HANDLE),
        (OPEN, Condition.FRAMING_ERROR),  # a second open
    ],
)
def test_violations_close_the_connection(data: bytes, condition: str) -> None:
    conn = opened()
    conn.data_to_send()
    events = conn.receive_data(data)
    violations = [e for e in events if isinstance(e, engine.ProtocolViolation)]
    assert violations and violations[0].condition == condition, events
    close = parse(conn.data_to_send())[-1]
    assert isinstance(close, Close) and close.error is not None
    assert close.error.condition == condition and close.error.info == {}
    assert conn.receive_data(BEGIN) == []  # nothing more is processed
    events = conn.receive_data(frames.encode_frame(0, Close()))
    if (
        isinstance(violations[0], engine.ProtocolViolation)
        and data[4:5] == b"\x02"
        and (int.from_bytes(data[:4], "big") not in range(8, 1 << 20))
    ):
        assert events == []  # a broken frame header: the stream is not read any more
    else:
        assert isinstance(events[0], engine.Closed) and conn.finished


def test_caps_on_sessions_and_links() -> None:
    conn = opened(engine.Limits(max_sessions=1))
    events = conn.receive_data(BEGIN + frames.encode_frame(1, Begin(next_outgoing_id=0)))
    assert isinstance(events[-1], engine.ProtocolViolation)
    assert events[-1].condition == Condition.RESOURCE_LIMIT_EXCEEDED
    conn = opened(engine.Limits(max_links=2), pipeline=BEGIN)
    events = conn.receive_data(attach(0) + attach(1) + attach(2))
    assert isinstance(events[-1], engine.ProtocolViolation)


def test_close_by_the_server_then_the_peer_answer() -> None:
    conn = opened(pipeline=BEGIN)
    conn.data_to_send()
    conn.close(Condition.CONNECTION_FORCED, "draining")
    (close,) = parse(conn.data_to_send())
    assert close == Close(Error(Condition.CONNECTION_FORCED, "draining", {}))
    assert not conn.finished
    (event,) = conn.receive_data(frames.encode_frame(0, Close()))
    assert isinstance(event, engine.Closed) and conn.finished


def test_close_grace_when_the_peer_never_answers() -> None:
    conn = engine.ServerConnection(engine.Limits(close_grace=2), now=0.0)
    conn.receive_data(frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + OPEN, now=0.0)
    conn.close(Condition.CONNECTION_FORCED, "bye")
    assert conn.next_deadline(100.0) == 102.0  # the grace runs from when the close went out
    conn.tick(101.0)
    assert not conn.finished
    conn.tick(102.0)
    assert conn.finished


def test_a_peer_close_is_answered() -> None:
    conn = opened(pipeline=BEGIN)
    conn.data_to_send()
    (event,) = conn.receive_data(frames.encode_frame(0, Close()))
    assert isinstance(event, engine.Closed) and conn.finished
    assert parse(conn.data_to_send()) == [Close()]


def test_bytes_may_arrive_one_at_a_time() -> None:
    conn = engine.ServerConnection()
    data = frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + OPEN + BEGIN + attach()
    events = []
    for i in range(len(data)):
        events += conn.receive_data(data[i : i + 1])
    assert [type(e) for e in events][-1] is engine.LinkAttached


def test_limits_are_advertised() -> None:
    conn = opened(engine.Limits(max_frame_size=65536, channel_max=7, handle_max=3), BEGIN)
    out = parse(conn.data_to_send())
    open_ = next(p for p in out if isinstance(p, Open))
    begin = next(p for p in out if isinstance(p, Begin))
    assert open_.max_frame_size == 65536 and open_.channel_max == 7
    assert begin.handle_max == 3
    assert conventions.SASL_MSSBCBS in conn.limits.sasl_mechanisms


def test_replies_without_credit_are_capped() -> None:
    conn = opened(engine.Limits(max_queued_replies=3), pipeline=BEGIN)
    (event,) = conn.receive_data(attach(0, role=True, address="$cbs"))
    conn.accept_attach(event.link)
    for _ in range(3):
        conn.send(event.link, b"\x00\x53\x77\x40")
    assert not conn.data_to_send().endswith(frames.encode_frame(0, Close()))
    conn.send(event.link, b"\x00\x53\x77\x40")
    close = parse(conn.data_to_send())[-1]
    assert isinstance(close, Close) and close.error is not None
    assert close.error.condition == Condition.RESOURCE_LIMIT_EXCEEDED


def test_a_draining_receiver_gets_its_credit_used_up() -> None:
    conn = opened(pipeline=BEGIN)
    (event,) = conn.receive_data(attach(0, role=True, address="$cbs"))
    conn.accept_attach(event.link)
    conn.data_to_send()
    flow = Flow(
        incoming_window=9, next_outgoing_id=0, outgoing_window=9, handle=0, delivery_count=0,
        link_credit=4, drain=True,
    )  # fmt: skip
    conn.receive_data(frames.encode_frame(0, flow))
    (answer,) = parse(conn.data_to_send())
    assert isinstance(answer, Flow) and answer.drain and answer.link_credit == 0
    assert answer.delivery_count == 4


def test_unfinished_deliveries_are_capped_across_links() -> None:
    conn = opened(engine.Limits(max_buffered_bytes=1500, max_message_size=1000), BEGIN)
    for handle in (0, 1):
        link = attached(conn, handle)
        link.max_message_size = 1000
    assert conn.receive_data(transfer(b"x" * 700, 0, handle=0, more=True)) == []
    assert conn.receive_data(transfer(b"x" * 700, 1, handle=1, more=True)) == []
    # Finishing a delivery releases its bytes.
    assert isinstance(conn.receive_data(transfer(b"", None, handle=0))[0], engine.Transfer)
    assert conn.receive_data(transfer(b"x" * 700, 2, handle=0, more=True)) == []
    (violation,) = conn.receive_data(transfer(b"x" * 200, None, handle=1, more=True))
    assert isinstance(violation, engine.ProtocolViolation)
    assert violation.condition == Condition.RESOURCE_LIMIT_EXCEEDED


def test_nonsense_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_frame_size"):
        engine.Limits(max_frame_size=100)
    with pytest.raises(ValueError, match="incoming_window"):
        engine.Limits(incoming_window=0)


def test_a_symbol_where_a_string_belongs_is_taken() -> None:
    perf = Described(Ulong(0x10), [Symbol("container"), Symbol("localhost")])
    conn = engine.ServerConnection()
    events = conn.receive_data(
        frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + frames.encode_frame(0, encode(perf))
    )
    opened_ = events[-1]
    assert isinstance(opened_, engine.Opened) and opened_.hostname == "localhost"


def test_frames_crossing_our_detach_are_dropped() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    conn.detach(link, Condition.CONNECTION_FORCED, "draining")
    conn.data_to_send()
    # Sent by the peer before it saw our detach: no violation, no delivery.
    flow = Flow(incoming_window=9, next_outgoing_id=0, outgoing_window=9, handle=0, link_credit=1)
    assert conn.receive_data(transfer(b"late") + frames.encode_frame(0, flow)) == []
    assert not conn.finished and conn.data_to_send() == b""
    # Its answering detach closes the matter; the handle is unknown from then on.
    assert conn.receive_data(frames.encode_frame(0, Detach(handle=0, closed=True))) == []
    (violation,) = conn.receive_data(transfer(b"later", 1))
    assert isinstance(violation, engine.ProtocolViolation)
    assert violation.condition == Condition.UNATTACHED_HANDLE


def test_a_flow_for_a_refused_receiver_is_dropped() -> None:
    conn = opened(pipeline=BEGIN)
    (event,) = conn.receive_data(attach(0, role=True))
    conn.refuse_link(event.link, Condition.NOT_IMPLEMENTED, "only senders")
    flow = Flow(incoming_window=9, next_outgoing_id=0, outgoing_window=9, handle=0, link_credit=5)
    assert conn.receive_data(frames.encode_frame(0, flow)) == []
    assert not conn.finished


def test_echo_is_answered() -> None:
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    flow = Flow(incoming_window=9, next_outgoing_id=0, outgoing_window=9, handle=0, echo=True)
    conn.receive_data(frames.encode_frame(0, flow))
    (answer,) = parse(conn.data_to_send())
    assert isinstance(answer, Flow) and answer.handle == link.local_handle
    session_echo = Flow(incoming_window=9, next_outgoing_id=0, outgoing_window=9, echo=True)
    conn.receive_data(frames.encode_frame(0, session_echo))
    (answer,) = parse(conn.data_to_send())
    assert isinstance(answer, Flow) and answer.handle is None


def test_our_idle_timeout_is_advertised_and_enforced() -> None:
    conn = engine.ServerConnection(engine.Limits(idle_timeout=30), now=0.0)
    conn.receive_data(frames.SASL_HEADER + SASL_INIT + frames.AMQP_HEADER + OPEN, now=0.0)
    open_ = next(p for p in parse(conn.data_to_send()) if isinstance(p, Open))
    assert open_.idle_time_out == 30_000
    conn.receive_data(frames.heartbeat(), now=20.0)  # a heartbeat counts as traffic
    assert conn.next_deadline(20.0) == 50.0
    (violation,) = conn.tick(50.0)
    assert isinstance(violation, engine.ProtocolViolation)
    close = parse(conn.data_to_send())[-1]
    assert isinstance(close, Close) and close.error is not None


def test_twenty_deliveries_in_flight_on_one_link() -> None:
    """Node and .NET pipeline up to their credit: every delivery comes out, in order."""
    conn = opened(pipeline=BEGIN)
    link = attached(conn)
    conn.grant_credit(link, 20)
    events = conn.receive_data(b"".join(transfer(b"m%d" % i, i) for i in range(20)))
    assert [e.payload for e in events if isinstance(e, engine.Transfer)] == [
        b"m%d" % i for i in range(20)
    ]
    assert not any(e.over_credit for e in events if isinstance(e, engine.Transfer))
    for event in events:
        assert isinstance(event, engine.Transfer)
        conn.settle(link, event.delivery_id, Accepted())
    dispositions = parse(conn.data_to_send())
    assert [d.first for d in dispositions if isinstance(d, Disposition)] == list(range(20))
