"""Gateway replicas with every adapter at its port, on virtual time.

Each `Replica` runs the real `Dispatcher`, `Failover` and (optionally) `Syphon`; replicas
share a primary and a secondary namespace (`FakeNamespace`) and failover state
(`FakeRedis`, one `ClusterStore` per replica). Build and drive them inside a
`VirtualTimeLoop`: timers, pings, receive waits and deadlines all run on its clock.
"""

from __future__ import annotations

import asyncio
import random

from gateway.config import FailoverSettings, LimitSettings, SyphonSettings, TimeoutSettings
from gateway.core.backlog import backlog_path
from gateway.core.dispatcher import Dispatcher
from gateway.core.entities import EntityRef
from gateway.core.failover import Failover, PairClients
from gateway.core.looplag import LoopLag
from gateway.core.message import OutboundMessage
from gateway.core.ports import RealClock
from gateway.metrics import Metrics
from gateway.syphon.syphon import MIN_CHECK_SPACING, Syphon
from tests.support.fake_broker import FakeNamespace
from tests.support.fake_cluster import ClusterStore, FakeRedis

ORDERS = EntityRef("orders", "queue", "default")
EVENTS = EntityRef("events", "topic", "default")
ENTITIES = [ORDERS, EVENTS]
QUEUES = tuple(backlog_path("primary", i) for i in range(3))
FAILOVER = FailoverSettings(
    failover_interval=5.0,
    ping_primary_interval=30.0,
    backlog_queue_count=len(QUEUES),
    backlog_reprobe_interval=30.0,
)
# idle_check_interval out of reach: the slow safety check must never be what saved a message.
SYPHON = SyphonSettings(workers=2, max_batch=20, receive_wait=5.0, idle_check_interval=1e6)
TIMEOUTS = TimeoutSettings(send_timeout=10.0)
LIMITS = LimitSettings()
# The bound docs/failover.md states: check spacing + one receive already waiting + one move
# already under way.
TIME_TO_HOME = MIN_CHECK_SPACING + SYPHON.receive_wait + TIMEOUTS.send_timeout


class LoopClock(RealClock):
    """The syphon's clock on the loop's (virtual) time."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


def messages(*ids: str) -> list[OutboundMessage]:
    return [OutboundMessage(body=b"x", message_id=i) for i in ids]


class Replica:
    """One gateway replica. Build it inside the loop (its clocks are the loop's)."""

    def __init__(
        self,
        name: str,
        redis: FakeRedis,
        primary: FakeNamespace,
        secondary: FakeNamespace,
        *,
        syphon: bool = True,
        failover: FailoverSettings = FAILOVER,
        store: ClusterStore | None = None,
        metrics: Metrics | None = None,
        loop_lag: LoopLag | None = None,
    ) -> None:
        loop_time = asyncio.get_running_loop().time
        self.store = store or ClusterStore(redis, name)
        self.dispatcher = Dispatcher(LIMITS, TIMEOUTS, clock=loop_time)
        pairs = {"default": PairClients(primary, secondary, QUEUES)}
        self.failover = Failover(
            self.dispatcher,
            pairs,
            self.store,
            failover,
            LIMITS,
            clock=loop_time,
            rng=random.Random(name),  # reproducible backlog choice
            observer=metrics,
            loop_lag=loop_lag,
            timeouts=TIMEOUTS,
        )
        self.syphon = (
            Syphon(
                backlog=secondary,
                queues=QUEUES,
                dispatcher=self.dispatcher,
                primary=primary,
                entities=[e.path for e in ENTITIES],
                store=self.store,
                settings=SYPHON,
                timeouts=TIMEOUTS,
                clock=LoopClock(),
                observer=metrics,
            )
            if syphon
            else None
        )

    async def start(self) -> None:
        await self.store.start()
        self.failover.start(ENTITIES)
        if self.syphon is not None:
            self.syphon.start()

    async def stop(self, crash: bool = False) -> None:
        """Gracefully: moves in flight finish. A crash: everything stops where it is (a
        message between its send home and its complete stays locked in the backlog)."""
        if self.syphon is not None:
            await self.syphon.close(grace=0.0 if crash else TIMEOUTS.send_timeout)
        await self.failover.close()
        await self.dispatcher.close(grace=0.0 if crash else 1.0)
        await self.store.close()

    def status(self, entity: EntityRef = ORDERS) -> str:
        return self.store.get(entity.path.lower()).status
