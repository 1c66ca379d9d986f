"""AMQPS on sblocal's AMQP port (`amqp_tls`, ``--amqp-tls``), with the development
certificate; plain AMQP stays the default.

The Python SDK dials 5671 whenever TLS is on, whatever the connection string's port, and
trusts only certifi unless given `connection_verify`: a test app therefore names the port
through ``custom_endpoint_address`` with ``transport_type=Amqp`` (without it the endpoint
means WebSockets) and passes the certificate as its CA bundle.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, TransportType
from azure.servicebus.exceptions import ServiceBusConnectionError

from sblocal.certs import client_ssl_context
from sblocal.server import LocalBroker
from sblocal.testing import BrokerProcess
from tests.broker.conftest import fast_config, receive_n, running, sb_client
from tests.broker.scripted import ScriptedPeer

pytestmark = pytest.mark.integration


def _tls_client(broker: LocalBroker, **kwargs: Any) -> Any:
    port = broker.amqp_port("primary")
    return sb_client(
        broker.connection_string("primary"),
        custom_endpoint_address=f"sb://localhost:{port}",
        transport_type=TransportType.Amqp,
        **kwargs,
    )


async def test_the_python_sdk_sends_and_receives_over_amqps() -> None:
    async with running(fast_config(amqp_tls=True)) as broker:
        assert broker.ca_cert is not None
        assert "UseDevelopmentEmulator" not in broker.connection_string("primary")
        async with asyncio.timeout(30), _tls_client(broker, connection_verify=broker.ca_cert) as c:
            async with c.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage("over tls", message_id="t1"))
                batch = await sender.create_message_batch()
                batch.add_message(ServiceBusMessage("b1", message_id="t2"))
                batch.add_message(ServiceBusMessage("b2", message_id="t3"))
                await sender.send_messages(batch)
            async with c.get_queue_receiver("orders") as receiver:
                got = await receive_n(receiver, 3)
                for m in got:
                    await receiver.complete_message(m)
        assert [m.message_id for m in got] == ["t1", "t2", "t3"]


async def test_a_client_that_does_not_trust_the_certificate_is_refused() -> None:
    async with running(fast_config(amqp_tls=True)) as broker:
        async with asyncio.timeout(30), _tls_client(broker) as c:  # certifi only
            with pytest.raises(ServiceBusConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                async with c.get_queue_sender("orders") as sender:
                    await sender.send_messages(ServiceBusMessage("refused"))
        assert broker.namespace("primary").counters.messages_received == 0


async def test_mssbcbs_inside_tls() -> None:
    """.NET's SASL mechanism runs inside the TLS session like any other."""
    async with running(fast_config(amqp_tls=True)) as broker:
        assert broker.ca_cert is not None
        context = client_ssl_context(Path(broker.ca_cert))
        port = broker.amqp_port("primary")

        def connect() -> list[str]:
            peer = ScriptedPeer(port, mechanism="MSSBCBS", tls=context)
            peer.close()
            return peer.offered

        async with asyncio.timeout(30):
            assert await asyncio.to_thread(connect) == ["MSSBCBS", "ANONYMOUS"]


async def test_plain_amqp_is_the_default(broker: LocalBroker) -> None:
    assert broker.config.amqp_tls is False
    assert broker.connection_string("primary").endswith("UseDevelopmentEmulator=true;")
    port = broker.amqp_port("primary")

    def handshake() -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="localhost"):
                pass

    async with asyncio.timeout(30):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.to_thread(handshake)


@pytest.mark.slow
async def test_the_cli_flag_turns_amqps_on() -> None:
    async with BrokerProcess(extra_args=["--amqp-tls"]) as process:
        assert process.info["amqp_tls"] is True
        conn_str = process.connection_string("primary")
        assert "UseDevelopmentEmulator" not in conn_str
        port = process.info["namespaces"]["primary"]["amqp_port"]
        async with asyncio.timeout(30):
            async with sb_client(
                conn_str,
                custom_endpoint_address=f"sb://localhost:{port}",
                transport_type=TransportType.Amqp,
                connection_verify=process.ca_cert,
            ) as client:
                async with client.get_queue_sender("orders") as sender:
                    await sender.send_messages(ServiceBusMessage("via the CLI"))
            messages = await process.control.messages("primary", "orders")
        assert [m["body_text"] for m in messages] == ["via the CLI"]
