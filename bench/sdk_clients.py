"""The SDK baselines of P2-P4, in their own process: sending without the gateway.

    python -m bench.sdk_clients naive --conn "<connection string>" --queue orders --duration 5
    python -m bench.sdk_clients batch --conn "..." --queue orders --senders 4 --batch 100
    python -m bench.sdk_clients naive --conn "..." --queue orders --count 100   # P4

* ``naive``: one sender, one awaited ``send_messages`` per message, one after the other —
  the straightforward client the gateway must beat (P2) and seed 003's sequential table (P4).
* ``batch``: ``--senders`` senders in parallel in one asyncio process, each sending lists of
  ``--batch`` new messages in a loop — the SDK's own throughput ceiling without HTTP (P3).

Messages carry a 1 KB JSON body (the same document the HTTP load generator posts), a
MessageId and the content type. Senders are opened (and used once) before ``START``.
Protocol on stdout: ``START``, ``END``, ``RESULT <json>`` (see `bench.harness`).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
import uuid
from typing import Any

import orjson
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender

from bench.harness import emit, pin_self_from_env, run_fast
from bench.loadgen import make_body


def _message(body: bytes) -> ServiceBusMessage:
    return ServiceBusMessage(body, message_id=uuid.uuid4().hex, content_type="application/json")


class _Clock:
    """The measurement window: a deadline (duration mode) or a message budget (count)."""

    def __init__(self, duration: float, count: int | None) -> None:
        self.duration = duration
        self.count = count
        self.sent = 0
        self.deadline = 0.0

    def open(self) -> None:
        self.deadline = time.perf_counter() + self.duration

    def more(self) -> bool:
        if self.count is not None:
            return self.sent < self.count
        return time.perf_counter() < self.deadline


async def _naive(sender: ServiceBusSender, body: bytes, clock: _Clock) -> None:
    while clock.more():
        await sender.send_messages(_message(body))
        clock.sent += 1


async def _batches(sender: ServiceBusSender, body: bytes, size: int, clock: _Clock) -> None:
    while clock.more():
        n = size if clock.count is None else min(size, clock.count - clock.sent)
        clock.sent += n  # claimed before the await, so parallel senders do not overshoot
        await sender.send_messages([_message(body) for _ in range(n)])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    body = make_body(args.body_size)
    senders_n = 1 if args.mode == "naive" else args.senders
    async with ServiceBusClient.from_connection_string(args.conn) as client:
        senders = [client.get_queue_sender(args.queue) for _ in range(senders_n)]
        for s in senders:
            await s.__aenter__()
        try:
            # Warm every link with one message, so opening costs stay out of the window.
            await asyncio.gather(*(s.send_messages(_message(body)) for s in senders))
            clock = _Clock(args.duration, args.count)
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            emit("START")
            started = time.perf_counter()
            clock.open()
            async with asyncio.timeout(args.duration + args.grace):
                if args.mode == "naive":
                    await _naive(senders[0], body, clock)
                else:
                    await asyncio.gather(*(_batches(s, body, args.batch, clock) for s in senders))
            elapsed = time.perf_counter() - started
            emit("END")
            usage1 = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            for s in senders:
                await s.close()
    return {
        "messages": clock.sent,
        "elapsed": elapsed,
        "rate": clock.sent / elapsed if elapsed > 0 else 0.0,
        "cpu_s": (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime),
    }


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("naive", "batch"))
    parser.add_argument("--conn", required=True, help="the namespace's connection string")
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--duration", type=float, default=5.0, help="window (or deadline)")
    parser.add_argument("--count", type=int, help="send exactly this many messages")
    parser.add_argument("--grace", type=float, default=30.0, help="extra time before giving up")
    parser.add_argument("--body-size", type=int, default=1024)
    args = parser.parse_args(argv)
    if "127.0.0.1" not in args.conn and "localhost" not in args.conn:
        raise SystemExit("refusing to send anywhere but the local broker")
    result = run_fast(lambda: run(args))
    emit("RESULT " + orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
