"""Sessions keep their order through failover, at scale: the stateful property of
tests/gateway/test_session_order_property.py over thousands of sessions.

The same machine (two gateway replicas sharing a real redis-server, each serving and
running its syphon; the local broker; failovers, failbacks by ping and by hand, a backlog
queue leaving rotation, a replica restart, a Redis restart), with 2,100 sessions over three
entities: every session sends first, a failback race follows for 300 of them, then the
rules send for slices of up to 400 sessions at a time (64 sessions sending at once, each
one's messages one after the other); before the check, a last failback race for 300
sessions of another entity, so that the order is always checked for sessions that went
through the backlog (the rules may end with a Redis restart that exposed the first race).

What a consumer sees is read in bulk: one receiver per entity takes every message in stored
order (by sequence number), and each session's MessageIds are the subsequence with its
SessionId. A session receiver delivers exactly that, a session's messages in stored order
(the local broker's session contract: tests/sblocal); opening 2,100 session receivers one
after the other would cost minutes, not the property. Checked as in the small test: no
acknowledged message lost; for every session except one whose fence Redis lost and no
replica wrote back, the acknowledged messages in acknowledgement order; copies resolved by
MessageId.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import ClassVar

import pytest
from azure.servicebus import ServiceBusReceiveMode
from azure.servicebus.aio import ServiceBusClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from sblocal.testing import BrokerProcess, ControlError
from tests.gateway.test_session_order_property import SessionOrderMachine
from tests.support.processes import RedisServer
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ENTITIES = ["scaled0", "scaled1", "scaled2"]
SESSIONS = [f"s{i}" for i in range(2100)]
SLICE = 400  # sessions in one send rule, at most
DEADLINE = 60.0


class ScaledMachine(SessionOrderMachine):
    entities: ClassVar[list[str]] = ENTITIES
    all_sessions: ClassVar[list[str]] = SESSIONS
    racing: ClassVar[int] = 300

    @rule(
        replica=st.integers(0, 1),
        start=st.integers(0, len(SESSIONS) - 1),
        count=st.integers(1, SLICE),
        rounds=st.integers(1, 2),
    )
    def send_slice(self, replica: int, start: int, count: int, rounds: int) -> None:
        """Sessions start..start+count (wrapping) each send `rounds` messages."""
        sessions = [SESSIONS[(start + i) % len(SESSIONS)] for i in range(count)]
        self._send(replica, sessions, rounds)

    @rule(replica=st.integers(0, 1), sessions=st.just([SESSIONS[0]]), rounds=st.just(1))
    def send(self, replica: int, sessions: list[str], rounds: int) -> None:
        """The small test's rule, narrowed: one session (the slices do the rest)."""
        self._send(replica, sessions, rounds)

    @rule(entity=st.sampled_from(ENTITIES))
    def fail_primary(self, entity: str) -> None:
        super().fail_primary(entity)

    @rule(entity=st.sampled_from(ENTITIES))
    def heal_primary(self, entity: str) -> None:
        super().heal_primary(entity)

    def teardown(self) -> None:
        """A last failback race before the check, whatever the rules did: 300 sessions of
        another entity (none of them fenced when Redis last lost its fences) get messages
        into the backlog, the entity is marked healthy and they send again at once. So the
        order is always checked for sessions that went through the backlog."""
        try:
            # A Redis restart may be the last rule: wait until both replicas have resynced
            # (until then a backlog write of a session is answered 503, fail closed).
            self.run(eventually(self._connected, within=DEADLINE, every=0.1))
            entity = self.entities[1]
            racing = [
                s
                for s in self.all_sessions
                if self.entity_of[s] == entity and s not in self.exposed
            ][: self.racing]
            self.failback_race(entity, racing, 1)
        finally:
            super().teardown()

    async def _connected(self) -> bool:
        for r in self.replicas:
            async with asyncio.timeout(DEADLINE):
                text = await (await r.get("/metrics")).text()
            if "\nsbgate_redis_connected 1.0" not in text:
                return False
        return True

    async def received(self) -> dict[str, list[str]]:
        """Every message of every entity through one receiver each, in stored order; then
        each session's MessageIds in that order."""
        out: dict[str, list[str]] = {s: [] for s in SESSIONS if self.sent[s]}
        for entity in ENTITIES:
            got: list[tuple[int, str, str]] = []
            async with asyncio.timeout(DEADLINE):
                async with ServiceBusClient.from_connection_string(
                    self.broker.connection_string("primary"), retry_total=0
                ) as sb:
                    receiver = sb.get_queue_receiver(
                        entity, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
                    )
                    async with receiver:
                        while batch := await receiver.receive_messages(
                            max_message_count=1000, max_wait_time=1
                        ):
                            got += [
                                (int(m.sequence_number or 0), str(m.session_id), str(m.message_id))
                                for m in batch
                            ]
            for _, session, mid in sorted(got):
                out.setdefault(session, []).append(mid)
        return out


def test_strict_order_at_scale(broker: BrokerProcess, redis_server: RedisServer) -> None:
    async def queues() -> None:
        for e in ENTITIES:
            with contextlib.suppress(ControlError):
                await broker.control.create_entity("primary", e, "queue")

    asyncio.run(queues())
    ScaledMachine.broker = broker
    ScaledMachine.redis = redis_server
    ScaledMachine.order = "strict"
    ScaledMachine.checked = []
    ScaledMachine.ordered_backlogged = []
    ScaledMachine.summary = []
    run_state_machine_as_test(
        ScaledMachine,
        settings=settings(
            max_examples=1,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    [acked] = ScaledMachine.checked
    [ordered] = ScaledMachine.ordered_backlogged
    assert acked >= len(SESSIONS), acked
    # The order was checked for sessions that went through the backlog (the failback race
    # alone fences 300), not only for sessions that never left the primary.
    assert ordered > 0, ScaledMachine.summary
