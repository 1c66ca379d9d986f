"""Fixtures for the broker tests: an in-process broker per test and SDK helpers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver

from sblocal.config import BrokerConfig, NamespaceConfig, QueueConfig
from sblocal.server import LocalBroker
from sblocal.testing import ControlClient


def fast_config(**overrides: Any) -> BrokerConfig:
    """Two namespaces on free ports, no HTTPS management (faster), the default entities."""
    from sblocal.config import SubscriptionConfig, TopicConfig

    primary = NamespaceConfig(
        name="primary",
        management_port=None,
        queues=(QueueConfig("orders"),),
        topics=(TopicConfig("events", subscriptions=(SubscriptionConfig("audit"),)),),
    )
    secondary = NamespaceConfig(name="secondary", management_port=None)
    cfg = BrokerConfig(namespaces=(primary, secondary), housekeeping_interval=0.02)
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    return cfg


@contextlib.asynccontextmanager
async def running(config: BrokerConfig) -> AsyncIterator[LocalBroker]:
    """An in-process broker with `config`, stopped on exit."""
    b = LocalBroker(config)
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


def running_queues(names: list[str]) -> contextlib.AbstractAsyncContextManager[LocalBroker]:
    """`running` with one namespace, "primary", that holds the queues `names`."""
    primary = NamespaceConfig(
        name="primary", management_port=None, queues=tuple(QueueConfig(q) for q in names)
    )
    return running(fast_config(namespaces=(primary,)))


@contextlib.asynccontextmanager
async def pooled_client(broker: LocalBroker, connections: int) -> AsyncIterator[Any]:
    """The gateway's `SdkNamespaceClient` for `primary`: its senders on `connections` pooled
    connections (gateway.servicebus.internals.pool), closed on exit."""
    from gateway.config import NamespaceSettings, Secret, TimeoutSettings
    from gateway.servicebus.client import SdkNamespaceClient

    ns = NamespaceSettings(
        name="primary", connection_string=Secret(broker.connection_string("primary"))
    )
    client = SdkNamespaceClient(ns, TimeoutSettings(sdk_retry_total=1), connections=connections)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def broker() -> AsyncIterator[LocalBroker]:
    async with running(fast_config()) as b:
        yield b


@pytest.fixture
def control(broker: LocalBroker) -> ControlClient:
    return broker.control_client()


class FastClient(ServiceBusClient):  # type: ignore[misc]
    """A ServiceBusClient whose senders and receivers close quickly.

    Every handler runs a keep-alive task that sleeps in 1 s steps, and close() awaits it:
    ~0.5 s per close. ``keep_alive=0`` turns it off for senders and for receivers with a
    prefetch (a receiver without prefetch always keeps one), so receivers get prefetch 1.
    """

    def get_queue_sender(self, queue_name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("keep_alive", 0)
        return super().get_queue_sender(queue_name, **kwargs)

    def get_topic_sender(self, topic_name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("keep_alive", 0)
        return super().get_topic_sender(topic_name, **kwargs)

    def get_queue_receiver(self, queue_name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("keep_alive", 0)
        kwargs.setdefault("prefetch_count", 1)
        return super().get_queue_receiver(queue_name, **kwargs)

    def get_subscription_receiver(
        self, topic_name: str, subscription_name: str, **kwargs: Any
    ) -> Any:
        kwargs.setdefault("keep_alive", 0)
        kwargs.setdefault("prefetch_count", 1)
        return super().get_subscription_receiver(topic_name, subscription_name, **kwargs)


def sb_client(conn_str: str, **kwargs: Any) -> ServiceBusClient:
    """An SDK client that fails fast (tests assert on the first error, not on retries)."""
    kwargs.setdefault("retry_total", 0)
    kwargs.setdefault("retry_backoff_factor", 0.01)
    return FastClient.from_connection_string(conn_str, **kwargs)


@pytest.fixture
async def client(broker: LocalBroker) -> AsyncIterator[ServiceBusClient]:
    async with sb_client(broker.connection_string("primary")) as c:
        yield c


async def receive_n(
    receiver: ServiceBusReceiver, n: int, timeout: float = 10.0
) -> list[ServiceBusReceivedMessage]:
    """Receive exactly ``n`` messages (fewer only if the deadline passes: then it raises)."""
    got: list[ServiceBusReceivedMessage] = []
    deadline = time.monotonic() + timeout
    async with asyncio.timeout(timeout + 5):
        while len(got) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"received {len(got)} of {n} messages")
            batch = await receiver.receive_messages(
                max_message_count=n - len(got), max_wait_time=max(0.5, min(remaining, 2.0))
            )
            got.extend(batch)
    return got
