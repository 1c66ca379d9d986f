"""Shutdown.

Every cleanup context finishes within its bound (`gateway.app.cleanup_bounds`) whatever the
broker and the SDK do: after a namespace went down and up, and while it is down, with sends
and sender opens in flight; and when the SDK loses a cancellation (Python 3.11's
`asyncio.wait_for`, which its AMQP layer reads every frame with, drops one that arrives as
the read completes) or handles one with an unbounded cleanup close.

Graceful shutdown with a real process and a real SIGTERM, under load: readiness fails at
once, requests keep being served during the drain delay, and no accepted request is cut.

"Cut" is checked the way Jepsen checks a queue: every message the broker stored must have
been answered 201, and every 201 must be stored. Connections still in the kernel's accept
backlog when the listener closes are reset without reaching the gateway (in Kubernetes the
drain delay lets the endpoints drop the pod first); they store nothing, so they cannot hide
a cut request from this check."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from azure.servicebus.aio import ServiceBusSender

from gateway.app import DISPATCHER, cleanup_bounds
from gateway.config import LimitSettings, TimeoutSettings, load_settings
from gateway.core.dispatcher import Destination, Dispatcher, _State
from gateway.lifetimes import CANCEL_GRACE, Closer
from gateway.servicebus.client import CLOSE_TIMEOUT, SdkSender
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.support.fakes import FakeClient, FakeSender, msg
from tests.support.processes import GatewayProcess, broker_env, free_port
from tests.support.waiting import eventually, no_hang

# On a loaded machine a bounded step can run late; a missing bound never ends at all.
MARGIN = 10.0


# -- a lost cancellation or an unbounded cleanup (fakes at the ports) ---------------------


class LosesOneCancel(FakeClient):
    """Opens that lose the first cancel they get, as the SDK's do on Python 3.11: the read
    that `asyncio.wait_for` awaited completed as the cancel arrived, so the open completes."""

    def __init__(self) -> None:
        super().__init__()
        self.opening = asyncio.Event()
        self.lost = 0

    async def open_sender(self, path: str) -> FakeSender:
        self.opening.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.lost += 1  # dropped: the open goes on and succeeds
        return await super().open_sender(path)


async def test_a_worker_whose_cancel_an_open_lost_still_ends_at_close():
    limits = LimitSettings(senders_per_entity=2, admission_timeout=30)
    d = Dispatcher(limits, TimeoutSettings(connect_timeout=60, send_timeout=1))
    client = LosesOneCancel()
    dest = Destination(client, "orders")
    request = asyncio.create_task(d.send(dest, [msg(1)]))
    await client.opening.wait()
    grace = 0.05
    async with no_hang("Dispatcher.close", guard=grace + 2 * (5.0 + CANCEL_GRACE) + MARGIN):
        await d.close(grace=grace)
    assert client.lost >= 1, "the open lost its cancel"
    workers = [t for lane in d._lanes.values() for t in lane.workers]
    assert all(t.done() for t in workers), "every worker ended"
    await asyncio.gather(request, return_exceptions=True)
    assert client.closed_senders == client.opened, "every sender opened was closed"


class CleansUpWithoutDeadline:
    """A `ServiceBusSender` whose close meets a cancel with a cleanup that never ends (the
    SDK's cleanup close has no deadline unless a per-try timeout is set) — until a second
    cancel."""

    def __init__(self) -> None:
        self.closing = asyncio.Event()
        self.ended = False

    async def close(self) -> None:
        self.closing.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            try:
                await asyncio.Event().wait()
            finally:
                self.ended = True


@pytest.mark.slow  # waits out the close's bound
async def test_a_sender_close_that_meets_its_cancel_with_an_unbounded_cleanup_is_bounded():
    sdk = CleansUpWithoutDeadline()
    closer = Closer("namespace primary")
    sender = SdkSender("primary", "orders", cast(ServiceBusSender, sdk), closer)
    async with no_hang("SdkSender.close", guard=CLOSE_TIMEOUT + CANCEL_GRACE + MARGIN):
        await sender.close()
    async with no_hang("Closer.aclose", guard=2 * CANCEL_GRACE + MARGIN):
        await closer.aclose()
    assert sdk.ended and closer.pending == 0, "the cleanup was ended by its owner"


# -- the app against the local broker -------------------------------------------------------


def bounded_cleanups(
    bounds: dict[str, float], ended: list[str]
) -> Callable[[web.Application], None]:
    """A `prepare` hook: each cleanup context's cleanup runs under `no_hang(bound + MARGIN)`
    and, once finished, appends its name to `ended`."""

    def wrap(ctx: Any) -> Any:
        name = ctx.__name__

        async def bounded(app: web.Application) -> AsyncIterator[None]:
            gen = ctx(app)
            await gen.__anext__()
            yield
            async with no_hang(f"{name} at shutdown", guard=bounds[name] + MARGIN):
                with pytest.raises(StopAsyncIteration):
                    await gen.__anext__()
            ended.append(name)

        bounded.__name__ = name
        return bounded

    def prepare(app: web.Application) -> None:
        for i, ctx in enumerate(list(app.cleanup_ctx)):
            app.cleanup_ctx[i] = wrap(ctx)

    return prepare


async def _close_and_check(gw: Any, ended: list[str], names: Sequence[str], before: set[Any]):
    await gw.close()
    assert ended == list(reversed(names)), "every cleanup context finished"

    def left() -> set[asyncio.Task[Any]]:
        return {t for t in asyncio.all_tasks() if not t.done()} - before

    # Tasks cancelled during the close may need a loop turn to finish.
    await eventually(lambda: not left(), within=MARGIN, what="no task left pending")


@pytest.mark.parametrize("while_down", [False, True], ids=["after down and up", "while down"])
async def test_every_cleanup_context_ends_within_its_bound_after_a_namespace_fault(
    gateway: GatewayFactory, control: ControlClient, broker: BrokerProcess, while_down: bool
):
    env = {
        "SBGATE_SDK_RETRY_TOTAL": "0",
        "SBGATE_SEND_TIMEOUT": "2",
        "SBGATE_SENDERS_PER_ENTITY": "4",
        "SBGATE_ADMISSION_TIMEOUT": "10",
    }
    bounds = cleanup_bounds(load_settings(broker_env(broker, **env)))
    ended: list[str] = []
    before = {t for t in asyncio.all_tasks() if not t.done()}
    gw = await gateway(env, prepare=bounded_cleanups(bounds, ended))
    names = [ctx.__name__ for ctx in gw.app.cleanup_ctx]
    assert set(names) == set(bounds), "a bound for every cleanup context"
    assert (await gw.post("/orders/messages", data=b"1")).status == 201
    await control.down("primary")
    posts: list[asyncio.Task[Any]] = []
    try:
        assert (await gw.post("/orders/messages", data=b"2")).status == 503
        await control.up("primary")
        if not while_down:
            assert (await gw.post("/orders/messages", data=b"3")).status in (201, 503)
        # Slow, so that sends and sender opens are in flight when the app closes. (A down
        # namespace refuses connections at once: its opens are never in flight for long, so
        # "while down" takes it down again under the sends and opens already in flight.)
        await control.set_latency("primary", round_trip_ms=400, store_ms=0)
        posts = [
            asyncio.create_task(gw.post(f"/queues/{path}/messages", data=b"x"))
            for path in ("orders", "events")
            for _ in range(8)
        ]
        dispatcher = gw.app[DISPATCHER]
        await eventually(
            lambda: any(
                lane.has(_State.OPENING, _State.SENDING) for lane in dispatcher._lanes.values()
            ),
            what="a send or an open in flight",
        )
        if while_down:
            await control.down("primary")
        await _close_and_check(gw, ended, names, before | set(posts))
    finally:
        await control.up("primary")
        await asyncio.gather(*posts, return_exceptions=True)


# -- SIGTERM ---------------------------------------------------------------------------------


@pytest.mark.slow  # a `gateway serve` subprocess under load, then SIGTERM
async def test_sigterm_under_load_cuts_no_accepted_request(
    broker: BrokerProcess, control: ControlClient, tmp_path: Path
):
    env = broker_env(
        broker, SBGATE_DRAIN_DELAY="1", SBGATE_SHUTDOWN_TIMEOUT="10", SBGATE_LOG_LEVEL="WARNING"
    )
    gw = GatewayProcess("gateway", env, port=free_port(), log_dir=tmp_path)
    base = gw.url
    outcomes: Counter[str] = Counter()
    accepted: set[str] = set()
    seen: dict[str, str] = {}  # each message's outcome, named when an assertion fails
    stop = asyncio.Event()
    async with gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:

            async def client(n: int) -> None:
                i = 0
                while not stop.is_set() and i < 2000:
                    mid = f"sd-{n}-{i}"
                    i += 1
                    try:
                        async with http.post(
                            f"{base}/queues/orders/messages",
                            data=b"x",
                            headers={"BrokerProperties": f'{{"MessageId": "{mid}"}}'},
                        ) as r:
                            outcomes[str(r.status)] += 1
                            seen[mid] = str(r.status)
                            if r.status == 201:
                                accepted.add(mid)
                    except aiohttp.ClientConnectorError:
                        outcomes["refused"] += 1  # never reached the server: not accepted
                        seen[mid] = "refused"
                        await asyncio.sleep(0.01)  # pacing a closed port, not waiting on state
                    except aiohttp.ClientError as exc:
                        outcomes[f"reset:{type(exc).__name__}"] += 1
                        seen[mid] = f"reset:{exc!r}"

            clients = [asyncio.create_task(client(n)) for n in range(16)]
            await eventually(lambda: len(accepted) >= 200, within=30)
            gw.terminate()
            signalled_at = len(accepted)

            async def not_ready() -> bool:
                try:
                    async with http.get(f"{base}/readyz") as r:
                        return r.status == 503
                except aiohttp.ClientError:
                    return False

            await eventually(not_ready, within=2, every=0.02)
            assert await gw.wait(30) == 0
            stop.set()
            await asyncio.gather(*clients)
    assert len(accepted) > signalled_at, "requests were still served during the drain delay"
    assert outcomes["refused"] > 0, f"the listener closed in the end: {dict(outcomes)}"
    assert not {k for k in outcomes if k.startswith("5")}, (
        f"no 5xx while draining: {dict(outcomes)}"
    )
    stored = {m["message_id"] for m in await control.messages("primary", "orders", limit=100_000)}
    cut = {mid: seen.get(mid) for mid in stored - accepted}  # what each one's client saw
    assert cut == {}, f"stored, never answered 201 (a request was cut): {cut}, {dict(outcomes)}"
    assert accepted - stored == set(), "an accepted message is missing"
