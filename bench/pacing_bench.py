"""A lane's sends paced over the broker's round trip, against the same lane unpaced, in process.

    .venv/bin/python -m bench.pacing_bench [--quick] [--seconds 5]

One lane (the dispatcher's defaults: 8 senders, batches of up to 100), a fake broker that
stores each batch after a fixed round trip (an `asyncio.sleep`), and requests arriving as a
Poisson process at a fixed rate (seeded), each one message, each awaited settled. For each
round trip and rate, the lane is run twice in the same process, paced (the dispatcher as it
ships) and unpaced (its gap forced to 0, so a worker back from a send takes at once), and
the request latency of the second half of the run (the lane grown and its round trip
learnt) is printed with the ratio paced / unpaced, and the spread of the batch starts (the
gaps between consecutive ones: unpaced, most are under a millisecond and one in eight is
nearly a round trip). Nothing here is part of `make test`; the figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections.abc import Sequence

from bench.harness import parse_args
from gateway.config import LimitSettings, TimeoutSettings
from gateway.core import dispatcher
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.message import OutboundMessage

# (round trip seconds, requests a second): a fast broker, a slower one, the ladder's
# broker x10 (50 ms) at half and at most of the rate one lane of 8 x 100 carries.
SHAPES = ((0.005, 6000), (0.02, 6000), (0.05, 6000), (0.05, 12000))


class _Broker:
    name = "primary"

    def __init__(self, rtt: float) -> None:
        self.rtt = rtt
        self.starts: list[float] = []

    async def open_sender(self, path: str) -> _Broker:
        return self

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        self.starts.append(time.monotonic())
        await asyncio.sleep(self.rtt)

    async def close(self) -> None:
        return None


def _at(values: list[float], q: float) -> float:
    return values[int(q * (len(values) - 1))] if values else float("nan")


async def run(rtt: float, rate: float, seconds: float, paced: bool) -> tuple[float, float, float]:
    """p50 and p99 latency (ms) of the second half's requests, and the share of the second
    half's batch starts less than a millisecond after the one before."""
    saved = dispatcher.MAX_PACE
    dispatcher.MAX_PACE = saved if paced else 0.0
    try:
        broker = _Broker(rtt)
        d = Dispatcher(LimitSettings(sender_idle_timeout=600), TimeoutSettings())
        dest = Destination(broker, "orders")  # type: ignore[arg-type]
        one = [OutboundMessage(body=b"x" * 100, message_id="1")]
        took: list[tuple[float, float]] = []

        async def request() -> None:
            sent = time.monotonic()
            await d.send(dest, one)
            took.append((sent, time.monotonic() - sent))

        rnd = random.Random(1)
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        due = start
        while (now := time.monotonic()) - start < seconds:
            while due <= now:
                due += rnd.expovariate(rate)
                task = asyncio.ensure_future(request())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.001)  # arrivals in millisecond steps
        await asyncio.gather(*tasks)
        await d.close(1.0)
    finally:
        dispatcher.MAX_PACE = saved
    half = start + seconds / 2
    late = sorted(t for sent, t in took if sent >= half)
    starts = [s for s in broker.starts if s >= half]
    close = sum(1 for a, b in itertools.pairwise(starts) if b - a < 0.001)
    return _at(late, 0.5) * 1e3, _at(late, 0.99) * 1e3, close / max(1, len(starts) - 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per lane run (5)")
    args = parse_args(parser, argv, {"seconds": 2.0})
    print("round trip, rate | unpaced p50 / p99 ms, starts < 1 ms apart | paced | p99 ratio")
    for rtt, rate in SHAPES:
        u50, u99, uclose = asyncio.run(run(rtt, rate, args.seconds, paced=False))
        p50, p99, pclose = asyncio.run(run(rtt, rate, args.seconds, paced=True))
        print(
            f"{rtt * 1e3:4.0f} ms, {rate:6,.0f}/s | {u50:5.1f} / {u99:5.1f}, {uclose:4.0%} | "
            f"{p50:5.1f} / {p99:5.1f}, {pclose:4.0%} | {p99 / u99:.2f}"
        )


if __name__ == "__main__":
    main()
