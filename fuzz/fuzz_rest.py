"""atheris fuzz target: the Service Bus REST parser (`gateway.web.rest`).

Any exception other than a `gateway.errors.RequestError` (400/413/415 with a clear message)
is a bug: the HTTP edge would answer 500. Accepted messages must also keep the promises the
rest of the gateway and Service Bus rely on (see `check_messages`).

    mkdir -p .fuzz && python fuzz/fuzz_rest.py -max_total_time=600 -dict=fuzz/rest.dict \
        -artifact_prefix=.fuzz/ .fuzz fuzz/corpus/rest      # on demand (make fuzz)
    python fuzz/fuzz_rest.py -runs=0 .fuzz/crash-<sha1>      # replay a finding

New inputs go to the first directory (.fuzz), so the committed seeds stay as they are; keep
each finding, once fixed, as fuzz/corpus/rest/regress-<what>.

tests/security/test_fuzz.py runs it bounded in `make test`, on a copy of the seed corpus.
The input is split as aiohttp would hand it over: header names and values decoded from
UTF-8 with surrogateescape (invalid bytes survive as lone surrogates), bodies as bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if __name__ == "__main__":
    import atheris

    # Coverage feedback from the parser and what it calls (instrument_all takes ~20 s).
    with atheris.instrument_imports(include=["gateway", "email", "base64", "binascii"]):
        from gateway.errors import RequestError
        from gateway.web import rest
else:
    from gateway.errors import RequestError
    from gateway.web import rest

if TYPE_CHECKING:
    from gateway.core.message import OutboundMessage

MAX_BATCH = 100
FIELD_SEP = b"\x00\x01"  # splits one input into its parts (the seed corpus uses it)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def check_messages(messages: Sequence[OutboundMessage]) -> None:
    """What an accepted request must satisfy (else the broker, the SDK or a log line fails)."""
    ids = set()
    for m in messages:
        assert isinstance(m.body, bytes)
        assert 0 < len(m.message_id) <= rest.MAX_ID_LENGTH, m.message_id
        for text in (
            m.message_id,
            m.content_type,
            m.correlation_id,
            m.session_id,
            m.subject,
            m.reply_to,
            m.reply_to_session_id,
            m.to,
            m.partition_key,
        ):
            if text is not None:
                text.encode("utf-8")  # strict: Service Bus strings are valid Unicode
        for value in (m.session_id, m.partition_key, m.reply_to_session_id):
            assert value is None or len(value) <= rest.MAX_ID_LENGTH
        if m.session_id is not None and m.partition_key is not None:
            assert m.session_id == m.partition_key
        if m.time_to_live is not None:
            assert m.time_to_live.total_seconds() > 0
        assert m.content_type is None or m.content_type.isascii()  # an AMQP symbol
        for key, value in m.application_properties.items():
            assert isinstance(key, str) and 0 < len(key) <= 256
            assert key.lower() not in rest.RESERVED_PROPERTIES, key  # the backlog's own
            key.encode("utf-8")
            if isinstance(value, str):
                value.encode("utf-8")
            if isinstance(value, int) and not isinstance(value, bool):
                assert -(2**63) <= value < 2**63
        assert m.size > 0  # the handler sizes every message right after parsing
        ids.add(m.message_id)
    assert len(ids) == len(messages)


def one_input(data: bytes) -> None:
    """Parse one fuzzer input as a single-message or a batch request."""
    if not data:
        return
    mode, parts = data[0], data[1:].split(FIELD_SEP)
    parts += [b""] * (5 - len(parts))
    key = _text(parts[1]) if parts[1] else None
    try:
        if mode & 1:
            messages = rest.parse_batch(parts[0], key, MAX_BATCH)
        else:
            headers = []
            for line in parts[4].split(b"\n"):
                name, sep, value = line.partition(b":")
                if sep and name:
                    headers.append((_text(name), _text(value)))
            messages = [
                rest.parse_single(
                    parts[0],
                    _text(parts[3]) if parts[3] else None,
                    headers,
                    _text(parts[2]) if parts[2] else None,
                    key,
                )
            ]
    except RequestError:
        return
    check_messages(messages)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
