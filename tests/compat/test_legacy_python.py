"""The legacy Python REST client (azure-servicebus 0.21 / 0.50 control_client,
`ServiceBusService`), as docs/compat.md describes it: its exact requests through the gateway
to the local broker, received with the real SDK."""

from __future__ import annotations

import datetime as dt

import pytest

from sblocal.testing import BrokerProcess
from tests.compat.clients import PYTHON_ATOM, Message, legacy_python, legacy_python_batch
from tests.compat.conftest import (
    CAPTURED,
    HOST,
    KEY,
    KEY_NAME,
    CompatGateway,
    app_properties,
    body_of,
    expiry,
    received,
)

CLIENT = dict(host=HOST, key_name=KEY_NAME, key=KEY)
PROPS = {"origin": "py", "n": 7, "f": 1.5, "b": True}


def test_the_builders_reproduce_the_captured_requests_byte_for_byte():
    """Requests written by the real azure-servicebus 0.21.1 (docs/compat.md: how captured)."""
    captured = [c["request"].encode("latin-1") for c in CAPTURED if c["client"].startswith("py")]
    built = [
        legacy_python(
            "orders",
            Message("hello", {"MessageId": "py-1", "Label": "L", "TimeToLive": 60}, PROPS),
            expiry=1795523784,
            **CLIENT,
        ),
        legacy_python_batch(
            "orders",
            [
                Message("one", {"MessageId": "py-b1", "TimeToLive": 60}, {"k": 1}),
                Message("two", {"MessageId": "py-b2"}),
            ],
            expiry=1795523784,
            **CLIENT,
        ),
        legacy_python(
            "events", Message("topic from py", {"MessageId": "py-t1"}), expiry=1795523784, **CLIENT
        ),
    ]
    assert [b.raw() for b in built] == captured


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_a_single_message_with_its_properties(
    compat: CompatGateway, broker: BrokerProcess, entity: str
):
    request = legacy_python(
        entity,
        Message("hello <b>", {"MessageId": "py-1", "Label": "L", "TimeToLive": 60}, PROPS),
        expiry=expiry(),
        **CLIENT,
    )
    # What this client sends: the default port written out in sr, /messages signed with it.
    assert "%3a443%2f" + entity + "%2fmessages&" in (request.header("Authorization") or "") + "&"
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    assert answer.body["messageIds"] == ["py-1"] and answer.headers["x-request-id"]
    m = (await received(broker, entity))["py-1"]
    assert body_of(m) == b"hello <b>"  # the body untouched
    assert m.content_type == PYTHON_ATOM  # the content type as sent
    assert m.subject == "L" and m.time_to_live == dt.timedelta(seconds=60)  # "60": a number
    assert app_properties(m) == {"origin": "py", "n": 7, "f": 1.5, "b": True}


async def test_a_batch_with_string_properties(compat: CompatGateway, broker: BrokerProcess):
    request = legacy_python_batch(
        "orders",
        [
            Message("one", {"MessageId": "py-b1", "TimeToLive": 60, "Label": "x"}, {"k": 1}),
            Message("two", {"MessageId": "py-b2"}),
        ],
        expiry=expiry(),
        **CLIENT,
    )
    assert b'"UserProperties": {"k": "1"}' in request.body
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    got = await received(broker, "orders", count=2)
    assert body_of(got["py-b1"]) == b"one" and body_of(got["py-b2"]) == b"two"
    assert got["py-b1"].time_to_live == dt.timedelta(seconds=60) and got["py-b1"].subject == "x"
    # A JSON string stays a string, as Service Bus types batch UserProperties by JSON type.
    assert app_properties(got["py-b1"]) == {"k": "1"}
    assert not got["py-b2"].application_properties and got["py-b2"].content_type is None


async def test_a_topic_message(compat: CompatGateway, broker: BrokerProcess):
    when = dt.datetime(2031, 5, 4, 3, 2, 1)
    request = legacy_python(
        "events",
        Message("t", {"MessageId": "py-t1", "CorrelationId": "c-1"}, {"when": when, "q": 'a"b'}),
        expiry=expiry(),
        **CLIENT,
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    m = (await received(broker, "events"))["py-t1"]
    assert body_of(m) == b"t" and m.correlation_id == "c-1"
    # Dates and strings arrive quoted; the gateway stores them as the strings they are.
    assert app_properties(m) == {"when": "Sun, 04 May 2031 03:02:01 GMT", "q": 'a\\"b'}


async def test_the_captured_requests_are_accepted_as_sent(
    replay: CompatGateway, broker: BrokerProcess
):
    await replay.replay_captured("py")
    got = await received(broker, "orders", count=3)
    assert set(got) == {"py-1", "py-b1", "py-b2"}
    assert (await received(broker, "events"))["py-t1"].content_type == PYTHON_ATOM
