"""The Service Bus REST format parser (pure logic)."""

from __future__ import annotations

import base64
import datetime as dt

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import PayloadTooLarge, RequestError
from gateway.web import rest


def single(headers=(), props=None, body=b"x", ct="text/plain", key=None):
    return rest.parse_single(body, ct, list(headers), props, key)


def test_every_broker_property_maps():
    props = orjson.dumps(
        {
            "MessageId": "m-1",
            "CorrelationId": "c-1",
            "SessionId": "s-1",
            "Label": "lbl",
            "ReplyTo": "rt",
            "ReplyToSessionId": "rts",
            "To": "to-x",
            "TimeToLive": 90.5,
            "ScheduledEnqueueTimeUtc": "Sun, 06 Nov 2033 08:49:37 GMT",
            "PartitionKey": "s-1",
            "SequenceNumber": 7,  # read-only in Service Bus: ignored, as the service does
        }
    ).decode()
    m = single(props=props)
    assert (m.message_id, m.correlation_id, m.session_id, m.subject) == ("m-1", "c-1", "s-1", "lbl")
    assert (m.reply_to, m.reply_to_session_id, m.to, m.partition_key) == (
        "rt",
        "rts",
        "to-x",
        "s-1",
    )
    assert m.time_to_live == dt.timedelta(seconds=90.5)
    assert m.scheduled_enqueue_time_utc == dt.datetime(2033, 11, 6, 8, 49, 37, tzinfo=dt.UTC)
    assert m.content_type == "text/plain"


def test_custom_headers_become_typed_properties_and_standard_ones_do_not():
    m = single(
        headers=[
            ("Priority", '"High"'),
            ("Count", "12"),
            ("Ratio", "0.5"),
            ("Flag", "true"),
            ("Plain", "just text"),
            ("Authorization", "SharedAccessSignature sr=x"),
            ("Host", "h"),
            ("Connection", "keep-alive"),
            ("Content-Type", "text/plain"),
            ("BrokerProperties", "{}"),
            ("Idempotency-Key", "k"),
            ("X-Forwarded-For", "1.2.3.4"),
            ("Sec-Fetch-Mode", "cors"),
        ]
    )
    assert m.application_properties == {
        "Priority": "High",
        "Count": 12,
        "Ratio": 0.5,
        "Flag": True,
        "Plain": "just text",
    }


def test_message_id_defaults_idempotency_key_then_uuid():
    assert single(key="order-77").message_id == "order-77"
    assert single(props='{"MessageId": "explicit"}', key="k").message_id == "explicit"
    generated = single().message_id
    assert len(generated) == 32 and generated != single().message_id


@pytest.mark.parametrize("ttl", [1e-7, "0.0000004", 0.0004, 0.001])
def test_a_ttl_under_a_millisecond_is_a_millisecond_never_none(ttl: float | str) -> None:
    # Found by the fuzz test: 1e-7 s became timedelta(0), a falsy TTL ("none" to any
    # `if m.time_to_live`) on a message the client gave a TTL. The broker counts in
    # milliseconds, and the wire already sent at least one.
    m = single(props=orjson.dumps({"TimeToLive": ttl}).decode())
    assert m.time_to_live == dt.timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("props", "fragment"),
    [
        ("{bad", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"TimeToLive": "ten"}', "TimeToLive"),
        ('{"TimeToLive": -1}', "TimeToLive"),
        ('{"TimeToLive": 0}', "TimeToLive"),
        ('{"TimeToLive": 1e300}', "TimeToLive"),
        ('{"TimeToLive": true}', "TimeToLive"),
        ('{"ScheduledEnqueueTimeUtc": "tomorrow"}', "RFC 1123"),
        ('{"ScheduledEnqueueTimeUtc": 5}', "RFC 1123"),
        ('{"ScheduledEnqueueTimeUtc": "Sun, 06 Nov 1994 08:49:37"}', "RFC 1123"),
        ('{"MessageId": 5}', "MessageId must be a string"),
        ('{"MessageId": "' + "x" * 129 + '"}', "longer than 128"),
        ('{"SessionId": "a", "PartitionKey": "b"}', "PartitionKey must equal SessionId"),
    ],
)
def test_bad_broker_properties_are_400_with_a_clear_message(props, fragment):
    with pytest.raises(RequestError) as info:
        single(props=props)
    assert info.value.status == 400
    assert fragment in info.value.message


def test_batch_with_base64_user_properties_and_idempotency():
    raw = orjson.dumps(
        [
            {"Body": "hello", "BrokerProperties": {"Label": "a"}, "UserProperties": {"n": 1}},
            {"Body": base64.b64encode(b"\x00\x01").decode(), "IsBodyBase64": True},
        ]
    )
    msgs = rest.parse_batch(raw, "batch-9", max_messages=10)
    assert [m.body for m in msgs] == [b"hello", b"\x00\x01"]
    assert [m.message_id for m in msgs] == ["batch-9:0", "batch-9:1"]
    assert msgs[0].subject == "a" and msgs[0].application_properties == {"n": 1}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{}", "JSON array"),
        (b"[]", "at least one"),
        (b"[1]", "must be a JSON object"),
        (b'[{"Body": 5}]', "Body must be a string"),
        (b'[{"Body": "!!", "IsBodyBase64": true}]', "not valid base64"),
        (b'[{"Body": "a", "IsBodyBase64": "yes"}]', "IsBodyBase64"),
        (b'[{"Body": "a", "UserProperties": {"x": {"y": 1}}}]', "string, number or boolean"),
        (b'[{"Body": "a", "Extra": 1}]', "unknown field"),
        (
            b'[{"Body":"a","BrokerProperties":{"MessageId":"d"}},{"Body":"b","BrokerProperties":{"MessageId":"d"}}]',
            "repeats",
        ),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bad_batches_are_rejected_whole(raw, fragment):
    with pytest.raises(RequestError) as info:
        rest.parse_batch(raw, None, max_messages=10)
    assert fragment in info.value.message


def test_batch_length_limit_is_413():
    with pytest.raises(PayloadTooLarge):
        rest.parse_batch(orjson.dumps([{"Body": "a"}] * 11), None, max_messages=10)


def test_oversized_property_is_413():
    with pytest.raises(PayloadTooLarge):
        single(headers=[("Big", "x" * 40_000)])


# -- poison at the edge (issue 21) ----------------------------------------------------------

RESERVED = [
    "x-ms-path",
    "X-MS-Path",
    "x-ms-timetolive",
    "x-ms-sessionid",
    "X-Ms-ScheduledEnqueueTimeUtc",
    "x-ms-partitionkey",
    "x-ms-acceptedtimeutc",
    "x-ms-fencetoken",
]


@pytest.mark.parametrize("name", RESERVED)
def test_a_reserved_header_is_400_naming_it(name):
    # The backlog rewrite's own names: a client's value would be taken for the gateway's.
    with pytest.raises(RequestError) as info:
        single(headers=[(name, "999999999999999999")])
    assert info.value.status == 400 and name in info.value.message
    assert info.value.details["property"] == name


@pytest.mark.parametrize("name", RESERVED)
def test_a_reserved_user_property_in_a_batch_is_400_naming_it(name):
    raw = orjson.dumps([{"Body": "ok"}, {"Body": "bad", "UserProperties": {name: "elsewhere"}}])
    with pytest.raises(RequestError) as info:
        rest.parse_batch(raw, None, max_messages=10)
    assert info.value.status == 400 and f"batch[1].UserProperties.{name}" in info.value.message


def test_names_that_only_look_reserved_are_copied():
    m = single(headers=[("x-ms-pathology", '"a"'), ("x-ms-client", '"b"')])
    assert m.application_properties == {"x-ms-pathology": "a", "x-ms-client": "b"}


@pytest.mark.parametrize("ct", ["t\u00e9xt/plain", "text/\udcff"])
def test_a_content_type_that_is_not_ascii_is_400(ct):
    # ContentType is an AMQP symbol, ASCII only: Service Bus refuses anything else with
    # amqp:decode-error, which must never reach the broker (it is this message's fault).
    with pytest.raises(RequestError) as info:
        single(ct=ct)
    assert info.value.status == 400
    assert "ASCII" in info.value.message or "not valid UTF-8" in info.value.message


def test_a_batch_items_content_type_that_is_not_ascii_is_400():
    raw = orjson.dumps([{"Body": "a", "BrokerProperties": {"ContentType": "t\u00e9xt/plain"}}])
    with pytest.raises(RequestError) as info:
        rest.parse_batch(raw, None, max_messages=10)
    assert "ASCII" in info.value.message


def _peak_bytes(fn):
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    except RequestError as exc:
        error = exc
    else:
        error = None
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return error, peak


def test_a_batch_of_too_many_items_is_413_before_the_items_are_built():
    raw = b"[" + b"{}," * 349_000 + b"{}]"  # ~1 MiB: ~37 MB of dicts if it were parsed
    error, peak = _peak_bytes(lambda: rest.parse_batch(raw, None, max_messages=100))
    assert isinstance(error, PayloadTooLarge) and "at most 100" in error.message
    assert peak < 4 * len(raw), f"{peak} bytes allocated to refuse a {len(raw)}-byte body"


@pytest.mark.parametrize(
    "raw",
    [
        b'[{"Body": "a", "UserProperties": {"x": [' + b"{}," * 300_000 + b"{}]}}]",
        b'[{"Body": "a", "UserProperties": {"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}]",
        b"[" + b"[]," * 300_000 + b"[]]",
    ],
    ids=["wide-nested", "deep-nested", "arrays"],
)
def test_a_batch_nested_deeper_than_its_format_is_400_before_it_is_built(raw):
    error, peak = _peak_bytes(lambda: rest.parse_batch(raw, None, max_messages=100))
    assert error is not None and error.status == 400, error
    assert peak < 4 * len(raw), f"{peak} bytes allocated to refuse a {len(raw)}-byte body"


def test_strings_holding_brackets_and_commas_do_not_count_as_items():
    body = '{"a": [1, 2], "b": "\\"},{"}'
    items = [{"Body": body, "UserProperties": {"k": "[{,}]"}}] * 10
    msgs = rest.parse_batch(orjson.dumps(items), None, max_messages=10)
    assert len(msgs) == 10 and msgs[0].body == body.encode()


@pytest.mark.parametrize(
    "literal",
    [
        "9223372036854775808",  # 2^63
        "-9223372036854775809",  # -2^63 - 1
        "18446744073709551616",  # 2^64: orjson would read it as a float
        "-18446744073709551617",
        "123456789012345678901234567890",
    ],
)
def test_user_property_integers_outside_64_bits_are_refused(literal: str) -> None:
    raw = b'[{"Body": "a", "UserProperties": {"n": ' + literal.encode() + b"}}]"
    with pytest.raises(RequestError, match="64-bit"):
        rest.parse_batch(raw, None, max_messages=10)


@pytest.mark.parametrize(
    ("literal", "value"),
    [
        ("9223372036854775807", 2**63 - 1),
        ("-9223372036854775808", -(2**63)),
        ("1.8446744073709552e19", 1.8446744073709552e19),  # a float, written as one
        ("1e300", 1e300),
    ],
)
def test_user_property_numbers_within_range_are_kept_exactly(literal: str, value: object) -> None:
    body = b'"text with 123456789012345678901234 digits"'
    raw = b'[{"Body": ' + body + b', "UserProperties": {"n": ' + literal.encode() + b"}}]"
    (msg,) = rest.parse_batch(raw, None, max_messages=10)
    assert msg.application_properties["n"] == value
    assert type(msg.application_properties["n"]) is type(value)


_NAMES = st.one_of(
    st.sampled_from(sorted(rest.NEVER_COPIED | rest.RESERVED_PROPERTIES | {"origin", "n"})),
    st.sampled_from(["X-Forwarded-For", "x-b3-traceid", "Sec-Fetch-Mode", "Cf-Ray", "x-ms-x"]),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
).flatmap(lambda n: st.sampled_from([n, n.upper(), n.title(), n.swapcase()]))
_VALUES = st.sampled_from(['"quoted"', "7", "1.5", "true", "plain", "", '"'])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=8))
def test_the_raw_header_pass_keeps_what_parse_single_would(headers: list[tuple[str, str]]):
    """`copied_headers` drops on the bytes only what `parse_single` would drop: the message
    (or the refusal) is the same as from every header decoded."""
    raw = [
        (n.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
        for n, v in headers
    ]
    decoded = [
        (n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in raw
    ]

    def outcome(fields: list[tuple[str, str]]) -> object:
        try:
            m = rest.parse_single(b"x", "text/plain", fields, '{"MessageId": "m"}', None)
        except (RequestError, PayloadTooLarge) as exc:
            return type(exc), exc.message
        return m.application_properties, m.size

    assert outcome(rest.copied_headers(raw)) == outcome(decoded)
