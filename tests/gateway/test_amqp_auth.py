"""`$cbs` grants on the gateway's `Authorizer` (gateway.amqp.auth): the audience as presented,
401 for every refusal, expiry checked on every transfer, a refresh on the same link."""

from __future__ import annotations

import pytest

from gateway.amqp.auth import Grants
from gateway.auth import Authorizer, Forbidden, Unauthorized, mint_token, rules_from_json
from tests.gateway.test_amqp_sdk import OTHER_KEY, RULES, SEND_KEY

pytestmark = pytest.mark.unit

HOST = "sb://localhost:5672"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def grants(clock: Clock) -> Grants:
    authorizer = Authorizer(rules_from_json(RULES), ["localhost"], clock=clock, clock_skew=0)
    return Grants(authorizer)


def token(
    path: str, *, ttl: float = 3600, now: float, key_name: str = "sender", key: str = SEND_KEY
) -> str:
    return mint_token(f"{HOST}/{path}", key_name, key, ttl, now=now)


def test_a_granted_token_sends_until_it_expires_and_a_refresh_renews_it() -> None:
    clock = Clock()
    g = grants(clock)
    put = g.put_token(f"{HOST}/orders", token("orders", ttl=60, now=clock.now))
    assert (put.status, put.key_name) == (200, "sender")
    assert g.authorize_send("orders") == "sender"
    clock.now += 61
    with pytest.raises(Unauthorized, match="expired"):
        g.authorize_send("orders")
    assert g.put_token(f"{HOST}/orders", token("orders", now=clock.now)).status == 200
    assert g.authorize_send("orders") == "sender"


def test_the_audience_is_checked_as_presented() -> None:
    clock = Clock()
    g = grants(clock)
    management = f"{HOST}/orders/$management"
    assert g.put_token(management, token("orders/$management", now=clock.now)).status == 200
    # A token for orders/$management does not send to orders.
    with pytest.raises(Unauthorized):
        g.authorize_send("orders")
    refused = g.put_token(f"{HOST}/orders", token("events", now=clock.now))
    assert refused.status == 401 and "resource_mismatch" in refused.description


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJ4In0.c2ln", "only SAS tokens"),
        (None, "string"),
    ],
)
def test_what_is_not_a_sas_token_is_refused_401(body: object, reason: str) -> None:
    answer = grants(Clock()).put_token(f"{HOST}/orders", body)
    assert answer.status in (400, 401) and reason in answer.description


def test_a_wrong_key_is_401_never_403() -> None:
    clock = Clock()
    answer = grants(clock).put_token(
        f"{HOST}/orders", token("orders", now=clock.now, key=OTHER_KEY)
    )
    assert answer.status == 401 and "invalid_signature" in answer.description


def test_a_rule_without_send_on_the_entity_refuses_each_transfer() -> None:
    clock = Clock()
    g = grants(clock)
    t = token("events", now=clock.now, key_name="orders-only", key=OTHER_KEY)
    assert g.put_token(f"{HOST}/events", t).status == 200
    with pytest.raises(Forbidden):
        g.authorize_send("events")


def test_without_a_token_nothing_is_sent() -> None:
    with pytest.raises(Unauthorized, match="no token"):
        grants(Clock()).authorize_send("orders")


def test_open_mode_grants_everything() -> None:
    g = Grants(None)
    assert g.put_token(f"{HOST}/orders", "anything").status == 200
    assert g.authorize_send("orders") is None
