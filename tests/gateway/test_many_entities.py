"""A whole namespace behind one gateway: 1,000 declared entities, a handful of connections.

The real gateway, SDK and local broker (its own process, with 1,000 queues). Start-up opens
nothing per entity; traffic to every entity opens its links over the namespace's pool of
`connections_per_namespace` connections, counted at the broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory

ENTITIES = 1000
POOL = 4


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """This module's own broker (the census counts only this module's gateway): `primary`
    with 1,000 queues, an empty `secondary`."""
    config: Path = tmp_path_factory.mktemp("many") / "sblocal.toml"
    lines = ['[[namespaces]]\nname = "primary"\nmanagement_port = false\n']
    lines += [f'[[namespaces.queues]]\npath = "q{i}"\n' for i in range(ENTITIES)]
    lines.append('[[namespaces]]\nname = "secondary"\nmanagement_port = false\n')
    config.write_text("\n".join(lines))
    with BrokerProcess(config=config) as b:
        yield b


async def test_a_thousand_entities_are_served_on_a_bounded_pool_of_connections(
    gateway: GatewayFactory, control: ControlClient
) -> None:
    gw = await gateway(
        {
            "SBGATE_ENTITIES": ",".join(f"queue:q{i}" for i in range(ENTITIES)),
            "SBGATE_CONNECTIONS_PER_NAMESPACE": str(POOL),
            "SBGATE_SEND_TIMEOUT": "10",
            "SBGATE_ADMISSION_TIMEOUT": "10",
        }
    )
    # Started and ready: not one connection or link per declared entity.
    assert (await gw.get("/readyz")).status == 200
    assert await control.connections("primary") == {
        "connections": 0,
        "sessions": 0,
        "links": 0,
        "send_links": 0,
    }

    statuses: list[int] = []
    refusals: list[str] = []
    gate = asyncio.Semaphore(32)

    async def post(i: int) -> None:
        async with gate:
            resp = await gw.post(f"/q{i}/messages", data=f"m{i}".encode())
            statuses.append(resp.status)
            if resp.status != 201:
                refusals.append(await resp.text())
            resp.release()

    await asyncio.gather(*(post(i) for i in range(ENTITIES)))
    assert statuses.count(201) == ENTITIES, (sorted(set(statuses)), refusals[:3])
    census = await control.connections("primary")
    assert 1 <= census["connections"] <= POOL, census
    assert census["send_links"] <= ENTITIES, census
    counters = await control.counters("primary")
    assert counters["messages_received"] == ENTITIES
    assert counters["connections"] <= POOL, "a connection was opened beyond the pool"
