"""One SAS verifier for both doors of the broker: a token must cover what it is used for.

A gateway that signed AMQP tokens for the wrong audience must fail here as on Azure, not
pass every local test (the management API always checked the audience; `$cbs` now does too).
"""

from __future__ import annotations

import time

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusAuthenticationError

from sblocal import sas
from sblocal.server import LocalBroker

from .conftest import FastClient

KEYS = {"k": "secret"}


def _token(resource: str, *, ttl: int = 3600) -> str:
    return sas.sign(resource, "k", "secret", int(time.time()) + ttl)


@pytest.mark.parametrize(
    ("resource", "audience", "ok"),
    [
        ("sb://ns.example/orders", "sb://localhost:5672/orders", True),
        ("sb://ns.example/", "sb://localhost:5672/orders", True),
        ("sb://ns.example/orders", "sb://localhost:5672/ORDERS/$DeadLetterQueue", True),
        ("sb://ns.example/orders", "sb://localhost:5672/payments", False),
        ("sb://ns.example/orders", "sb://localhost:5672/orders-2", False),
        ("sb://ns.example/orders/x", "sb://localhost:5672/orders", False),
    ],
)
def test_the_audience_must_be_covered_on_a_segment_boundary(
    resource: str, audience: str, ok: bool
) -> None:
    token = _token(resource)
    if ok:
        assert sas.verify(token, KEYS, audience=audience) == resource
    else:
        with pytest.raises(sas.SasError, match="InvalidAudience"):
            sas.verify(token, KEYS, audience=audience)


def test_the_raw_and_the_canonical_sr_spelling_both_verify() -> None:
    expiry = int(time.time()) + 60
    token = sas.sign("sb://ns.example/orders", "k", "secret", expiry)
    # The same token with sr written unencoded: the signature covers the canonical form.
    raw = token.replace("sr=sb%3A%2F%2Fns.example%2Forders", "sr=sb://ns.example/orders")
    assert raw != token
    assert sas.verify(raw, KEYS) == "sb://ns.example/orders"


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("Bearer abc", "InvalidToken"),
        ("SharedAccessSignature sr=x&sig=y&se=1", "InvalidToken"),
        ("SharedAccessSignature sr=x&sig=y&se=soon&skn=k", "InvalidToken"),
        (sas.sign("sb://x/", "k", "secret", 1), "ExpiredToken"),
        (_token("sb://x/").replace("skn=k", "skn=other"), "InvalidSignature"),
        (sas.sign("sb://x/", "k", "wrong", int(time.time()) + 3600), "InvalidSignature"),
    ],
)
def test_every_refusal_names_its_code(token: str, code: str) -> None:
    with pytest.raises(sas.SasError, match=f"^{code}:"):
        sas.verify(token, KEYS)


async def test_amqp_refuses_a_token_signed_for_another_entity(broker: LocalBroker) -> None:
    key_name, key = broker._key("primary")
    host = f"localhost:{broker.amqp_port('primary')}"
    expiry = int(time.time()) + 300

    def client_with(resource: str) -> FastClient:
        token = sas.sign(resource, key_name, key, expiry)
        conn_str = (
            f"Endpoint=sb://{host};SharedAccessSignature={token};UseDevelopmentEmulator=true;"
        )
        return FastClient.from_connection_string(conn_str, retry_total=0)

    # The SDK puts the fixed token for the sender's audience `sb://<host>/orders`.
    async with client_with(f"sb://{host}/payments") as client:
        with pytest.raises(ServiceBusAuthenticationError):
            async with client.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"x"))
    # The same key, signed for the entity (or the namespace), is accepted.
    for resource in (f"sb://{host}/orders", f"sb://{host}/"):
        async with client_with(resource) as client:
            async with client.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"x"))
