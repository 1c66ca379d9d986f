"""No backlog left behind, over every interleaving hypothesis can find.

A stateful property test of the failover state machine, the backlog writes and the
syphon's wake-ups together: two replicas, each with its real `Dispatcher`, `Failover` and
`Syphon`, sharing a primary and a secondary namespace (`FakeNamespace`, at the client and
backlog ports) and failover state (`FakeRedis`/`ClusterStore`, at the state port), on
virtual time (`VirtualTimeLoop`). Hypothesis interleaves: sends, the primary going down and
up, backlog sends held ("started") and released ("completed"), forced failovers and
failbacks on either replica, pings succeeding or failing (the primary's state when the
ping interval comes), replica restarts (graceful or a crash), Redis lost, back, or back
empty, and the passing of time.

The invariant (`check_no_backlog_left_behind`): once the namespaces and Redis are back and
the entities are failed back, every message acknowledged 202 has left the backlog within
`TIME_TO_HOME` of the later of the failback and its write's completion, and every
acknowledged message is at home. `idle_check_interval` is out of reach (a million
seconds), so the slow safety check can never be what saved a message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.core.backlog import BACKLOG_LOCK_DURATION
from gateway.core.entities import EntityRef
from gateway.core.failover import Failover
from gateway.core.message import OutboundMessage
from gateway.core.router import Delivery
from gateway.errors import GatewayError
from tests.support.failover_rig import ENTITIES, QUEUES, TIME_TO_HOME, Replica
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import FakeRedis
from tests.support.virtual_time import VirtualTimeLoop, elapse

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class FailbackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualTimeLoop()
        self.redis = FakeRedis()
        self.primary = FakeNamespace("primary")
        self.secondary = FakeNamespace("secondary")
        self.replicas: list[Replica] = self.loop.run(self._start_replicas())
        self.requests: list[tuple[list[str], asyncio.Task[Delivery]]] = []
        self.acked: dict[str, Delivery] = {}
        self.written_at: dict[str, float] = {}  # 202 message id -> when its write completed
        self.serial = 0
        self.last_crash = float("-inf")

    async def _start_replicas(self) -> list[Replica]:
        replicas = [Replica(f"r{i}", self.redis, self.primary, self.secondary) for i in (0, 1)]
        for r in replicas:
            await r.start()
        return replicas

    def now(self) -> float:
        return self.loop.time()

    def act(self, action: Callable[[], object]) -> None:
        """Do `action` on the loop (as a request handler would), then let things settle."""

        async def run() -> None:
            action()

        self.loop.run(run())
        self.settle()

    def settle(self, seconds: float = 0.001) -> None:
        self.loop.settle(seconds)
        self._collect()

    def _collect(self) -> None:
        """Record the outcome of every request that finished."""
        still: list[tuple[list[str], asyncio.Task[Delivery]]] = []
        for ids, task in self.requests:
            if not task.done():
                still.append((ids, task))
                continue
            exc = task.exception()
            if exc is None:
                delivery = task.result()
                for i in ids:
                    self.acked[i] = delivery
            else:
                assert isinstance(exc, GatewayError), f"not a gateway error: {exc!r}"
        self.requests = still

    # -- rules ------------------------------------------------------------------------------

    @rule(replica=st.integers(0, 1), entity=st.sampled_from(ENTITIES), count=st.integers(1, 3))
    def send(self, replica: int, entity: EntityRef, count: int) -> None:
        ids = [f"m{self.serial + i}" for i in range(count)]
        self.serial += count
        messages = [OutboundMessage(body=b"x", message_id=i) for i in ids]
        failover = self.replicas[replica].failover
        task = self.loop.create_task(self._submit(failover, entity, messages))
        self.requests.append((ids, task))
        self.settle()

    async def _submit(
        self, failover: Failover, entity: EntityRef, messages: list[OutboundMessage]
    ) -> Delivery:
        delivery = await failover.submit(entity, messages)
        if delivery.route == "backlog":
            for m in messages:
                self.written_at[m.message_id] = self.now()
        return delivery

    @rule(down=st.booleans())
    def primary_down(self, down: bool) -> None:
        self.primary.down = down  # pings fail while it is down, succeed when it is up
        self.settle()

    @rule(hold=st.booleans())
    def hold_backlog_sends(self, hold: bool) -> None:
        self.secondary.hold = hold
        self.settle()

    @rule(count=st.integers(1, 3))
    def complete_backlog_sends(self, count: int) -> None:
        self.act(lambda: self.secondary.release(count))

    @rule(replica=st.integers(0, 1), entity=st.sampled_from(ENTITIES))
    def force_failover(self, replica: int, entity: EntityRef) -> None:
        self.act(lambda: self.replicas[replica].failover.force_failover(entity))

    @rule(replica=st.integers(0, 1), entity=st.sampled_from(ENTITIES))
    def mark_healthy(self, replica: int, entity: EntityRef) -> None:
        self.act(lambda: self.replicas[replica].failover.mark_healthy(entity))

    @rule(seconds=st.sampled_from([0.005, 0.2, 1.0, 4.0, 11.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.settle(seconds)

    @precondition(lambda self: self.redis.up)
    @rule()
    def redis_lost(self) -> None:
        self.act(self.redis.stop)

    @precondition(lambda self: not self.redis.up)
    @rule(empty=st.booleans())
    def redis_back(self, empty: bool) -> None:
        self.act(lambda: self.redis.start(empty=empty))

    @rule(replica=st.integers(0, 1), crash=st.booleans())
    def restart_replica(self, replica: int, crash: bool) -> None:
        old = self.replicas[replica]

        async def restart() -> Replica:
            await old.stop(crash)
            new = Replica(f"r{replica}", self.redis, self.primary, self.secondary)
            await new.start()
            return new

        self.replicas[replica] = self.loop.run(restart())
        if crash:
            self.last_crash = self.now()
        self.settle()

    @rule(release_after_failback=st.booleans(), via=st.integers(0, 1))
    def check_no_backlog_left_behind(self, release_after_failback: bool, via: int) -> None:
        self.loop.run(self._check(release_after_failback, via))

    async def _check(self, release_after_failback: bool, via: int) -> None:
        self.primary.down = False
        if not self.redis.up:
            self.redis.start()
        if not release_after_failback:
            self.secondary.hold = False
            self.secondary.release()
        # A syphon that crashed mid-move holds its messages' locks until they expire; and
        # replicas need a moment to reconnect and resync.
        settle = self.redis.reconnect_delay + 10 * self.redis.latency
        await elapse(max(self.last_crash + BACKLOG_LOCK_DURATION + 1 - self.now(), settle))
        failback = self.now()
        for entity in ENTITIES:  # the last failback
            self.replicas[via].failover.mark_healthy(entity)
        await elapse(4 * self.redis.latency)  # every replica saw it and checked
        if release_after_failback:  # writes that started before it complete after it
            self.secondary.hold = False
            self.secondary.release()
        for _, task in self.requests:  # each bounded by its own deadlines
            await asyncio.wait([task])
        self._collect()
        for replica in self.replicas:
            for entity in ENTITIES:
                assert replica.store.get(entity.path).status == "healthy", "not failed back"
        last = max([failback, *self.written_at.values()])
        await elapse(max(last + TIME_TO_HOME + 4 * self.redis.latency - self.now(), 0))
        left = {
            i: q for q in QUEUES for i in self.secondary.ids(q) if self.acked.get(i) is not None
        }
        assert not left, f"acknowledged messages still in the backlog: {left}"
        home = {i for e in ENTITIES for i in self.primary.ids(e.path)}
        lost = set(self.acked) - home
        assert not lost, f"acknowledged messages not at home: {sorted(lost)}"

    @invariant()
    def acknowledged_messages_are_stored(self) -> None:
        stored = {i for e in ENTITIES for i in self.primary.ids(e.path)}
        stored |= {i for q in QUEUES for i in self.secondary.ids(q)}
        missing = set(self.acked) - stored
        assert not missing, f"acknowledged but stored nowhere: {sorted(missing)}"

    def teardown(self) -> None:
        try:
            # The harder order: writes still in flight complete after the failback.
            self.check_no_backlog_left_behind(release_after_failback=True, via=1)
        finally:

            async def stop() -> None:
                for r in self.replicas:
                    await r.stop(crash=False)
                for _, t in self.requests:
                    t.cancel()

            self.loop.run(stop())
            self.loop.close()


FailbackMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFailback = FailbackMachine.TestCase
