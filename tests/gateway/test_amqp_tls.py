"""The AMQP edge's TLS listener: the real Python SDK sends over it, and a certificate
replaced on disk is served to the next connections without a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusMessage, TransportType
from azure.servicebus.aio import ServiceBusClient

from gateway.app import AMQP_SERVER
from sblocal.certs import client_ssl_context, ensure_dev_cert
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH, DEADLINE, SEND_KEY, receive
from tests.support.processes import free_port
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_the_sdk_sends_over_tls(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient, tmp_path: Path
) -> None:
    cert, key = ensure_dev_cert(tmp_path)
    port = free_port()
    await gateway(
        {
            **AUTH,
            "SBGATE_AMQP_PORT": str(port),
            "SBGATE_AMQP_TLS_CERT_FILE": str(cert),
            "SBGATE_AMQP_TLS_KEY_FILE": str(key),
        }
    )
    # The SDK dials 5671 with TLS whatever the string says; a test listens elsewhere, so it
    # names the port as a custom endpoint (over AMQP, not WebSockets) and trusts the dev CA.
    conn = f"Endpoint=sb://localhost/;SharedAccessKeyName=sender;SharedAccessKey={SEND_KEY}"
    async with asyncio.timeout(DEADLINE):
        async with ServiceBusClient.from_connection_string(
            conn,
            custom_endpoint_address=f"sb://localhost:{port}",
            transport_type=TransportType.Amqp,
            connection_verify=str(cert),
            retry_total=0,
        ) as sb:
            async with sb.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage(b"secure", message_id="tls-1"))
    [got] = await receive(broker, 1)
    assert got.message_id == "tls-1"


async def served_certificate(port: int, trust: Path) -> bytes:
    async with asyncio.timeout(10):
        _reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ssl_context(trust), server_hostname="localhost"
        )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        assert isinstance(ssl_object, ssl.SSLObject)
        der = ssl_object.getpeercert(binary_form=True)
        assert der is not None
        return der
    finally:
        writer.close()


async def test_a_replaced_certificate_is_served_without_a_restart(
    gateway: GatewayFactory, control: ControlClient, tmp_path: Path
) -> None:
    first_cert, first_key = ensure_dev_cert(tmp_path / "first")
    second_cert, second_key = ensure_dev_cert(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "cert.pem", live / "key.pem"
    shutil.copy(first_cert, cert)
    shutil.copy(first_key, key)
    gw = await gateway(
        {
            **AUTH,
            "SBGATE_AMQP_PORT": "0",
            "SBGATE_AMQP_TLS_CERT_FILE": str(cert),
            "SBGATE_AMQP_TLS_KEY_FILE": str(key),
        }
    )
    port = gw.app[AMQP_SERVER].ports["tls"]
    first = ssl.PEM_cert_to_DER_cert(first_cert.read_text())
    second = ssl.PEM_cert_to_DER_cert(second_cert.read_text())
    assert await served_certificate(port, first_cert) == first

    # Rotated as a Secret volume is: new files, new modification times.
    shutil.copy(second_key, key)
    shutil.copy(second_cert, cert)
    later = os.stat(cert).st_mtime + 10
    os.utime(cert, (later, later))

    async def rotated() -> bool:
        try:
            return await served_certificate(port, second_cert) == second
        except ssl.SSLError:
            return False  # still the first one, which the second's trust refuses

    await eventually(rotated, within=15, every=0.3)
