"""The suite's shape: every test is `unit` or `integration`, and some are also `slow`.

* `integration` — drives a real component: the SDK against the local broker, a
  `redis-server`, Spark, a subprocess, or a server on 127.0.0.1. A test is integration when
  it is marked so (itself or its module) or uses a fixture that starts such a component.
* `unit` — everything else: pure logic in this process. `forbid_real_components` enforces
  it: a unit test that starts a process or listens on a socket fails and must be marked.
* `slow` — what ``make test-fast`` leaves out: every test that starts a gateway against the
  broker (the `gateway` fixture: about a second each, its SDK senders opened and closed) or
  Spark (a JVM), and the modules marked so (chaos, fuzzing, subprocess gateways, chart
  renders, fault waits).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

# Fixtures that start a real component; `item.fixturenames` is the closure, so a fixture
# built on one of these (`gateway` on `broker`, `raw` on `redis_server`) counts too.
COMPONENT_FIXTURES = frozenset(
    {
        "broker",  # tests/conftest.py: sblocal subprocess; tests/broker: in-process broker
        "redis_server",
        "redis_server_factory",
        "redis_cluster",  # tests/support/redis.py: three cluster nodes
        "tls_server",  # tests/gateway/test_state_redis_connect.py: a TLS redis-server
        "sentinel_group",  # tests/gateway/test_state_redis_connect.py: master, replica, sentinels
        "spark",
        "aiohttp_client",
        "aiohttp_server",
        "aiohttp_raw_server",
        "mgmt_broker",  # tests/broker/test_admin_contract.py: a broker with HTTPS management
        "served",  # tests/broker/test_management_unit.py: the HTTPS management app
        "echo_port",  # tests/loadtests/test_harness_units.py: a TCP echo server
        "idp",  # tests/gateway/test_identity.py: an Entra ID token endpoint on 127.0.0.1
    }
)


# Fixtures that make a test slow by themselves.
SLOW_FIXTURES = frozenset({"gateway", "spark"})


def classify(items: list[pytest.Item]) -> None:
    """Add `unit` or `integration` to every collected test that has neither, and `slow`
    to those that use a slow fixture."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("unit") or item.get_closest_marker("integration"):
            continue
        kind = "integration" if fixtures & COMPONENT_FIXTURES else "unit"
        item.add_marker(getattr(pytest.mark, kind))


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"a unit test {what}: mark it (or its module) integration — tests/support/markers.py"
        )

    return refuse


@pytest.fixture(autouse=True)
def forbid_real_components(request: pytest.FixtureRequest) -> Iterator[None]:
    """Unit tests may not start processes nor listen on sockets."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
        mp.setattr(socket.socket, "listen", _refuse("listened on a socket"))
        yield
