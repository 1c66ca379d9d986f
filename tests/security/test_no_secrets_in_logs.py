"""Keys, signatures and connection strings never reach the logs, whatever clients send."""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import unquote

import orjson
from azure.servicebus import parse_connection_string

from gateway.auth import mint_token, resource_uri
from gateway.logs import JsonFormatter
from sblocal.testing import BrokerProcess
from tests.conftest import GatewayFactory
from tests.support.processes import broker_env

SEND_KEY = "bm8tc2VjcmV0cy1pbi1sb2dzLXNlbmQta2V5LTAwMDAwMDA="
ADMIN_KEY = "bm8tc2VjcmV0cy1pbi1sb2dzLWFkbWluLWtleS0wMDAwMDA="
RULES = {
    "rules": [
        {"name": "sender", "primary_key": SEND_KEY, "rights": ["Send"], "entities": ["orders"]},
        {"name": "admin", "primary_key": ADMIN_KEY, "rights": ["Manage"], "entities": ["*"]},
    ]
}


def sig_of(token: str) -> str:
    return unquote(re.search(r"sig=([^&]+)", token).group(1))  # type: ignore[union-attr]


async def test_no_key_signature_or_connection_string_is_logged(
    gateway: GatewayFactory, broker: BrokerProcess, control, caplog, capsys
):
    # Production caps the SDK's loggers at WARNING (gateway.logs.setup_logging); ours at DEBUG.
    for noisy in ("azure", "uamqp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    caplog.set_level(logging.DEBUG)
    gw = await gateway(
        {
            "SBGATE_AUTH_RULES": orjson.dumps(RULES).decode(),
            "SBGATE_PUBLIC_HOSTS": "gw.test",
            "SBGATE_SDK_RETRY_TOTAL": "0",
            "SBGATE_LOG_FORMAT": "json",  # every field of the access lines
        }
    )
    good = mint_token(resource_uri("gw.test", "orders"), "sender", SEND_KEY, 600)
    admin = mint_token(resource_uri("gw.test", None), "admin", ADMIN_KEY, 600)
    expired = mint_token(
        resource_uri("gw.test", "orders"), "sender", SEND_KEY, 60, now=time.time() - 3600
    )
    wrong_key = mint_token(resource_uri("gw.test", "orders"), "sender", ADMIN_KEY, 600)
    other = mint_token(resource_uri("gw.test", "events"), "sender", SEND_KEY, 600)
    tampered = good.replace("se=", "se=1")
    for token in (good, expired, wrong_key, other, tampered, good + "&x=1", "Bearer " + SEND_KEY):
        for path in ("/queues/orders/messages", "/topics/events/messages", "/nope/messages"):
            await gw.post(path, data=b"x", headers={"Authorization": token})
    await gw.get("/admin/entities", headers={"Authorization": admin})
    await gw.get("/admin/entities", headers={"Authorization": good})
    await control.add_fault(
        "primary", "amqp:unauthorized-access", operation="send", entity="orders"
    )
    resp = await gw.post("/queues/orders/messages", data=b"x", headers={"Authorization": good})
    assert resp.status == 503  # a broker failure, logged with its SDK message

    secrets = {SEND_KEY, ADMIN_KEY}
    secrets |= {sig_of(t) for t in (good, admin, expired, wrong_key, other)}
    for ns in ("primary", "secondary"):
        parts = parse_connection_string(
            broker_env(broker)[f"SBGATE_{ns.upper()}_CONNECTION_STRING"]
        )
        secrets |= {parts.shared_access_key or "", parts.shared_access_signature or ""}
    formatter = JsonFormatter()
    await gw.close()  # the access log is flushed last at shutdown
    access = capsys.readouterr().err  # the access lines bypass `logging` (gateway.logs)
    text = "\n".join(formatter.format(r) for r in caplog.records) + "\n" + access
    assert access.count('"logger":"gateway.requests"') >= 20, "the requests were not logged"
    leaked = sorted(s for s in secrets if s and s in text)
    assert not leaked, f"secrets in the logs: {[s[:6] + '...' for s in leaked]}"
