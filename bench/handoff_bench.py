"""The dispatcher's hand-off alone: CPU per request and requests per batch, in process.

    .venv/bin/python -m bench.handoff_bench [--requests 40000]

One lane ("orders") grown to several workers, a sender that settles every send at once (no
broker, no HTTP edge), then `clients` concurrent callers, each sending one message, awaiting
it settled and yielding 0 to `stagger - 1` loop ticks (seeded) before the next, so requests
reach the lane spread over the loop's turns as they do from sockets. Prints the CPU
(`time.process_time`, the best of 5) per request, the client loop included, and the
requests per broker batch. Compare checkouts by running it from each (`PYTHONPATH`), one
after the other: the batch sizes must match where the hand-off only got cheaper.
Nothing here is part of `make test`; `python -m bench` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence

from bench.harness import parse_args
from gateway.config import LimitSettings, TimeoutSettings
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.message import OutboundMessage

# (callers, stagger): a lone caller (its lane idle at each request), a few, and P1's 64.
SHAPES = ((1, 1), (8, 8), (64, 8))


class _Sender:
    def __init__(self, client: _Client) -> None:
        self._client = client

    async def send(self, messages: Sequence[OutboundMessage]) -> None:
        self._client.operations += 1
        if self._client.hold:  # while the lane grows: each send takes a while
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        return None


class _Client:
    name = "primary"

    def __init__(self) -> None:
        self.operations = 0
        self.hold = True

    async def open_sender(self, path: str) -> _Sender:
        return _Sender(self)

    async def close(self) -> None:
        return None


async def run(clients: int, stagger: int, requests: int) -> tuple[float, float]:
    """CPU µs per request (best of 5) and requests per batch."""
    d = Dispatcher(LimitSettings(sender_idle_timeout=600), TimeoutSettings())
    client = _Client()
    dest = Destination(client, "orders")  # type: ignore[arg-type]
    one = [OutboundMessage(body=b"x" * 100, message_id="1")]

    async def grow() -> None:
        for _ in range(40):
            await d.send(dest, one)

    await asyncio.gather(*(grow() for _ in range(8)))
    client.hold = False
    rnd = random.Random(1)

    async def caller(n: int) -> None:
        for _ in range(n):
            await d.send(dest, one)
            for _ in range(rnd.randrange(stagger)):
                await asyncio.sleep(0)

    best, batch = float("inf"), 0.0
    for _ in range(5):
        ops, started = client.operations, time.process_time()
        await asyncio.gather(*(caller(requests // clients) for _ in range(clients)))
        best = min(best, (time.process_time() - started) / requests * 1e6)
        batch = requests / (client.operations - ops)
    await d.close(1.0)
    return best, batch


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40_000)
    args = parse_args(parser, argv, {"requests": 4_000})
    for clients, stagger in SHAPES:
        us, batch = asyncio.run(run(clients, stagger, args.requests))
        print(
            f"{clients:3d} callers (stagger {stagger}): {us:6.2f} µs of CPU a request, "
            f"{batch:5.1f} requests a batch"
        )


if __name__ == "__main__":
    main()
