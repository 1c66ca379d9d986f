"""The management API against the real async `ServiceBusAdministrationClient` over real HTTPS.

The namespace behind the API is an in-memory fake at the `EntityRegistry` port (below), so
these tests pin the ATOM protocol alone; `test_admin_contract.py` repeats the core round trips
against the real broker.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote_plus, urlencode

import aiohttp
import pytest
from aiohttp import web
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
)
from azure.servicebus.aio._base_handler_async import ServiceBusSharedKeyCredential
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from sblocal.certs import (
    CERT_FILE_NAME,
    client_ssl_context,
    ensure_dev_cert,
    server_ssl_context,
)
from sblocal.entities import (
    INT_MAX,
    TIMESPAN_MAX,
    EntityExistsError,
    EntityNotFoundError,
    QueueProperties,
    RuntimeCounts,
    SubscriptionProperties,
    TopicProperties,
)
from sblocal.management import create_management_app, format_duration, parse_duration

KEY_NAME = "RootManageSharedAccessKey"
KEY = "c2Jsb2NhbC10ZXN0LWtleQ=="
TIMEOUT = 15.0
_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------
# A fake namespace at the EntityRegistry port (plus the optional update capability)
# ---------------------------------------------------------------------------------------------


class FakeRegistry:
    """Dictionaries behind a lock; runtime counts are set by the tests."""

    def __init__(self, name: str = "primary") -> None:
        self._name = name
        self._lock = threading.Lock()
        self.queues: dict[str, QueueProperties] = {}
        self.topics: dict[str, TopicProperties] = {}
        self.subscriptions: dict[str, dict[str, SubscriptionProperties]] = {}
        self.counts: dict[str, RuntimeCounts] = {}

    @property
    def name(self) -> str:
        return self._name

    def list_queues(self) -> list[tuple[str, QueueProperties]]:
        with self._lock:
            return list(self.queues.items())

    def get_queue(self, path: str) -> QueueProperties | None:
        with self._lock:
            return self.queues.get(path)

    def create_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        with self._lock:
            if path in self.queues or path in self.topics:
                raise EntityExistsError(path)
            self.queues[path] = props
            self.counts[path] = RuntimeCounts()
            return props

    def update_queue(self, path: str, props: QueueProperties) -> QueueProperties:
        with self._lock:
            if path not in self.queues:
                raise EntityNotFoundError(path)
            self.queues[path] = props
            return props

    def delete_queue(self, path: str) -> None:
        with self._lock:
            if self.queues.pop(path, None) is None:
                raise EntityNotFoundError(path)
            self.counts.pop(path, None)

    def queue_runtime(self, path: str) -> RuntimeCounts:
        with self._lock:
            if path not in self.queues:
                raise EntityNotFoundError(path)
            return self.counts.setdefault(path, RuntimeCounts())

    def list_topics(self) -> list[tuple[str, TopicProperties]]:
        with self._lock:
            return list(self.topics.items())

    def get_topic(self, path: str) -> TopicProperties | None:
        with self._lock:
            return self.topics.get(path)

    def create_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        with self._lock:
            if path in self.queues or path in self.topics:
                raise EntityExistsError(path)
            self.topics[path] = props
            self.subscriptions[path] = {}
            return props

    def update_topic(self, path: str, props: TopicProperties) -> TopicProperties:
        with self._lock:
            if path not in self.topics:
                raise EntityNotFoundError(path)
            self.topics[path] = props
            return props

    def delete_topic(self, path: str) -> None:
        with self._lock:
            if self.topics.pop(path, None) is None:
                raise EntityNotFoundError(path)
            self.subscriptions.pop(path, None)

    def list_subscriptions(self, topic: str) -> list[tuple[str, SubscriptionProperties]]:
        with self._lock:
            if topic not in self.topics:
                raise EntityNotFoundError(topic)
            return list(self.subscriptions[topic].items())

    def get_subscription(self, topic: str, name: str) -> SubscriptionProperties | None:
        with self._lock:
            return self.subscriptions.get(topic, {}).get(name)

    def create_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self._lock:
            if topic not in self.topics:
                raise EntityNotFoundError(topic)
            if name in self.subscriptions[topic]:
                raise EntityExistsError(f"{topic}/subscriptions/{name}")
            self.subscriptions[topic][name] = props
            self.counts[f"{topic}/subscriptions/{name}"] = RuntimeCounts()
            return props

    def update_subscription(
        self, topic: str, name: str, props: SubscriptionProperties
    ) -> SubscriptionProperties:
        with self._lock:
            if name not in self.subscriptions.get(topic, {}):
                raise EntityNotFoundError(f"{topic}/subscriptions/{name}")
            self.subscriptions[topic][name] = props
            return props

    def delete_subscription(self, topic: str, name: str) -> None:
        with self._lock:
            if self.subscriptions.get(topic, {}).pop(name, None) is None:
                raise EntityNotFoundError(f"{topic}/subscriptions/{name}")

    def subscription_runtime(self, topic: str, name: str) -> RuntimeCounts:
        with self._lock:
            if name not in self.subscriptions.get(topic, {}):
                raise EntityNotFoundError(f"{topic}/subscriptions/{name}")
            return self.counts.setdefault(f"{topic}/subscriptions/{name}", RuntimeCounts())


# ---------------------------------------------------------------------------------------------
# Fixtures: the app over real HTTPS on 127.0.0.1, and the real admin client
# ---------------------------------------------------------------------------------------------


async def within(awaitable: Awaitable[_T], seconds: float = TIMEOUT) -> _T:
    async with asyncio.timeout(seconds):
        return await awaitable


async def collect(pager: Any, seconds: float = TIMEOUT) -> list[Any]:
    async def _all() -> list[Any]:
        return [item async for item in pager]

    return await within(_all(), seconds)


@dataclass
class Served:
    registry: FakeRegistry
    port: int
    cert: Path

    def connection_string(self, key: str = KEY, key_name: str = KEY_NAME) -> str:
        return (
            f"Endpoint=sb://localhost:{self.port};SharedAccessKeyName={key_name};"
            f"SharedAccessKey={key}"
        )

    def admin(self, **kwargs: Any) -> ServiceBusAdministrationClient:
        kwargs.setdefault("connection_verify", str(self.cert))
        kwargs.setdefault("retry_total", 0)
        return ServiceBusAdministrationClient.from_connection_string(
            kwargs.pop("conn_str", self.connection_string()), **kwargs
        )


@pytest.fixture(scope="session")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return ensure_dev_cert(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def served(dev_cert: tuple[Path, Path]) -> AsyncIterator[Served]:
    registry = FakeRegistry()
    runner = web.AppRunner(create_management_app(registry, keys={KEY_NAME: KEY}))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ssl_context(*dev_cert))
    await site.start()
    try:
        yield Served(registry, runner.addresses[0][1], dev_cert[0])
    finally:
        await runner.cleanup()


@pytest.fixture
async def admin(served: Served) -> AsyncIterator[ServiceBusAdministrationClient]:
    client = served.admin()
    async with client:
        yield client


def _close(a: dt.timedelta, b: dt.timedelta) -> bool:
    return abs(a - b) <= dt.timedelta(milliseconds=1)


BACKLOG = {
    "max_size_in_megabytes": 5120,
    "max_delivery_count": INT_MAX,
    "default_message_time_to_live": TIMESPAN_MAX,
    "auto_delete_on_idle": TIMESPAN_MAX,
    "lock_duration": dt.timedelta(minutes=1),
    "dead_lettering_on_message_expiration": True,
    "enable_batched_operations": True,
}


# ---------------------------------------------------------------------------------------------
# Queues
# ---------------------------------------------------------------------------------------------


async def test_backlog_queue_properties_round_trip(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    path = "primary/x-servicebus-transfer/0"
    created = await within(
        admin.create_queue(
            path, requires_session=True, requires_duplicate_detection=True, **BACKLOG
        )
    )
    fetched = await within(admin.get_queue(path))
    for props in (created, fetched):
        assert props.name == path
        assert props.max_size_in_megabytes == 5120
        assert props.max_delivery_count == INT_MAX
        assert _close(props.default_message_time_to_live, TIMESPAN_MAX)
        assert _close(props.auto_delete_on_idle, TIMESPAN_MAX)
        assert props.lock_duration == dt.timedelta(minutes=1)
        assert props.dead_lettering_on_message_expiration is True
        assert props.enable_batched_operations is True
        assert props.requires_session is True
        assert props.requires_duplicate_detection is True
        assert props.duplicate_detection_history_time_window == dt.timedelta(minutes=10)
        assert props.status == "Active"
    # The broker side receives exactly the backlog-queue values (docs/design.md#backlog-queues).
    stored = served.registry.queues[path]
    assert stored == QueueProperties(
        requires_session=True, requires_duplicate_detection=True, **BACKLOG
    )


async def test_timedelta_max_is_stored_as_timespan_max(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    await within(
        admin.create_queue(
            "q", default_message_time_to_live=dt.timedelta.max, auto_delete_on_idle="PT10M"
        )
    )
    stored = served.registry.queues["q"]
    assert stored.default_message_time_to_live == TIMESPAN_MAX
    assert stored.auto_delete_on_idle == dt.timedelta(minutes=10)


async def test_create_queue_with_defaults(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    props = await within(admin.create_queue("plain"))
    assert served.registry.queues["plain"] == QueueProperties()
    assert props.max_delivery_count == 10
    assert props.requires_session is False


async def test_create_existing_queue_raises_resource_exists(
    admin: ServiceBusAdministrationClient,
) -> None:
    await within(admin.create_queue("orders"))
    with pytest.raises(ResourceExistsError):
        await within(admin.create_queue("orders"))
    await within(admin.create_topic("events"))
    with pytest.raises(ResourceExistsError):
        await within(admin.create_queue("events"))


async def test_missing_entities_raise_resource_not_found(
    admin: ServiceBusAdministrationClient,
) -> None:
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_queue("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_queue_runtime_properties("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_topic("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.delete_queue("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.delete_topic("nope"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_subscription("nope", "s"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.create_subscription("nope", "s"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.delete_subscription("nope", "s"))
    with pytest.raises(ResourceNotFoundError):
        await collect(admin.list_subscriptions("nope"))


async def test_queue_runtime_properties(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    await within(admin.create_queue("orders"))
    created = dt.datetime(2024, 3, 1, 8, 30, 0, 123456, tzinfo=dt.UTC)
    served.registry.counts["orders"] = RuntimeCounts(
        active_message_count=5,
        dead_letter_message_count=2,
        scheduled_message_count=3,
        size_in_bytes=2048,
        created_at=created,
        updated_at=created + dt.timedelta(hours=1),
        accessed_at=created + dt.timedelta(hours=2),
    )
    runtime = await within(admin.get_queue_runtime_properties("orders"))
    assert runtime.name == "orders"
    assert runtime.active_message_count == 5
    assert runtime.dead_letter_message_count == 2
    assert runtime.scheduled_message_count == 3
    assert runtime.total_message_count == 10
    assert runtime.transfer_message_count == 0
    assert runtime.transfer_dead_letter_message_count == 0
    assert runtime.size_in_bytes == 2048
    assert runtime.created_at_utc == created
    assert runtime.updated_at_utc == created + dt.timedelta(hours=1)
    assert runtime.accessed_at_utc == created + dt.timedelta(hours=2)
    listed = await collect(admin.list_queues_runtime_properties())
    assert [(r.name, r.active_message_count) for r in listed] == [("orders", 5)]


async def test_update_queue_in_place(served: Served, admin: ServiceBusAdministrationClient) -> None:
    await within(admin.create_queue("orders", **BACKLOG))
    served.registry.counts["orders"] = RuntimeCounts(active_message_count=7)
    props = await within(admin.get_queue("orders"))
    props.max_delivery_count = 3
    props.lock_duration = dt.timedelta(seconds=30)
    await within(admin.update_queue(props))
    stored = served.registry.queues["orders"]
    assert stored == replace(
        QueueProperties(**BACKLOG), max_delivery_count=3, lock_duration=dt.timedelta(seconds=30)
    )
    await within(admin.update_queue(props, default_message_time_to_live=dt.timedelta(days=1)))
    assert served.registry.queues["orders"].default_message_time_to_live == dt.timedelta(days=1)
    runtime = await within(admin.get_queue_runtime_properties("orders"))
    assert runtime.active_message_count == 7  # an update keeps the messages


async def test_update_rejects_immutable_and_missing(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    await within(admin.create_queue("orders"))
    props = await within(admin.get_queue("orders"))
    props.requires_session = True
    with pytest.raises(HttpResponseError) as info:
        await within(admin.update_queue(props))
    assert info.value.status_code == 400
    assert "RequiresSession" in str(info.value)
    await within(admin.delete_queue("orders"))
    props.requires_session = False
    with pytest.raises(ResourceNotFoundError):
        await within(admin.update_queue(props))


async def test_invalid_values_are_rejected_with_400(admin: ServiceBusAdministrationClient) -> None:
    with pytest.raises(HttpResponseError) as info:
        await within(admin.create_queue("q", lock_duration=dt.timedelta(minutes=10)))
    assert info.value.status_code == 400
    with pytest.raises(HttpResponseError) as info:
        await within(admin.create_queue("q", forward_to="elsewhere"))
    assert info.value.status_code == 400
    assert "ForwardTo" in str(info.value)


async def test_delete_queue(served: Served, admin: ServiceBusAdministrationClient) -> None:
    await within(admin.create_queue("orders"))
    await within(admin.delete_queue("orders"))
    assert "orders" not in served.registry.queues
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_queue("orders"))


async def test_list_queues_pages_past_100(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    names = [f"primary/x-servicebus-transfer/{i}" for i in range(230)]
    for name in names:
        served.registry.create_queue(name, QueueProperties(max_delivery_count=INT_MAX))
    listed = await collect(admin.list_queues())
    assert sorted(q.name for q in listed) == sorted(names)
    assert len(listed) == 230
    assert all(q.max_delivery_count == INT_MAX for q in listed)
    runtime = await collect(admin.list_queues_runtime_properties())
    assert len(runtime) == 230


async def test_list_queues_empty(admin: ServiceBusAdministrationClient) -> None:
    assert await collect(admin.list_queues()) == []
    assert await collect(admin.list_topics()) == []


# ---------------------------------------------------------------------------------------------
# Topics and subscriptions
# ---------------------------------------------------------------------------------------------


async def test_topic_round_trip(served: Served, admin: ServiceBusAdministrationClient) -> None:
    created = await within(
        admin.create_topic(
            "events",
            max_size_in_megabytes=2048,
            requires_duplicate_detection=True,
            duplicate_detection_history_time_window=dt.timedelta(minutes=5),
            default_message_time_to_live=dt.timedelta(days=14),
        )
    )
    assert created.name == "events"
    assert served.registry.topics["events"] == TopicProperties(
        max_size_in_megabytes=2048,
        requires_duplicate_detection=True,
        duplicate_detection_history_time_window=dt.timedelta(minutes=5),
        default_message_time_to_live=dt.timedelta(days=14),
    )
    topic = await within(admin.get_topic("events"))
    assert topic.max_size_in_megabytes == 2048
    assert topic.requires_duplicate_detection is True
    assert topic.default_message_time_to_live == dt.timedelta(days=14)
    assert _close(topic.auto_delete_on_idle, TIMESPAN_MAX)
    await within(admin.create_subscription("events", "audit"))
    await within(admin.create_subscription("events", "billing"))
    runtime = await within(admin.get_topic_runtime_properties("events"))
    assert runtime.subscription_count == 2
    topic.default_message_time_to_live = dt.timedelta(days=1)
    await within(admin.update_topic(topic))
    assert served.registry.topics["events"].default_message_time_to_live == dt.timedelta(days=1)
    listed = await collect(admin.list_topics())
    assert [t.name for t in listed] == ["events"]
    await within(admin.delete_topic("events"))
    assert served.registry.topics == {}
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_topic("events"))


async def test_subscription_round_trip(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    await within(admin.create_topic("primary/events"))
    created = await within(
        admin.create_subscription(
            "primary/events",
            "audit",
            lock_duration=dt.timedelta(seconds=45),
            requires_session=True,
            max_delivery_count=INT_MAX,
            dead_lettering_on_message_expiration=True,
            default_message_time_to_live=dt.timedelta(hours=2),
            auto_delete_on_idle=TIMESPAN_MAX,
        )
    )
    expected = SubscriptionProperties(
        lock_duration=dt.timedelta(seconds=45),
        requires_session=True,
        max_delivery_count=INT_MAX,
        dead_lettering_on_message_expiration=True,
        default_message_time_to_live=dt.timedelta(hours=2),
    )
    assert served.registry.subscriptions["primary/events"]["audit"] == expected
    fetched = await within(admin.get_subscription("primary/events", "audit"))
    for props in (created, fetched):
        assert props.name == "audit"
        assert props.lock_duration == dt.timedelta(seconds=45)
        assert props.requires_session is True
        assert props.max_delivery_count == INT_MAX
        assert props.dead_lettering_on_message_expiration is True
        assert props.default_message_time_to_live == dt.timedelta(hours=2)
        assert _close(props.auto_delete_on_idle, TIMESPAN_MAX)
    with pytest.raises(ResourceExistsError):
        await within(admin.create_subscription("primary/events", "audit"))

    served.registry.counts["primary/events/subscriptions/audit"] = RuntimeCounts(
        active_message_count=4, dead_letter_message_count=1
    )
    runtime = await within(admin.get_subscription_runtime_properties("primary/events", "audit"))
    assert (runtime.active_message_count, runtime.dead_letter_message_count) == (4, 1)
    assert runtime.total_message_count == 5

    fetched.max_delivery_count = 5
    await within(admin.update_subscription("primary/events", fetched))
    assert served.registry.subscriptions["primary/events"]["audit"].max_delivery_count == 5

    listed = await collect(admin.list_subscriptions("primary/events"))
    assert [s.name for s in listed] == ["audit"]
    listed_runtime = await collect(admin.list_subscriptions_runtime_properties("primary/events"))
    assert [s.active_message_count for s in listed_runtime] == [4]

    await within(admin.delete_subscription("primary/events", "audit"))
    with pytest.raises(ResourceNotFoundError):
        await within(admin.get_subscription("primary/events", "audit"))


async def test_list_subscriptions_pages_past_100(
    served: Served, admin: ServiceBusAdministrationClient
) -> None:
    served.registry.create_topic("events", TopicProperties())
    for i in range(150):
        served.registry.create_subscription("events", f"s{i:03d}", SubscriptionProperties())
    listed = await collect(admin.list_subscriptions("events"))
    assert [s.name for s in listed] == [f"s{i:03d}" for i in range(150)]


async def test_namespace_properties(admin: ServiceBusAdministrationClient) -> None:
    props = await within(admin.get_namespace_properties())
    assert props.name == "primary"
    assert props.messaging_sku == "Standard"
    assert props.namespace_type == "Messaging"


# ---------------------------------------------------------------------------------------------
# Connecting and authorising
# ---------------------------------------------------------------------------------------------


async def test_wrong_key_is_401(served: Served) -> None:
    client = served.admin(conn_str=served.connection_string(key="d3Jvbmc="))
    async with client:
        with pytest.raises(ClientAuthenticationError) as info:
            await within(client.get_queue("orders"))
        assert info.value.status_code == 401
        with pytest.raises(HttpResponseError) as listing:
            await collect(client.list_queues())
        assert listing.value.status_code == 401
    unknown = served.admin(conn_str=served.connection_string(key_name="Other"))
    async with unknown:
        with pytest.raises(ClientAuthenticationError):
            await within(unknown.create_queue("orders"))
    assert served.registry.queues == {}


def _sas(uri: str, key_name: str, key: str, expiry: int) -> str:
    signed = f"{quote_plus(uri)}\n{expiry}".encode()
    sig = base64.b64encode(hmac.new(key.encode(), signed, hashlib.sha256).digest())
    return "SharedAccessSignature " + urlencode(
        {"sr": uri, "sig": sig, "se": str(expiry), "skn": key_name}
    )


async def test_raw_rest_requests(served: Served) -> None:
    """Plain REST: missing/expired tokens, literal slashes in paths, token scopes."""
    base = f"https://127.0.0.1:{served.port}"
    served.registry.create_queue("primary/x-servicebus-transfer/0", QueueProperties())
    ssl_context = client_ssl_context(served.cert)
    url = f"{base}/primary/x-servicebus-transfer/0?api-version=2021-05"
    later = int(time.time()) + 300
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http:
        async with http.get(url, ssl=ssl_context) as response:
            assert response.status == 401
            assert "MissingToken" in await response.text()
        expired = _sas(base, KEY_NAME, KEY, int(time.time()) - 10)
        async with http.get(url, ssl=ssl_context, headers={"Authorization": expired}) as response:
            assert response.status == 401
            assert "ExpiredToken" in await response.text()
        scoped = _sas(f"{base}/primary", KEY_NAME, KEY, later)
        async with http.get(url, ssl=ssl_context, headers={"Authorization": scoped}) as response:
            assert response.status == 200
            body = await response.text()
            assert response.headers["Content-Type"].startswith("application/atom+xml")
            assert '<title type="text">primary/x-servicebus-transfer/0</title>' in body
            assert "<MaxDeliveryCount>10</MaxDeliveryCount>" in body
            assert "<DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S<" in body
        other = _sas(f"{base}/secondary", KEY_NAME, KEY, later)
        async with http.get(url, ssl=ssl_context, headers={"Authorization": other}) as response:
            assert response.status == 401
        good = _sas(base, KEY_NAME, KEY, later)
        async with http.delete(
            f"{base}/primary%2Fx-servicebus-transfer%2F0?api-version=2021-05",
            ssl=ssl_context,
            headers={"Authorization": good},
        ) as response:
            assert response.status == 200
        assert served.registry.queues == {}


class ReadOnlyRegistry(FakeRegistry):
    """A registry with only the EntityRegistry methods (no update capability)."""

    update_queue = None  # type: ignore[assignment]
    update_topic = None  # type: ignore[assignment]
    update_subscription = None  # type: ignore[assignment]


@pytest.mark.integration  # serves the app itself
async def test_keyless_app_and_registry_without_updates(dev_cert: tuple[Path, Path]) -> None:
    """No keys: any token is accepted. No update capability: updates answer 501, not a crash."""
    registry = ReadOnlyRegistry()
    runner = web.AppRunner(create_management_app(registry, keys={}))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ssl_context(*dev_cert))
        await site.start()
        served = Served(registry, runner.addresses[0][1], dev_cert[0])
        client = served.admin(conn_str=served.connection_string(key="YW55"))
        async with client:
            props = await within(client.create_queue("orders"))
            with pytest.raises(HttpResponseError) as info:
                await within(client.update_queue(props))
            assert info.value.status_code == 501
        assert registry.queues == {"orders": QueueProperties()}
    finally:
        await runner.cleanup()


async def test_constructor_with_host_and_port(served: Served) -> None:
    """`fully_qualified_namespace` may carry the port; 127.0.0.1 is in the certificate too.

    In 7.15.0 the async admin client signs SAS tokens only with its own
    ServiceBusSharedKeyCredential (what from_connection_string builds); an AzureNamedKeyCredential
    is treated as an AAD credential (see test_azure_named_key_credential_is_not_supported).
    """
    client = ServiceBusAdministrationClient(
        f"127.0.0.1:{served.port}",
        ServiceBusSharedKeyCredential(KEY_NAME, KEY),
        connection_verify=str(served.cert),
        retry_total=0,
    )
    async with client:
        await within(client.create_queue("orders"))
        assert (await within(client.get_queue("orders"))).name == "orders"


async def test_azure_named_key_credential_is_not_supported(served: Served) -> None:
    from azure.core.credentials import AzureNamedKeyCredential

    client = ServiceBusAdministrationClient(
        f"localhost:{served.port}",
        AzureNamedKeyCredential(KEY_NAME, KEY),  # type: ignore[arg-type]
        connection_verify=str(served.cert),
        retry_total=0,
    )
    async with client:
        # The SDK's bearer-token policy calls credential.get_token(), which this credential
        # does not have: the call fails inside the client, before any request is sent.
        with pytest.raises(AttributeError):
            await within(client.get_queue("orders"))


async def test_untrusted_certificate_is_refused(served: Served, tmp_path: Path) -> None:
    other_cert, _ = ensure_dev_cert(tmp_path / "other")
    client = served.admin(connection_verify=str(other_cert))
    async with client:
        with pytest.raises(ServiceRequestError) as info:
            await within(client.get_queue("orders"))
    assert "certificate verify failed" in str(info.value).lower()


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("PT1M", dt.timedelta(minutes=1)),
        ("P14D", dt.timedelta(days=14)),
        ("PT10M", dt.timedelta(minutes=10)),
        ("PT0.5S", dt.timedelta(milliseconds=500)),
        ("P1DT2H3M4.25S", dt.timedelta(days=1, hours=2, minutes=3, seconds=4.25)),
        ("PT300S", dt.timedelta(minutes=5)),
        ("P10675199DT2H48M5.4775807S", TIMESPAN_MAX),
        ("P10675199DT2H48M5.47758S", TIMESPAN_MAX),
        ("P999999999DT23H59M59.999999S", TIMESPAN_MAX),
        ("P1Y", dt.timedelta(days=365)),
    ],
)
def test_parse_duration(text: str, value: dt.timedelta) -> None:
    assert parse_duration(text) == value


@pytest.mark.parametrize("text", ["", "P", "PT", "1M", "-PT1M", "PT1.5M", "P1DT"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (dt.timedelta(minutes=1), "PT1M"),
        (dt.timedelta(days=14), "P14D"),
        (dt.timedelta(0), "PT0S"),
        (dt.timedelta(milliseconds=500), "PT0.5S"),
        (dt.timedelta(days=1, hours=2, minutes=3, seconds=4), "P1DT2H3M4S"),
        (TIMESPAN_MAX, "P10675199DT2H48M5.4775807S"),
        (dt.timedelta.max, "P10675199DT2H48M5.4775807S"),
    ],
)
def test_format_duration(value: dt.timedelta, text: str) -> None:
    assert format_duration(value) == text
    assert parse_duration(text) == min(value, TIMESPAN_MAX)


def test_dev_cert_is_reused_and_repaired(tmp_path: Path) -> None:
    cert, key = ensure_dev_cert(tmp_path)
    assert cert.name == CERT_FILE_NAME
    first = cert.read_bytes()
    assert key.stat().st_mode & 0o777 == 0o600
    assert ensure_dev_cert(tmp_path) == (cert, key)
    assert cert.read_bytes() == first
    cert.write_bytes(b"garbage")
    ensure_dev_cert(tmp_path)
    assert cert.read_bytes() not in (first, b"garbage")
    server_ssl_context(cert, key)  # the repaired pair loads
