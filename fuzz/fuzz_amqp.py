"""atheris fuzz target: sbamqp's decoders (codec, frames, sections) and its engine.

The AMQP edge reads these bytes from anyone who can reach its port. Any exception other
than `sbamqp.codec.DecodeError` from a decoder is a bug, and so is any exception at all
from `ServerConnection.receive_data` (it turns bad input into a close). A decoded value
must also encode to the same bytes after a second round (types are kept).

    mkdir -p .fuzz-amqp && python fuzz/fuzz_amqp.py -max_total_time=600 \
        -dict=fuzz/amqp.dict -artifact_prefix=.fuzz-amqp/ .fuzz-amqp fuzz/corpus/amqp
        # on demand: make fuzz (after the REST target)
    python fuzz/fuzz_amqp.py -runs=0 .fuzz-amqp/crash-<sha1>      # replay a finding

New inputs go to the first directory (.fuzz-amqp), so the committed seeds stay as they are;
keep each finding, once fixed, as fuzz/corpus/amqp/regress-<what>.

The first byte picks the target (its low two bits): 0 the codec, 1 a message's sections
(and a batch), 2 a frame header and body, 3 the engine after a valid handshake (the rest is
fed in pieces whose sizes come from the second byte). tests/security/test_fuzz_amqp.py runs
it bounded in `make test`, on a copy of the seed corpus.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    import atheris

    with atheris.instrument_imports(include=["sbamqp"]):
        from sbamqp import codec, engine, frames, sections
else:
    from sbamqp import codec, engine, frames, sections

from sbamqp.performatives import Accepted, Attach, Begin, Open, SaslInit, Source, Target

HANDSHAKE = (
    frames.SASL_HEADER
    + frames.encode_frame(0, SaslInit(mechanism="ANONYMOUS"), frame_type=frames.FRAME_SASL)
    + frames.AMQP_HEADER
    + frames.encode_frame(0, Open(container_id="fuzz", max_frame_size=4096))
    + frames.encode_frame(0, Begin(next_outgoing_id=0, incoming_window=100, outgoing_window=100))
    + frames.encode_frame(
        0, Attach(name="s", handle=0, role=False, source=Source(), target=Target(address="q"))
    )
)
LIMITS = engine.Limits(max_frame_size=65536, max_message_size=65536, incoming_window=16)


def check_codec(data: bytes) -> None:
    try:
        value, end = codec.decode(data)
    except codec.DecodeError:
        return
    assert 0 < end <= len(data)
    assert codec.skip(data) == end
    raw = codec.encode(value)
    again, _ = codec.decode(raw)
    assert codec.encode(again) == raw, (value, again)


def check_sections(data: bytes) -> None:
    try:
        parts = sections.split(data)
    except codec.DecodeError:
        return
    assert parts.to_bytes() == data
    for view in (
        parts.header_view,
        parts.properties_view,
        parts.annotations,
        parts.application_properties_items,
        parts.data,
    ):
        try:
            view()
        except codec.DecodeError:
            pass
    try:
        items = parts.application_properties_items()
    except codec.DecodeError:
        items = None
    if items is not None and parts.application_properties is not None:
        rebuilt = sections.encode_application_properties(items)
        again = sections.split(rebuilt).application_properties_items()
        # Compared as bytes: a NaN is not equal to itself.
        assert [(k, r) for k, r, _ in again] == [(k, r) for k, r, _ in items]
    try:
        sections.split_batch(data)
    except codec.DecodeError:
        pass


def check_frame(data: bytes) -> None:
    try:
        header = frames.parse_header(data, 0, 65536)
        if header is None or header.size > len(data):
            return
        frames.decode_body(data[header.body_offset : header.size], header.frame_type)
    except codec.DecodeError:
        return


def check_engine(data: bytes) -> None:
    conn = engine.ServerConnection(LIMITS, now=0.0)
    events = conn.receive_data(HANDSHAKE, now=0.0)
    link = events[-1].link  # type: ignore[attr-defined]
    conn.accept_attach(link, max_message_size=65536)
    conn.grant_credit(link, 5)
    step = (data[0] % 64 + 1) if data else 1
    body = data[1:]
    for i in range(0, len(body), step):
        for event in conn.receive_data(body[i : i + step], now=float(i)):
            if isinstance(event, engine.Transfer) and not event.settled:
                conn.settle(event.link, event.delivery_id, Accepted())
            elif isinstance(event, engine.LinkAttached):
                conn.accept_attach(event.link)
        conn.data_to_send()
    conn.tick(1e9)
    conn.data_to_send()


TARGETS = (check_codec, check_sections, check_frame, check_engine)


def one_input(data: bytes) -> None:
    """Run one fuzzer input through the target its first byte picks."""
    if not data:
        return
    TARGETS[data[0] & 3](data[1:])


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
