"""Token coverage after normalisation: the forms the REST clients sign are accepted, and no
normalisation widens what a token covers (hosts, siblings, paths below, encoding tricks)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.auth import Authorizer, AuthRule, Right, Secret, Unauthorized, sign_token

KEY = "Y292ZXJhZ2Uta2V5LWZvci10ZXN0cy1vbmx5LTAwMDAwMDA="
HOST = "contoso.servicebus.windows.net"
NOW = 1_700_000_000
RULE = AuthRule(name="s", primary_key=Secret(KEY), rights=frozenset({Right.SEND}), entities=("*",))
AUTHORIZER = Authorizer([RULE], [HOST, "gw.example.com:8443"], clock=lambda: NOW)


def signed(sr_encoded: str) -> str:
    """A token whose sr is `sr_encoded` exactly as sent (signed over that form)."""
    import base64
    import hashlib
    import hmac

    expiry = NOW + 600
    digest = hmac.new(KEY.encode(), f"{sr_encoded}\n{expiry}".encode(), hashlib.sha256).digest()
    sig = quote(base64.b64encode(digest).decode(), safe="")
    return f"SharedAccessSignature sig={sig}&se={expiry}&skn=s&sr={sr_encoded}"


def legacy(url: str) -> str:
    """sr as both legacy clients encode it: the whole URL percent-encoded, lower-cased."""
    return quote(url, safe="").lower()


def covers(header: str, entity: str) -> bool:
    try:
        AUTHORIZER.authorize(header, entity_path=entity, right=Right.SEND)
    except Unauthorized as exc:
        assert exc.code in {"resource_mismatch", "invalid_audience", "malformed_token"}
        return False
    return True


@pytest.mark.parametrize(
    "url",
    [
        f"https://{HOST}:443/orders/messages",  # legacy Python
        f"https://{HOST}:443/orders/messages?api-version=2016-07",  # legacy Node.js
        f"https://{HOST}/orders/messages?api-version=2016-07",
        f"https://{HOST}/orders/Messages/Head?timeout=60",
        f"HTTPS://{HOST.upper()}/ORDERS",
        f"http://{HOST}:80/orders",
        f"sb://{HOST}/orders",
        f"sb://{HOST}/",
        f"https://{HOST}",
        "https://gw.example.com:8443/orders/messages",  # a host:port public host
        f"http://{HOST}:80/queues/orders/messages",  # the gateway's own routes (make run's banner)
        f"https://{HOST}/topics/orders/messages",
        f"https://{HOST}/Queues/Orders/Messages/Head",
    ],
)
def test_the_forms_clients_sign_cover_the_entity(url: str):
    assert covers(signed(legacy(url)), "orders")
    assert covers(sign_token(url.split("?")[0], "s", KEY, NOW + 600), "orders")


@pytest.mark.parametrize(
    ("url", "entity"),
    [
        (f"https://{HOST}/orders", "orders2"),
        (f"https://{HOST}/orders/messages", "orders/messagesx"),
        (f"https://{HOST}/orders/messages", "orders/sub"),
        (f"https://{HOST}/orders/messages", "orders2"),
        (f"https://{HOST}/orders/messages/head", "orders/headx"),
        (f"https://{HOST}/orders/messages/head", "orders/messages2"),
        (f"https://{HOST}:443/orders/messages", "events"),
        (f"https://{HOST}/orders/x/messages", "orders"),
        (f"https://{HOST}/messages", "orders"),
        (f"https://{HOST}.evil.com/orders", "orders"),
        (f"https://evil.{HOST}/orders", "orders"),
        (f"https://{HOST}@evil.com/orders", "orders"),
        ("https://gw.example.com/orders", "orders"),  # the public host is gw.example.com:8443
        (f"https://{HOST}/orders%2fmessages", "orders"),  # %2f inside a segment
        (f"https://{HOST}/orders%252fx", "orders/x"),  # double encoding
        (f"https://{HOST}/x/../orders", "orders"),  # dot segments
        (f"https://{HOST}/x/%2e%2e/orders", "orders"),
        (f"https://{HOST}/orders/messages#frag", "orders"),
        (f"https://{HOST}/orders?/../events", "events"),  # the query is never a path
        # /queues/<e>/messages and /topics/<e>/messages name <e> and nothing else
        (f"https://{HOST}/queues/orders/messages", "orders2"),
        (f"https://{HOST}/queues/orders/messages", "orders/sub"),
        (f"https://{HOST}/queues/orders/messages", "queues"),
        (f"https://{HOST}/queues/orders/messages", "events"),
        (f"https://{HOST}/queues/orders/messages", "x/orders"),
        (f"https://{HOST}/queues/messages", "orders"),  # no entity: never the root
        (f"https://{HOST}/queues/messages", "messages"),
        (f"https://{HOST}/queues/orders", "orders"),  # not the endpoint
        (f"https://{HOST}/topics/events/messages", "orders"),
        (f"https://{HOST}/x/queues/orders/messages", "orders"),
        (f"https://{HOST}/queuesx/orders/messages", "orders"),
    ],
)
def test_nothing_widens_coverage(url: str, entity: str):
    assert not covers(signed(legacy(url)), entity)
    assert not covers(signed(quote(url, safe="")), entity)  # upper-case hex


SEGMENTS = st.sampled_from(
    ["orders", "Orders", "messages", "Messages", "head", "o2", "x", "queues", "Topics"]
)


def _expected(sr_path: list[str], entity: list[str]) -> bool:
    """The rule, spelled out: the root covers all; a path covers itself and what is below it;
    a path ending /messages or /messages/head also covers exactly the entity before it, and
    when that path starts with queues/ or topics/ (the gateway's routes), the entity after it."""
    p, e = [s.lower() for s in sr_path], [s.lower() for s in entity]
    if not p or e[: len(p)] == p:
        return True
    before = None
    if len(p) > 1 and p[-1] == "messages":
        before = p[:-1]
    if len(p) > 2 and p[-2:] == ["messages", "head"]:
        before = p[:-2]
    if before is None:
        return False
    if len(before) > 1 and before[0] in ("queues", "topics") and e == before[1:]:
        return True
    return e == before


@settings(max_examples=400, deadline=None)
@given(
    sr_path=st.lists(SEGMENTS, max_size=4),
    entity=st.lists(SEGMENTS, min_size=1, max_size=4),
    port=st.sampled_from(["", ":443"]),
    query=st.sampled_from(["", "?api-version=2016-07", "?timeout=60&x=/orders"]),
    upper_hex=st.booleans(),
)
def test_coverage_is_exactly_the_rule_whatever_the_encoding(
    sr_path: list[str], entity: list[str], port: str, query: str, upper_hex: bool
):
    url = f"https://{HOST}{port}/" + "/".join(sr_path) + query
    encoded = quote(url, safe="") if upper_hex else legacy(url)
    assert covers(signed(encoded), "/".join(entity)) == _expected(sr_path, entity)
