"""SAS authorization at the HTTP edge, against the real broker."""

from __future__ import annotations

import logging
import time

import orjson
import pytest

from gateway.auth import mint_token, resource_uri
from gateway.logs import ACCESS_LOGGER
from tests.conftest import GatewayFactory
from tests.support.waiting import eventually

SEND_KEY = "c2VuZGVyLWtleS1mb3ItdGVzdHMtb25seS0wMDAwMDAwMDA="
ADMIN_KEY = "YWRtaW4ta2V5LWZvci10ZXN0cy1vbmx5LTAwMDAwMDAwMDA="
RULES = orjson.dumps(
    {
        "rules": [
            {"name": "sender", "primary_key": SEND_KEY, "rights": ["Send"], "entities": ["orders"]},
            {"name": "admin", "primary_key": ADMIN_KEY, "rights": ["Manage"], "entities": ["*"]},
        ]
    }
).decode()
ENV = {"SBGATE_AUTH_RULES": RULES, "SBGATE_PUBLIC_HOSTS": "gw.example.com"}


def token(
    entity: str | None,
    name: str = "sender",
    key: str = SEND_KEY,
    ttl: float = 600,
    now: float | None = None,
) -> str:
    return mint_token(resource_uri("gw.example.com", entity), name, key, ttl, now=now)


@pytest.fixture
async def gw(gateway: GatewayFactory):
    return await gateway(ENV)


async def test_a_valid_send_token_is_accepted(gw, control):
    resp = await gw.post("/orders/messages", data=b"x", headers={"Authorization": token("orders")})
    assert resp.status == 201
    assert (await control.entity("primary", "orders"))["active"] == 1


@pytest.mark.parametrize(
    ("headers", "path", "status", "code"),
    [
        ({}, "/orders/messages", 401, "missing_token"),
        ({"Authorization": "Bearer abc"}, "/orders/messages", 401, "malformed_token"),
        (
            {"Authorization": token("orders", key=ADMIN_KEY)},
            "/orders/messages",
            401,
            "invalid_signature",
        ),
        (
            {"Authorization": token("orders", ttl=60, now=time.time() - 3600)},
            "/orders/messages",
            401,
            "token_expired",
        ),
        ({"Authorization": token("events")}, "/topics/events/messages", 403, "entity_not_allowed"),
        ({"Authorization": token("orders")}, "/topics/events/messages", 401, "resource_mismatch"),
        ({"Authorization": token("nope")}, "/queues/nope/messages", 403, "entity_not_allowed"),
    ],
)
async def test_unauthorized_and_forbidden_send_nothing(gw, control, headers, path, status, code):
    resp = await gw.post(path, data=b"x", headers=headers)
    body = await resp.json()
    assert resp.status == status and body["error"] == code, body
    if status == 401:
        assert resp.headers["WWW-Authenticate"] == "SharedAccessSignature"
    assert (await control.counters("primary")).get("sends", 0) == 0


async def test_unknown_entity_is_not_revealed_before_authorization(gw):
    resp = await gw.post("/queues/secret-queue/messages", data=b"x")
    assert resp.status == 401


async def test_admin_needs_manage(gw):
    resp = await gw.get("/admin/entities", headers={"Authorization": token(None)})
    assert resp.status == 403 and (await resp.json())["error"] == "missing_right"
    assert resp.headers["X-Request-Id"]
    resp = await gw.get(
        "/admin/entities", headers={"Authorization": token(None, "admin", ADMIN_KEY)}
    )
    assert resp.status == 200


async def test_refusals_answer_alike_on_every_route(gw):
    """Auth failures are request errors like any other: the same JSON body, X-Request-Id, and
    the SAS challenge on a 401 only, whether the message route or the admin API refuses."""
    for path, method, status in (
        ("/queues/orders/messages", "POST", 401),
        ("/admin/entities", "GET", 401),
        ("/admin/entities/orders/healthy", "POST", 401),
    ):
        resp = await gw.request(method, path, headers={"X-Request-Id": "rid-1"})
        body = await resp.json()
        assert resp.status == status and set(body) == {"error", "message"}, body
        assert body["error"] == "missing_token"
        assert resp.headers["WWW-Authenticate"] == "SharedAccessSignature"
        assert resp.headers["X-Request-Id"] == "rid-1"
        assert "Retry-After" not in resp.headers
    resp = await gw.get("/admin/entities", headers={"Authorization": token(None)})
    assert resp.status == 403 and "WWW-Authenticate" not in resp.headers


async def test_probes_and_metrics_stay_open(gw):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await gw.get(path)).status == 200


async def test_max_token_lifetime_refuses_far_expiries_and_accepts_short_ones(
    gateway: GatewayFactory, control
):
    gw = await gateway({**ENV, "SBGATE_AUTH_MAX_TOKEN_LIFETIME": "3600"})
    year = token("orders", ttl=365 * 86400)
    resp = await gw.post("/orders/messages", data=b"x", headers={"Authorization": year})
    assert resp.status == 401 and (await resp.json())["error"] == "token_lifetime_too_long"
    assert (await control.counters("primary")).get("sends", 0) == 0
    hour = token("orders", ttl=1800)
    resp = await gw.post("/orders/messages", data=b"y", headers={"Authorization": hour})
    assert resp.status == 201


async def test_a_reused_token_is_still_checked_against_each_entity(gw, control):
    # The verified-token cache answers the second use of a token; access is checked each time.
    root = token(None)  # the namespace root: the signature is good for any entity
    for path, status in [
        ("/queues/orders/messages", 201),
        ("/queues/orders/messages", 201),
        ("/topics/events/messages", 403),
        ("/queues/orders/messages", 201),
    ]:
        resp = await gw.post(path, data=b"x", headers={"Authorization": root})
        assert resp.status == status, await resp.text()
    narrow = token("orders")
    assert (
        await gw.post("/orders/messages", data=b"x", headers={"Authorization": narrow})
    ).status == 201
    resp = await gw.post("/topics/events/messages", data=b"x", headers={"Authorization": narrow})
    assert (resp.status, (await resp.json())["error"]) == (401, "resource_mismatch")
    tampered = narrow.replace("se=", "se=9")
    resp = await gw.post("/orders/messages", data=b"x", headers={"Authorization": tampered})
    assert resp.status == 401
    assert (await control.entity("primary", "orders"))["active"] == 4


async def test_no_answer_tells_which_key_names_exist(gw):
    """An unknown skn and a wrong key get the same answer; a 403 does not name the rule."""
    answers = []
    for name in ("sender", "no-such-rule"):
        wrong = mint_token(resource_uri("gw.example.com", "orders"), name, ADMIN_KEY, 600)
        resp = await gw.post("/orders/messages", data=b"x", headers={"Authorization": wrong})
        answers.append((resp.status, await resp.json(), resp.headers["WWW-Authenticate"]))
    assert answers[0] == answers[1]
    assert answers[0][1]["error"] == "invalid_signature"
    resp = await gw.post(
        "/topics/events/messages", data=b"x", headers={"Authorization": token("events")}
    )
    body = await resp.json()
    assert resp.status == 403 and "sender" not in body["message"], body


async def test_the_access_line_names_the_rule_the_answer_does_not(
    gateway: GatewayFactory, capsys, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    gw = await gateway({**ENV, "SBGATE_LOG_FORMAT": "json"})
    wrong = mint_token(resource_uri("gw.example.com", "orders"), "sender", ADMIN_KEY, 600)
    resp = await gw.post("/orders/messages", data=b"x", headers={"Authorization": wrong})
    assert resp.status == 401 and "sender" not in await resp.text()
    err: list[str] = []

    def logged() -> bool:
        err.append(capsys.readouterr().err)
        return any('"key_name":"sender"' in line for line in "".join(err).splitlines())

    await eventually(logged, what="the access line with key_name")
