"""The legacy Node.js REST client (npm azure-sb 0.11, `ServiceBusService`), as
docs/compat.md describes it: its exact requests through the gateway to the local broker,
received with the real SDK."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from sblocal.testing import BrokerProcess
from tests.compat.clients import Message, legacy_node
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
PROPS = {"origin": "node", "n": 7, "f": 1.5, "b": True}
BATCH = "application/vnd.microsoft.servicebus.json"


def _batch_body(items: list[dict[str, object]]) -> str:
    return json.dumps(items, separators=(",", ":"))  # JSON.stringify


def test_the_builders_reproduce_the_captured_requests_byte_for_byte():
    """Requests written by the real azure-sb 0.11.2 (docs/compat.md: how captured)."""
    captured = [c["request"].encode("latin-1") for c in CAPTURED if c["client"].startswith("node")]
    date = dt.datetime(2024, 1, 2, 3, 4, 5)
    built = [
        legacy_node("orders", "hello", expiry=1795523784, **CLIENT),
        legacy_node(
            "orders",
            Message(
                "with props",
                {"MessageId": "node-1", "Label": "L", "TimeToLive": 60},
                {**PROPS, "d": date},
            ),
            expiry=1795523784,
            **CLIENT,
        ),
        legacy_node("events", "topic hello", expiry=1795523784, **CLIENT),
        legacy_node(
            "orders",
            Message(
                _batch_body(
                    [
                        {
                            "Body": "one",
                            "BrokerProperties": {"MessageId": "node-b1", "TimeToLive": 60},
                            "UserProperties": {"k": 1},
                        },
                        {"Body": "two", "BrokerProperties": {"MessageId": "node-b2"}},
                    ]
                ),
                content_type=BATCH,
            ),
            expiry=1795523784,
            **CLIENT,
        ),
    ]
    assert [b.raw() for b in built] == captured


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_a_plain_string_message_with_an_empty_content_type(
    compat: CompatGateway, broker: BrokerProcess, entity: str
):
    request = legacy_node(entity, "hello", expiry=expiry(), **CLIENT)
    # What this client sends: /Messages with a query, both signed into sr; Host without port.
    assert request.target == f"/{entity}/Messages?api-version=2016-07"
    assert request.header("content-type") == "" and request.header("host") == HOST
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    [mid] = answer.body["messageIds"]
    m = (await received(broker, entity))[mid]
    assert body_of(m) == b"hello"
    assert m.content_type is None  # an empty Content-Type names no content type


async def test_a_message_with_broker_and_custom_properties(
    compat: CompatGateway, broker: BrokerProcess
):
    request = legacy_node(
        "orders",
        Message("with props", {"MessageId": "node-1", "Label": "L", "TimeToLive": 60}, PROPS),
        expiry=expiry(),
        **CLIENT,
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    m = (await received(broker, "orders"))["node-1"]
    assert body_of(m) == b"with props" and m.content_type == "text/plain"
    assert m.subject == "L" and m.time_to_live == dt.timedelta(seconds=60)
    assert app_properties(m) == {"origin": "node", "n": 7, "f": 1.5, "b": True}


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_a_batch_through_the_content_type(
    compat: CompatGateway, broker: BrokerProcess, entity: str
):
    body = _batch_body(
        [
            {"Body": "one", "BrokerProperties": {"MessageId": "nb-1"}, "UserProperties": {"k": 1}},
            {"Body": "two", "BrokerProperties": {"MessageId": "nb-2", "TimeToLive": 30}},
        ]
    )
    request = legacy_node(entity, Message(body, content_type=BATCH), expiry=expiry(), **CLIENT)
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    got = await received(broker, entity, count=2)
    assert body_of(got["nb-1"]) == b"one" and app_properties(got["nb-1"]) == {"k": 1}
    assert got["nb-2"].time_to_live == dt.timedelta(seconds=30)


async def test_the_captured_requests_are_accepted_as_sent(
    replay: CompatGateway, broker: BrokerProcess
):
    await replay.replay_captured("node")
    got = await received(broker, "orders", count=4)
    assert {"node-1", "node-b1", "node-b2"} <= set(got)
    with_props = got["node-1"]
    assert app_properties(with_props) == {**PROPS, "d": "Tue, 02 Jan 2024 03:04:05 GMT+0000"}
    [topic] = (await received(broker, "events")).values()
    assert body_of(topic) == b"topic hello"
