"""The adaptive concurrency limit's logic (gateway.core.limiter), on a fake clock.

The dispatcher's side (refusal at the limit, unlimited sends) is at the end, with fakes at
the NamespaceClient port. The end-to-end behaviour against the local broker's latency and
busy faults is in tests/gateway/test_adaptive_admission.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.limiter import GradientLimiter, LimiterConfig
from gateway.core.looplag import LoopLag
from gateway.core.message import OutboundMessage
from gateway.errors import Saturated
from tests.support.fakes import Behaviour, FakeClient, msg
from tests.support.waiting import eventually, no_hang

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _limiter(**kw: float) -> tuple[GradientLimiter, Clock]:
    clock = Clock()
    config = LimiterConfig(
        **{"initial": 40, "minimum": 4, "maximum": 1000, "min_samples": 5, **kw}  # type: ignore[arg-type]
    )
    return GradientLimiter(config, clock), clock


def _window(lim: GradientLimiter, clock: Clock, latency: float, load: float = 1.0) -> None:
    """One measurement window with the namespace holding `load` x its limit (capped by the
    limit), every request settling after `latency` seconds."""
    held = 0
    for _ in range(max(1, int(lim.limit * load))):
        if lim.try_acquire():
            held += 1
    clock.now += lim.config.window
    for _ in range(held):
        lim.release(latency)


def _pushback(lim: GradientLimiter, clock: Clock) -> None:
    assert lim.try_acquire()
    clock.now += lim.config.window
    lim.release(dropped=True)


def test_it_refuses_at_the_limit_at_once_and_counts_it() -> None:
    lim, _ = _limiter(initial=3, minimum=1)
    assert [lim.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert (lim.in_flight, lim.refused) == (3, 1)
    lim.release(0.01)
    assert lim.try_acquire()


def test_the_first_window_sets_the_baseline() -> None:
    lim, clock = _limiter()
    assert lim.baseline is None
    _window(lim, clock, 0.004)
    assert lim.baseline == pytest.approx(0.004)


def test_latency_near_the_baseline_grows_the_limit() -> None:
    lim, clock = _limiter()
    _window(lim, clock, 0.004)
    before = lim.limit
    for _ in range(20):
        _window(lim, clock, 0.005)  # within the 1.5x tolerance
    assert lim.limit > before


def test_latency_ten_times_the_baseline_shrinks_it_and_recovery_grows_it_again() -> None:
    lim, clock = _limiter(initial=200, target_latency=0.005)  # 20 ms is over this budget
    for _ in range(5):
        _window(lim, clock, 0.002)
    steady = lim.limit
    for _ in range(15):
        _window(lim, clock, 0.020)
    slowed = lim.limit
    assert slowed < steady / 2
    for _ in range(60):
        _window(lim, clock, 0.002)
    assert lim.limit > slowed * 1.5


def test_pushback_cuts_the_limit_once_per_window_and_never_below_the_minimum() -> None:
    lim, clock = _limiter(initial=100, backoff=0.5)
    _pushback(lim, clock)
    assert lim.limit == 50
    # Many drops within one window: one cut.
    for _ in range(10):
        assert lim.try_acquire()
    for _ in range(9):
        lim.release(dropped=True)
    assert lim.limit == 50
    clock.now += lim.config.window
    lim.release(dropped=True)
    assert lim.limit == 25
    for _ in range(10):
        _pushback(lim, clock)
    assert lim.limit == 4


def test_an_idle_namespace_learns_its_baseline_but_keeps_its_limit() -> None:
    lim, clock = _limiter(initial=100)
    _window(lim, clock, 0.002, load=0.1)
    for _ in range(10):
        _window(lim, clock, 0.050, load=0.1)  # slow, but it used a tenth of its limit
    assert lim.limit == 100
    assert lim.baseline is not None and lim.baseline > 0.002


def test_a_window_needs_enough_samples() -> None:
    lim, clock = _limiter()
    assert lim.try_acquire()
    clock.now += 1.0
    lim.release(0.5)  # one sample: the window stays open
    assert lim.baseline is None
    _window(lim, clock, 0.004)
    # It closes at its fifth sample: its mean is the latency, its least sample the baseline.
    assert lim.last_latency == pytest.approx((0.5 + 0.004 * 4) / 5)
    assert lim.baseline == pytest.approx(0.004)


def test_the_baseline_follows_a_lasting_change() -> None:
    lim, clock = _limiter(initial=100, baseline_windows=10)
    _window(lim, clock, 0.002)
    for _ in range(60):
        _window(lim, clock, 0.010)
    assert lim.baseline == pytest.approx(0.010, rel=0.05)
    assert lim.limit >= 4


# -- the dispatcher's side (fakes at the NamespaceClient port) -----------------------------


async def test_the_dispatcher_refuses_over_the_limit_at_once_but_not_an_unlimited_send() -> None:
    client = FakeClient()
    client.behaviour = _held(client)
    limits = LimitSettings(adaptive_admission=True, adaptive_initial_limit=2, adaptive_min_limit=1)
    d = Dispatcher(limits, TimeoutSettings(send_timeout=30))
    dest = Destination(client, "orders")
    try:
        held = [asyncio.create_task(d.send(dest, [msg(i)])) for i in range(2)]
        await eventually(lambda: len(client.batches) >= 1, what="the first send is out")
        async with no_hang("a request over the limit"):
            with pytest.raises(Saturated, match="adaptive concurrency limit"):
                await d.send(dest, [msg("over")])
        limiter = d.limiter("primary")
        assert limiter is not None and (limiter.in_flight, limiter.refused) == (2, 1)
        # The syphon's moves and the pings are not limited.
        unlimited = asyncio.create_task(d.send(dest, [msg("ping")], limited=False))
        client.release.set()
        async with no_hang("the held sends"):
            await asyncio.gather(*held, unlimited)
        assert limiter.in_flight == 0
        assert "ping" in client.sent_ids()
    finally:
        client.release.set()
        await d.close(grace=1)


async def test_the_dispatcher_without_adaptive_admission_has_no_limiter() -> None:
    client = FakeClient()
    d = Dispatcher(LimitSettings(), TimeoutSettings())
    try:
        await d.send(Destination(client, "orders"), [msg(1)])
        assert d.limiter("primary") is None
    finally:
        await d.close(grace=1)


def _held(client: FakeClient) -> Behaviour:
    async def behaviour(path: str, messages: Sequence[OutboundMessage]) -> None:
        await client.release.wait()

    return behaviour


class _Lagging(LoopLag):
    """The event loop ran `late` seconds late during every send (a gateway short of CPU)."""

    def __init__(self, late: float) -> None:
        super().__init__()
        self.late = late

    def lag_since(self, t: float) -> float:
        return self.late


@pytest.mark.parametrize(("late", "baseline"), [(0.0, 1.0), (0.9, 0.1), (5.0, 0.0)])
async def test_the_loop_s_own_lag_is_left_out_of_the_samples(late: float, baseline: float) -> None:
    clock = Clock()
    client = FakeClient()

    async def one_second(path: str, messages: Sequence[OutboundMessage]) -> None:
        clock.now += 1.0  # each send takes a second on the dispatcher's clock

    client.behaviour = one_second
    limits = LimitSettings(adaptive_admission=True, adaptive_initial_limit=10)
    d = Dispatcher(limits, TimeoutSettings(), clock=clock, loop_lag=_Lagging(late))
    try:
        for i in range(5):  # one window's samples, one after another
            await d.send(Destination(client, "orders"), [msg(i)])
        limiter = d.limiter("primary")
        assert limiter is not None and limiter.baseline == pytest.approx(baseline)
    finally:
        await d.close(grace=1)


def test_the_limit_never_falls_below_littles_law_floor_and_a_pushback_resets_it() -> None:
    # Target 0.5 s so the floor shows: 40 requests stored per 0.1 s window is 400 a second,
    # which at 0.5 s each takes 200 in flight.
    lim, clock = _limiter(target_latency=0.5)

    def steady(latency: float) -> None:
        # 40 held and released one at a time across the window (a steady 400 a second).
        for _ in range(40):
            assert lim.try_acquire()
        for _ in range(40):
            clock.now += lim.config.window / 40
            lim.release(latency)

    steady(0.01)
    assert lim.peak_rate == pytest.approx(400.0)
    assert lim.limit == int(lim.peak_rate * 0.5) >= 199
    # The latency rises tenfold: the gradient would cut, the floor holds (decaying slowly).
    for _ in range(10):
        steady(0.1)
    assert lim.limit == int(lim.peak_rate * 0.5) > 150
    before = lim.peak_rate
    # The broker pushes back: the rate of the window it ended in is the peak now.
    _pushback(lim, clock)
    assert lim.peak_rate < before / 2
    assert lim.limit < 150


def _burst(lim: GradientLimiter, clock: Clock, arrivals: int, spacing: float) -> int:
    """One burst of `arrivals` requests at once, as the gateway meets them when many clients'
    timers fire together: the admitted ones are served one after another, `spacing` seconds
    apart (the gateway's CPU per request), so the k-th settles after k x `spacing`. Returns
    how many were admitted."""
    admitted = sum(lim.try_acquire() for _ in range(arrivals))
    start = clock.now
    for k in range(1, admitted + 1):
        clock.now = start + k * spacing
        lim.release(k * spacing)
    clock.now = max(clock.now, start + lim.config.window)
    return admitted


def test_latency_within_the_budget_does_not_shrink_the_limit() -> None:
    # Bursts of 300 requests served 100 us apart: the last settles after 30 ms, the mean 15 ms,
    # far above the 1 ms a lone request takes but well within the 50 ms budget. Nothing
    # is to be gained by refusing any of them: the limit must not fall below the burst.
    lim, clock = _limiter(initial=400, target_latency=0.05)
    for _ in range(3):
        _window(lim, clock, 0.001)  # a lone request's latency: the baseline
    for _ in range(100):
        admitted = _burst(lim, clock, 300, 0.0001)
    assert admitted == 300
    assert lim.limit >= 300


def test_the_limit_converges_to_the_rate_times_the_budget_by_littles_law() -> None:
    # A resource serving 10,000 requests a second one after another, always offered more
    # than the limit: each window, the k-th request held settles k / 10,000 s after the
    # window begins, so the mean latency is half the number held over that rate. Whatever
    # the limit starts at, it settles where that mean is the 50 ms budget, about
    # 2 x 10,000 x 0.05 = 1,000 held at once, and stays there: the baseline is the least
    # queued round trip, not the queueing the limit itself causes (which, learned, would
    # raise the latency aimed at, which raises the limit, which raises the queueing...).
    for initial in (40, 3000):
        lim, clock = _limiter(initial=initial, maximum=4096, target_latency=0.05)
        for _ in range(3):
            _window(lim, clock, 0.001)
        for _ in range(1000):
            _burst(lim, clock, 4000, 0.0001)
        assert 900 <= lim.limit <= 1150, (initial, lim.limit)
        assert lim.baseline is not None and lim.baseline < 0.005


def test_a_slowdown_past_the_budget_cuts_a_limit_held_at_half_then_it_follows_the_broker() -> None:
    # 24 clients one request at a time: the limit grows to twice what they hold and stops
    # (unused). The broker slows to 150 ms, three times the budget: the limit falls under the
    # 24 held (refusing), then, once the baseline has learned the slower round trip, grows
    # back to let the 24 through: Little's law at the new latency.
    lim, clock = _limiter(initial=32, minimum=2)
    held = 0

    def closed_loop(latency: float, seconds: float) -> None:
        nonlocal held
        for _ in range(round(seconds / latency)):
            while held < 24 and lim.try_acquire():
                held += 1
            clock.now += latency
            for _ in range(held):
                lim.release(latency)
            held = 0

    closed_loop(0.006, 5.0)
    fast = lim.limit
    assert lim.refused == 0
    closed_loop(0.150, 8.0)
    assert lim.refused > 0
    closed_loop(0.150, 20.0)
    assert lim.limit >= 24 and lim.baseline is not None and lim.baseline > 0.1
    assert fast >= 24


def _slowdown(observe_sends: bool, slow: float = 0.050, seconds: float = 5.0) -> tuple[int, int]:
    """200 clients, one request at a time each, against a broker whose round trip goes from
    5 ms to `slow` (50 ms: the budget) for `seconds`; each request waits a fifth more than the
    round trip (batching, the loop). Returns the lowest limit after the slowdown and the
    requests refused."""
    lim, clock = _limiter(initial=40, minimum=4, maximum=4096, target_latency=0.05)

    def closed_loop(rtt: float, seconds: float) -> int:
        lowest = lim.limit
        for _ in range(round(seconds / rtt)):
            held = 0
            while held < 200 and lim.try_acquire():
                held += 1
            clock.now += rtt * 1.2
            for _ in range(held):
                if observe_sends:
                    lim.observe_send(rtt)
                lim.release(rtt * 1.2)
            lowest = min(lowest, lim.limit)
        return lowest

    closed_loop(0.005, 5.0)
    assert lim.limit >= 200
    refused = lim.refused
    return closed_loop(slow, seconds), lim.refused - refused


def test_a_broker_slower_than_the_budget_raises_the_goal_to_its_round_trip_at_once() -> None:
    # Without the sends' round trips the goal stays at the budget while the baseline (an
    # average over ~10 s) learns the slower broker, and every window above it shrinks the
    # limit: it fell under the 200 clients and refused them (the ladder's broker x10 phase:
    # 1,059 -> 61). With them, three windows of sends all slower than the budget raise the
    # goal to 1.5x the round trip: the limit holds.
    lowest, refused = _slowdown(observe_sends=False)
    assert lowest < 200 and refused > 0, (lowest, refused)
    lowest, refused = _slowdown(observe_sends=True)
    assert lowest >= 200 and refused == 0, (lowest, refused)


def test_a_broker_slower_than_twice_the_budget_is_cut_even_with_the_floor() -> None:
    # 150 ms: past the 100 ms the overload goals allow a 2xx, the broker is in trouble; the
    # floor lifts the goal to 100 ms at most, so the limit falls as it did without it (once
    # Little's floor, from the 5 ms rate, has decayed: 15 s of it).
    lowest, refused = _slowdown(observe_sends=True, slow=0.150, seconds=15.0)
    assert lowest < 200 and refused > 0, (lowest, refused)


def test_the_gateways_own_queueing_never_raises_the_broker_floor() -> None:
    # The Little's-law convergence above, with every send 0.1 ms: the requests' latency is
    # the gateway's queueing, the sends' is not, so the limit settles where it did.
    lim, clock = _limiter(initial=3000, maximum=4096, target_latency=0.05)
    for _ in range(3):
        _window(lim, clock, 0.001)
    for _ in range(1000):
        admitted = _burst(lim, clock, 4000, 0.0001)
        for _ in range(admitted):
            lim.observe_send(0.0001)
    assert 900 <= lim.limit <= 1150, lim.limit
    assert lim.broker_floor < 0.001
