"""The token forms today's SDKs mint (azure-servicebus 7's own helper: sr = the sb:// resource
URI of the entity or the namespace), on plain REST requests."""

from __future__ import annotations

import orjson
import pytest

from sblocal.testing import BrokerProcess
from tests.compat.clients import HttpRequest, sdk_token
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


def _request(entity: str, token: str, body: bytes, *headers: tuple[str, str]) -> HttpRequest:
    fields = [("Host", HOST), ("Authorization", token), *headers]
    fields.append(("Content-Length", str(len(body))))
    return HttpRequest("POST", f"/{entity}/messages", tuple(fields), body)


@pytest.mark.parametrize(
    "resource",
    [f"sb://{HOST}/{{entity}}", f"sb://{HOST}/", f"sb://{HOST.upper()}/{{entity}}"],
)
@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_a_single_message(
    compat: CompatGateway, broker: BrokerProcess, resource: str, entity: str
):
    token = sdk_token(resource.format(entity=entity), KEY_NAME, KEY, expiry())
    props = orjson.dumps({"MessageId": "sdk-1", "SessionId": None, "To": "x"}).decode()
    request = _request(
        entity,
        token,
        b"\x00\x01bin",
        ("Content-Type", "application/octet-stream"),
        ("BrokerProperties", props),
        ("tenant", '"acme"'),
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    m = (await received(broker, entity))["sdk-1"]
    assert body_of(m) == b"\x00\x01bin" and m.content_type == "application/octet-stream"
    assert m.to == "x" and app_properties(m) == {"tenant": "acme"}


@pytest.mark.parametrize("entity", ["orders", "events"])
async def test_a_batch(compat: CompatGateway, broker: BrokerProcess, entity: str):
    token = sdk_token(f"sb://{HOST}/{entity}", KEY_NAME, KEY, expiry())
    body = orjson.dumps(
        [
            {"Body": "a", "BrokerProperties": {"MessageId": "s-1"}, "UserProperties": {"n": 1}},
            {"Body": "b", "BrokerProperties": {"MessageId": "s-2", "TimeToLive": "5.5"}},
        ]
    )
    request = _request(
        entity, token, body, ("Content-Type", "application/vnd.microsoft.servicebus.json")
    )
    answer = await compat.send(request)
    assert answer.status == 201, answer.body
    got = await received(broker, entity, count=2)
    assert body_of(got["s-1"]) == b"a" and app_properties(got["s-1"]) == {"n": 1}
    assert got["s-2"].time_to_live is not None and got["s-2"].time_to_live.total_seconds() == 5.5


async def test_a_token_for_one_entity_does_not_send_to_another(compat: CompatGateway, control):
    token = sdk_token(f"sb://{HOST}/orders", KEY_NAME, KEY, expiry())
    answer = await compat.send(_request("events", token, b"x"))
    assert answer.status == 401 and answer.body["error"] == "resource_mismatch"
    assert (await control.counters("primary")).get("sends", 0) == 0
