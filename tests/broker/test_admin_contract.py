"""The unmodified async `ServiceBusAdministrationClient` against the real broker (HTTPS).

The management API is the one of `sblocal.management`, served by `sblocal.server.LocalBroker`
on one TLS port per namespace; entities created through it are the ones the AMQP side serves,
and the runtime counts it reports are the AMQP side's. `test_management_unit.py` pins the
protocol details against a fake registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from sblocal.entities import INT_MAX, TIMESPAN_MAX, QueueProperties

server = pytest.importorskip("sblocal.server", reason="sblocal.server (LocalBroker) is missing")
testing = pytest.importorskip("sblocal.testing", reason="sblocal.testing is missing")

from sblocal.config import default_config  # noqa: E402 - after the skip guards

from .conftest import receive_n, sb_client  # noqa: E402

LocalBroker = server.LocalBroker
TIMEOUT = 15.0
_T = TypeVar("_T")

BACKLOG: dict[str, Any] = {
    "max_size_in_megabytes": 5120,
    "max_delivery_count": INT_MAX,
    "default_message_time_to_live": TIMESPAN_MAX,
    "auto_delete_on_idle": TIMESPAN_MAX,
    "lock_duration": dt.timedelta(minutes=1),
    "dead_lettering_on_message_expiration": True,
    "enable_batched_operations": True,
}


async def within(awaitable: Awaitable[_T], seconds: float = TIMEOUT) -> _T:
    async with asyncio.timeout(seconds):
        return await awaitable


async def names(pager: Any) -> list[str]:
    async def _all() -> list[str]:
        return [item.name async for item in pager]

    return await within(_all())


def _close(a: dt.timedelta, b: dt.timedelta) -> bool:
    return abs(a - b) <= dt.timedelta(milliseconds=1)


@pytest.fixture
async def mgmt_broker(tmp_path: Path) -> AsyncIterator[Any]:
    """The embedded default pair with its HTTPS management API (certificate in tmp_path)."""
    config = dataclasses.replace(default_config(), cert_dir=tmp_path / "certs")
    broker = LocalBroker(config)
    await within(broker.start(), 30)
    try:
        if broker.management_connection_string("primary") is None:
            pytest.fail("LocalBroker started without a management endpoint for 'primary'")
        yield broker
    finally:
        await within(broker.stop(), 30)


def admin_for(broker: Any, namespace: str, **kwargs: Any) -> ServiceBusAdministrationClient:
    kwargs.setdefault("retry_total", 0)
    return ServiceBusAdministrationClient.from_connection_string(
        kwargs.pop("conn_str", broker.management_connection_string(namespace)),
        connection_verify=broker.ca_cert,
        **kwargs,
    )


@pytest.fixture
async def primary_admin(mgmt_broker: Any) -> AsyncIterator[ServiceBusAdministrationClient]:
    async with admin_for(mgmt_broker, "primary") as admin:
        yield admin


@pytest.fixture
async def secondary_admin(mgmt_broker: Any) -> AsyncIterator[ServiceBusAdministrationClient]:
    async with admin_for(mgmt_broker, "secondary") as admin:
        yield admin


async def test_declared_entities_are_listed(
    primary_admin: ServiceBusAdministrationClient,
    secondary_admin: ServiceBusAdministrationClient,
) -> None:
    assert await names(primary_admin.list_queues()) == ["orders"]
    assert await names(primary_admin.list_topics()) == ["events"]
    assert await names(primary_admin.list_subscriptions("events")) == ["audit"]
    assert await names(secondary_admin.list_queues()) == []
    namespace = await within(primary_admin.get_namespace_properties())
    assert namespace.name == "primary"


async def test_backlog_queues_round_trip(
    mgmt_broker: Any, secondary_admin: ServiceBusAdministrationClient
) -> None:
    """The secondary's backlog queues, created if missing with exactly these values
    (docs/design.md#backlog-queues)."""
    paths = [f"primary/x-servicebus-transfer/{i}" for i in range(3)]
    for path in paths:
        created = await within(secondary_admin.create_queue(path, **BACKLOG))
        assert created.name == path
    for path in paths:
        props = await within(secondary_admin.get_queue(path))
        assert props.max_size_in_megabytes == 5120
        assert props.max_delivery_count == INT_MAX
        assert _close(props.default_message_time_to_live, TIMESPAN_MAX)
        assert _close(props.auto_delete_on_idle, TIMESPAN_MAX)
        assert props.lock_duration == dt.timedelta(minutes=1)
        assert props.dead_lettering_on_message_expiration is True
        assert props.enable_batched_operations is True
        assert props.requires_session is False
        assert props.requires_duplicate_detection is False
        assert mgmt_broker.namespace("secondary").get_queue(path) == QueueProperties(**BACKLOG)
    assert sorted(await names(secondary_admin.list_queues())) == sorted(paths)
    with pytest.raises(ResourceExistsError):
        await within(secondary_admin.create_queue(paths[0], **BACKLOG))


async def test_session_and_duplicate_detection_round_trip(
    mgmt_broker: Any, primary_admin: ServiceBusAdministrationClient
) -> None:
    await within(
        primary_admin.create_queue(
            "sessions",
            requires_session=True,
            requires_duplicate_detection=True,
            duplicate_detection_history_time_window=dt.timedelta(minutes=2),
        )
    )
    props = await within(primary_admin.get_queue("sessions"))
    assert props.requires_session is True
    assert props.requires_duplicate_detection is True
    assert props.duplicate_detection_history_time_window == dt.timedelta(minutes=2)
    stored = mgmt_broker.namespace("primary").get_queue("sessions")
    assert (stored.requires_session, stored.requires_duplicate_detection) == (True, True)


async def test_missing_entities(primary_admin: ServiceBusAdministrationClient) -> None:
    with pytest.raises(ResourceNotFoundError):
        await within(primary_admin.get_queue("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(primary_admin.get_queue_runtime_properties("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(primary_admin.get_subscription("events", "nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(primary_admin.delete_queue("nope"))


async def test_runtime_counts_follow_amqp_traffic(
    mgmt_broker: Any, primary_admin: ServiceBusAdministrationClient
) -> None:
    async with sb_client(mgmt_broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await within(sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(4)]))
            later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
            await within(sender.schedule_messages(ServiceBusMessage("later"), later))
        async with client.get_queue_receiver("orders") as receiver:
            [first] = await receive_n(receiver, 1)
            await within(receiver.dead_letter_message(first, reason="test"))

    async def counts() -> tuple[int, int, int]:
        runtime = await within(primary_admin.get_queue_runtime_properties("orders"))
        return (
            runtime.active_message_count,
            runtime.dead_letter_message_count,
            runtime.scheduled_message_count,
        )

    await testing.eventually(
        lambda: _equal(counts(), (3, 1, 1)), timeout=10, message="queue runtime counts"
    )
    runtime = await within(primary_admin.get_queue_runtime_properties("orders"))
    assert runtime.total_message_count == 5
    assert runtime.size_in_bytes >= 0


async def _equal(actual: Awaitable[_T], expected: _T) -> bool:
    return await actual == expected


async def test_created_entities_serve_amqp(
    mgmt_broker: Any, primary_admin: ServiceBusAdministrationClient
) -> None:
    await within(primary_admin.create_queue("created", max_delivery_count=3))
    await within(primary_admin.create_topic("news"))
    for name in ("a", "b"):
        await within(primary_admin.create_subscription("news", name))
    async with sb_client(mgmt_broker.connection_string("primary")) as client:
        async with client.get_queue_sender("created") as sender:
            await within(sender.send_messages(ServiceBusMessage("hello")))
        async with client.get_topic_sender("news") as sender:
            await within(sender.send_messages(ServiceBusMessage("fan-out")))
        async with client.get_queue_receiver("created") as receiver:
            [message] = await receive_n(receiver, 1)
            assert str(message) == "hello"
            await within(receiver.complete_message(message))
    for name in ("a", "b"):
        runtime = await within(primary_admin.get_subscription_runtime_properties("news", name))
        assert runtime.active_message_count == 1
    topic = await within(primary_admin.get_topic_runtime_properties("news"))
    assert topic.subscription_count == 2
    await within(primary_admin.delete_subscription("news", "b"))
    assert await names(primary_admin.list_subscriptions("news")) == ["a"]
    await within(primary_admin.delete_topic("news"))
    await within(primary_admin.delete_queue("created"))
    assert await names(primary_admin.list_queues()) == ["orders"]


async def test_update_queue_keeps_messages(
    mgmt_broker: Any, primary_admin: ServiceBusAdministrationClient
) -> None:
    async with sb_client(mgmt_broker.connection_string("primary")) as client:
        async with client.get_queue_sender("orders") as sender:
            await within(sender.send_messages(ServiceBusMessage("kept")))
    props = await within(primary_admin.get_queue("orders"))
    props.max_delivery_count = 2
    await within(primary_admin.update_queue(props))
    assert mgmt_broker.namespace("primary").get_queue("orders").max_delivery_count == 2
    runtime = await within(primary_admin.get_queue_runtime_properties("orders"))
    assert runtime.active_message_count == 1


async def test_wrong_key_is_rejected(mgmt_broker: Any) -> None:
    good = mgmt_broker.management_connection_string("primary")
    bad = good.rsplit("SharedAccessKey=", 1)[0] + "SharedAccessKey=d3Jvbmcta2V5"
    async with admin_for(mgmt_broker, "primary", conn_str=bad) as admin:
        with pytest.raises(ClientAuthenticationError):
            await within(admin.get_queue("orders"))


@pytest.mark.integration  # a broker subprocess
async def test_broker_process_prints_management_endpoints(tmp_path: Path) -> None:
    """``python -m sblocal --json``: what a developer copies into the admin client."""
    async with testing.BrokerProcess(data_dir=tmp_path) as process:
        info = process.info
        conn_str = info["namespaces"]["primary"]["management_connection_string"]
        assert conn_str.startswith("Endpoint=sb://localhost:")
        assert "UseDevelopmentEmulator" not in conn_str
        assert Path(info["ca_cert"]).is_file()
        async with ServiceBusAdministrationClient.from_connection_string(
            conn_str, connection_verify=info["ca_cert"], retry_total=0
        ) as admin:
            assert (await within(admin.get_queue("orders"))).name == "orders"
            await within(admin.create_queue("primary/x-servicebus-transfer/0", **BACKLOG))
            assert await names(admin.list_queues()) == [
                "orders",
                "primary/x-servicebus-transfer/0",
            ]
