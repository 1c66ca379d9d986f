"""The chaos scenarios, one module per fault family, and the table of them all.

`framework` runs a scenario (its own stack, load, the fault, a drain and the checks);
`replica`, `namespace`, `redis` and `messages` hold the scenario bodies.
"""

from __future__ import annotations

from loadtests.scenarios.framework import (
    SYPHON_REPLICAS,
    Criterion,
    Scenario,
    ScenarioResult,
    run_scenario,
)
from loadtests.scenarios.messages import poison, slowloris
from loadtests.scenarios.namespace import (
    broker_stall,
    primary_outage,
    total_outage,
    ttl_shorter_than_outage,
)
from loadtests.scenarios.redis import redis_blackhole, redis_partition, redis_restart_empty
from loadtests.scenarios.replica import baseline, replica_kill, replica_sigterm, syphon_kill
from loadtests.stack import StackOptions

__all__ = ["SCENARIOS", "Criterion", "ScenarioResult", "by_name", "run_scenario"]

SCENARIOS: list[Scenario] = [
    Scenario("baseline", "Baseline: steady load, no fault", baseline),
    Scenario("replica-kill", "kill -9 one replica mid-load", replica_kill),
    Scenario(
        "replica-sigterm",
        "SIGTERM one replica mid-load",
        replica_sigterm,
        # Readiness must be seen failing before the listener closes: the drain delay plays
        # the endpoint-propagation time (Kubernetes' default setting here is 5 s).
        StackOptions(drain_delay=3.0),
    ),
    Scenario(
        "primary-outage",
        "Primary down ~30 s, then back",
        primary_outage,
        SYPHON_REPLICAS,
    ),
    Scenario(
        "broker-stall",
        "Every replica's primary connection stalled ~12 s (TCP proxy)",
        broker_stall,
        StackOptions(syphon="replicas", proxy_broker=True),
    ),
    Scenario("total-outage", "Primary and every backlog down", total_outage),
    Scenario("redis-blackhole", "Redis blackholed ~30 s", redis_blackhole),
    Scenario(
        "redis-restart-empty",
        "Redis restarted empty mid-failover",
        redis_restart_empty,
        SYPHON_REPLICAS,
    ),
    Scenario(
        "redis-partition",
        "One replica cut off from Redis while the primary fails",
        redis_partition,
        SYPHON_REPLICAS,
    ),
    Scenario(
        "syphon-kill",
        "Syphon killed between send and complete, repeatedly",
        syphon_kill,
        StackOptions(syphon="off"),
    ),
    Scenario(
        "ttl-outage",
        "TTL shorter than the outage",
        ttl_shorter_than_outage,
        SYPHON_REPLICAS,
    ),
    Scenario(
        "poison",
        "Poison requests (and a poison backlog message) among normal ones",
        poison,
        SYPHON_REPLICAS,
    ),
    Scenario("slowloris", "1,000 slow clients next to normal load", slowloris),
]


def by_name(names: list[str] | None) -> list[Scenario]:
    if not names:
        return list(SCENARIOS)
    table = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]
