"""The Service Bus REST API reference's own examples ("Send Message", "Send Message Batch"),
sent as curl sends them, signed as its "Generate SAS token" sample signs
(sr = https://<namespace>/<entity>)."""

from __future__ import annotations

import datetime as dt

import pytest

from sblocal.testing import BrokerProcess
from tests.compat.clients import rest_reference
from tests.compat.conftest import (
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
ATOM = "application/atom+xml;type=entry;charset=utf-8"


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_the_send_message_example(compat: CompatGateway, broker: BrokerProcess, entity: str):
    request = rest_reference(
        entity,
        b"This is a message.",
        [
            ("BrokerProperties", '{"Label":"M1","State":"Active","TimeToLive":10}'),
            ("Priority", "High"),
            ("Customer", "12345,ABC"),
            ("Content-Type", ATOM),
        ],
        expiry=expiry(),
        **CLIENT,
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    [mid] = answer.body["messageIds"]
    m = (await received(broker, entity))[mid]
    assert body_of(m) == b"This is a message." and m.content_type == ATOM
    assert m.subject == "M1" and m.time_to_live == dt.timedelta(seconds=10)  # State: ignored
    assert app_properties(m) == {"Priority": "High", "Customer": "12345,ABC"}


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_the_send_message_batch_example(
    compat: CompatGateway, broker: BrokerProcess, entity: str
):
    body = (
        b'[{"Body":"This is the first message","UserProperties":{"Color":"Red"}},'
        b'{"Body":"This is the second message","UserProperties":{"Color":"Green"}},'
        b'{"Body":"This is the third message","UserProperties":{"Color":"Blue"}}]'
    )
    request = rest_reference(
        entity,
        body,
        [("Content-Type", "application/vnd.microsoft.servicebus.json")],
        expiry=expiry(),
        **CLIENT,
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    got = await received(broker, entity, count=3)
    colors = {body_of(m): app_properties(m)["Color"] for m in got.values()}
    assert colors == {
        b"This is the first message": "Red",
        b"This is the second message": "Green",
        b"This is the third message": "Blue",
    }
