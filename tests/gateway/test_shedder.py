"""The shedder's counts and decisions (pure logic; the protocol is tested over sockets in
tests/security/test_shedding.py)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.web.overload import (
    MIN_LIMIT,
    LimitSource,
    OverloadLimits,
    PauseReason,
    Shedder,
    ShedReason,
)


def _shedder(
    connections: int = 0, in_progress: int = 0, wait: float = 0.0
) -> tuple[Shedder, list[ShedReason]]:
    shed: list[ShedReason] = []
    limits = OverloadLimits(connections, in_progress, wait, retry_after=3.0)
    return Shedder(limits, shed.append), shed


@given(
    st.lists(st.sampled_from(["open", "close", "admit", "done"]), max_size=200), st.integers(0, 5)
)
def test_counts_never_pass_the_caps_and_every_refusal_is_counted(ops: list[str], cap: int) -> None:
    shedder, shed = _shedder(connections=cap, in_progress=cap)
    open_, running, refused = 0, 0, 0
    for op in ops:
        if op == "open":
            if shedder.connection_opened():
                open_ += 1
            else:
                refused += 1
        elif op == "close" and open_:
            shedder.connection_closed()
            open_ -= 1
        elif op == "admit":
            if shedder.admit(0.0) is None:
                running += 1
            else:
                refused += 1
        elif op == "done" and running:
            shedder.done()
            running -= 1
        assert (shedder.connections, shedder.in_progress) == (open_, running)
        if cap:
            assert open_ <= cap and running <= cap
    assert len(shed) == refused
    if not cap:
        assert refused == 0


def test_a_head_that_waited_too_long_is_refused_and_not_counted() -> None:
    shedder, shed = _shedder(wait=0.5)
    assert shedder.admit(0.5) is None
    assert shedder.admit(0.51) == "head_wait"
    assert (shedder.in_progress, shed) == (1, ["head_wait"])


def test_the_raw_answer_is_a_complete_503_with_a_fresh_request_id() -> None:
    shedder, _ = _shedder(connections=1)
    first, second = shedder.raw_503(), shedder.raw_503()
    head, _, body = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"Retry-After: 3\r\n" in head and b"Connection: close" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert b'"error":"overloaded"' in body
    assert first != second  # X-Request-Id


class _Listener:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reasons: list[PauseReason] = []

    def pause(self, reason: PauseReason) -> None:
        self.calls.append("pause")
        self.reasons.append(reason)

    def resume(self) -> None:
        self.calls.append("resume")


def test_the_listener_pauses_at_the_cap_and_resumes_a_tenth_under_it() -> None:
    shedder, shed = _shedder(connections=20)
    listener = _Listener()
    shedder.attach(listener)
    for _ in range(19):
        assert shedder.connection_opened()
    assert listener.calls == [] and not shedder.paused
    assert shedder.connection_opened()  # the 20th reaches the cap: no more listening
    assert listener.calls == ["pause"] and shedder.paused
    assert listener.reasons == ["connections"]
    assert not shedder.connection_opened(), "accepted before the pause: refused with a 503"
    assert shed == ["connections"]
    shedder.connection_closed()  # 19: still over the mark
    assert listener.calls == ["pause"]
    shedder.connection_closed()  # 18: 90% of the cap
    assert listener.calls == ["pause", "resume"] and not shedder.paused
    shedder.connection_closed()
    assert listener.calls == ["pause", "resume"], "resumed once"


def test_without_a_connection_cap_the_listener_never_pauses() -> None:
    shedder, _ = _shedder(connections=0)
    listener = _Listener()
    shedder.attach(listener)
    for _ in range(100):
        assert shedder.connection_opened()
    for _ in range(100):
        shedder.connection_closed()
    assert listener.calls == []


def test_a_lagging_loop_pauses_the_listener_after_two_late_samples_and_resumes_under_half() -> None:
    limits = OverloadLimits(0, 0, 0.0, retry_after=1.0, max_loop_lag=0.2)
    shedder = Shedder(limits)
    listener = _Listener()
    shedder.attach(listener)
    shedder.loop_sampled(0.5)  # one late turn: a hiccup
    assert listener.calls == []
    shedder.loop_sampled(0.01)
    shedder.loop_sampled(0.3)
    shedder.loop_sampled(0.3)  # late twice in a row: behind
    assert listener.calls == ["pause"] and shedder.lagging
    assert listener.reasons == ["loop_lag"]
    shedder.loop_sampled(0.15)  # better, not yet under half the bound
    assert listener.calls == ["pause"]
    shedder.loop_sampled(0.05)
    assert listener.calls == ["pause", "resume"] and not shedder.lagging


def test_connections_are_taken_at_once_only_while_requests_have_room() -> None:
    limits = OverloadLimits(0, 4, 0.0, retry_after=1.0, max_loop_lag=0.2)
    shedder = Shedder(limits)
    shedder.attach(_Listener())
    assert shedder.has_room()
    assert shedder.admit_head()
    assert shedder.has_room()  # 1 of 4: under half
    assert shedder.admit_head()
    assert not shedder.has_room()  # half the limit in progress
    shedder.done()
    assert shedder.has_room()
    shedder.loop_sampled(0.3)
    shedder.loop_sampled(0.3)  # the loop behind
    assert not shedder.has_room()
    unlimited = Shedder(OverloadLimits(0, 0, 0.0, retry_after=1.0))
    assert unlimited.admit_head() and unlimited.has_room()


def test_the_listener_stays_paused_while_either_rule_holds() -> None:
    limits = OverloadLimits(2, 0, 0.0, retry_after=1.0, max_loop_lag=0.2)
    shedder = Shedder(limits)
    listener = _Listener()
    shedder.attach(listener)
    shedder.loop_sampled(0.3)
    shedder.loop_sampled(0.3)
    assert shedder.connection_opened() and shedder.connection_opened()  # at the cap too
    shedder.loop_sampled(0.0)  # no longer late, but still at the cap
    assert listener.calls[-1] == "pause"
    shedder.connection_closed()
    assert listener.calls[-1] == "resume"


def test_the_adaptive_in_progress_limit_is_floored_by_littles_law_within_its_bounds() -> None:
    now = [0.0]
    shed: list[ShedReason] = []
    limits = OverloadLimits(0, 1000, 1.0, retry_after=1.0, target_latency=0.05, tolerance=1.5)
    shedder = Shedder(limits, shed.append, clock=lambda: now[0])
    assert shedder.limit == 1000  # no source: the cap
    source: list[LimitSource | None] = [(10, None, 0.0)]
    shedder.attach_limit(lambda: source[0])
    assert shedder.limit == MIN_LIMIT  # nothing completed yet: the floor

    def quarter_second_of(n: int) -> None:
        # n requests done in a quarter of a second, MIN_LIMIT at a time.
        for _ in range(n // MIN_LIMIT):
            for _ in range(MIN_LIMIT):
                assert shedder.admit_head()
            now[0] += 0.25 / (n // MIN_LIMIT)
            for _ in range(MIN_LIMIT):
                shedder.done()

    quarter_second_of(2048)  # ~8,000 a second
    assert 7000 < shedder.peak_rate <= 8200
    assert shedder.limit == int(shedder.peak_rate * 0.05)  # x 50 ms, over the namespaces' 10
    # The broker is slower: 60 ms learned, x 1.5: the floor rises to keep the rate.
    source[0] = (10, 0.06, 0.0)
    quarter_second_of(2048)
    assert shedder.limit == int(shedder.peak_rate * 0.06 * 1.5) > 700
    # The namespaces' limits above the floor are the limit; the cap bounds everything.
    source[0] = (900, 0.06, 0.0)
    quarter_second_of(2048)
    assert shedder.limit == 900
    source[0] = (5000, 10.0, 0.0)
    quarter_second_of(2048)
    assert shedder.limit == 1000
    source[0] = None
    quarter_second_of(2048)
    assert shedder.limit == 1000


def test_admission_at_the_head_counts_refuses_and_sheds_a_late_handler() -> None:
    shed: list[ShedReason] = []
    shedder = Shedder(OverloadLimits(0, 2, 0.5, retry_after=3.0), shed.append)
    assert shedder.admit_head() and shedder.admit_head()
    assert not shedder.admit_head()
    assert shed == ["in_progress"] and shedder.in_progress == 2
    assert shedder.admitted_at_head(0.1) is None  # in time: still counted
    assert shedder.admitted_at_head(0.6) == "head_wait"  # late: uncounted, shed
    assert shedder.in_progress == 1 and shed == ["in_progress", "head_wait"]
    shedder.done()
    assert shedder.in_progress == 0


@pytest.mark.parametrize("keep_alive", [True, False])
def test_the_pre_encoded_503_is_one_complete_response(keep_alive: bool) -> None:
    shedder = Shedder(OverloadLimits(0, 1, 0.0, retry_after=3.0))
    raw = shedder.raw_503_in_progress(keep_alive=keep_alive)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 503 Service Unavailable"
    fields = dict(line.split(b": ", 1) for line in lines[1:])
    assert fields[b"Retry-After"] == b"3"
    assert int(fields[b"Content-Length"]) == len(body)
    assert orjson.loads(body)["error"] == "overloaded"
    assert (b"Connection" in fields) is not keep_alive


def test_the_in_progress_limit_follows_the_heads_latency_under_its_ceiling() -> None:
    """Over the latency goal two windows in a row, the limit falls toward Little's law at the
    goal (no faster than a fifth a window); near it, it grows back gradually; far under it,
    it is the ceiling (the namespaces' limits, Little's floor, the cap) as without the rule.
    A slower broker raises the goal, and the limit with it, instead of cutting."""
    now = [0.0]
    limits = OverloadLimits(0, 400, 1.0, retry_after=1.0, latency_goal=0.025, tolerance=1.5)
    shedder = Shedder(limits, clock=lambda: now[0])
    source: list[LimitSource | None] = [(1000, 0.004, 0.005)]
    shedder.attach_limit(lambda: source[0])

    def window(n: int, latency: float) -> None:
        # A quarter of a second of `n` answers, each `latency` long (steps of 2**-13 s:
        # exact in binary, so the window ends at the last answer).
        shedder.in_progress += n  # admitted earlier (whether the limit let them is not tested)
        for _ in range(n):
            now[0] += 0.25 / n
            shedder.done(latency)

    window(2048, 0.005)  # fast: the ceiling (the cap, under the namespaces' 1,000)
    assert shedder.limit == 400
    window(2048, 0.060)  # over the goal once: a hiccup, nothing cut
    assert shedder.limit == 400
    window(2048, 0.060)  # twice: a fifth off, not yet Little's 8,192/s x 25 ms = 204
    assert shedder.limit == int(400 * 0.8)
    cuts = [shedder.limit]
    for _ in range(5):
        window(2048, 0.060)
        cuts.append(shedder.limit)
    assert cuts == sorted(cuts, reverse=True) and cuts[-1] == 204  # settled at Little's
    window(2048, 0.020)  # near the goal: grown by a quarter, not back to the ceiling
    assert shedder.limit == int(204 * 1.25)
    # The broker's fastest send is now 20 ms: the goal is 30 ms, and the limit moves with it
    # at once (the same rate at 30 ms takes 1.2 times the requests in progress), then grows.
    source[0] = (1000, 0.004, 0.020)
    window(2048, 0.020)
    goal = 1.5 * 0.020
    assert shedder.latency_goal == goal
    assert shedder.limit == int(int(204 * 1.25) * goal / 0.025 * 1.25)
    window(2048, 0.005)  # far under it: the ceiling again
    assert shedder.limit == 400
    # A latency no limit brings down (the rate falls with each cut): the cuts stop at half
    # the ceiling.
    for _ in range(20):
        window(256, 0.5)
    assert shedder.limit == 400 // 2
    # Too few answers to tell: the ceiling.
    window(16, 0.5)
    assert shedder.latency is None and shedder.limit == 400


def test_without_a_latency_goal_the_limit_is_the_ceiling_whatever_the_latency() -> None:
    now = [0.0]
    shedder = Shedder(OverloadLimits(0, 400, 1.0, retry_after=1.0), clock=lambda: now[0])
    shedder.attach_limit(lambda: (1000, 0.004, 0.005))
    for _ in range(10):  # a second of answers, each half a second long
        shedder.in_progress += 256
        for _ in range(256):
            now[0] += 0.25 / 256
            shedder.done(0.5)
    assert shedder.latency == 0.5 and shedder.limit == 400  # measured, not acted on
