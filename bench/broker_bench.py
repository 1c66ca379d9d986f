"""Throughput and CPU cost of the local broker (sblocal) under the real SDK.

    .venv/bin/python -m bench.broker_bench [--messages 20000] [--size 1024] [--senders 4]
                                           [--batch 100] [--receivers 4] [--json]

The broker runs as its own process (`sblocal.testing.BrokerProcess`) so that its CPU time,
read from /proc/<pid>/stat, is the broker's alone. Two phases on one queue:

1. send: ``--senders`` SDK senders in parallel, each sending batches of ``--batch`` messages;
2. receive + complete: ``--receivers`` peek-lock receivers (prefetch = batch), each message
   completed (the completes of one received batch are awaited together).

For each phase it prints messages per second (wall clock) and broker CPU seconds per message.
The SDK is the bottleneck on a 2-core machine; the broker's CPU share shows its headroom.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from bench.harness import parse_args
from sblocal.testing import BrokerProcess

QUEUE = "bench"


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    name: str
    messages: int
    seconds: float
    broker_cpu_seconds: float

    @property
    def per_second(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def cpu_per_message(self) -> float:
        return self.broker_cpu_seconds / self.messages if self.messages else 0.0

    def line(self) -> str:
        share = self.broker_cpu_seconds / self.seconds * 100 if self.seconds else 0.0
        return (
            f"{self.name:<22} {self.messages:>7} msgs in {self.seconds:6.2f} s = "
            f"{self.per_second:8.0f} msgs/s; broker CPU {self.broker_cpu_seconds:6.2f} s "
            f"= {self.cpu_per_message * 1e6:6.1f} us/msg "
            f"({share:4.0f}% of a core)"
        )


def _client(conn_str: str) -> ServiceBusClient:
    return ServiceBusClient.from_connection_string(conn_str, retry_total=3)


async def _send_phase(conn_str: str, pid: int, args: argparse.Namespace) -> Phase:
    body = b"x" * args.size
    per_sender = args.messages // args.senders
    batches = per_sender // args.batch
    async with _client(conn_str) as client:
        senders = [client.get_queue_sender(QUEUE) for _ in range(args.senders)]
        for s in senders:
            await s.__aenter__()
        try:
            # Warm-up: one batch per sender (not measured, received in the next phase).
            await asyncio.gather(
                *(s.send_messages([ServiceBusMessage(body)] * args.batch) for s in senders)
            )

            async def run(sender: object) -> None:
                for _ in range(batches):
                    batch = [ServiceBusMessage(body) for _ in range(args.batch)]
                    await sender.send_messages(batch)  # type: ignore[attr-defined]

            cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
            await asyncio.gather(*(run(s) for s in senders))
            seconds, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
        finally:
            for s in senders:
                await s.close()
    return Phase("send (batches)", batches * args.batch * args.senders, seconds, cpu)


async def _receive_phase(conn_str: str, pid: int, args: argparse.Namespace, total: int) -> Phase:
    done = 0
    lock = asyncio.Lock()
    async with _client(conn_str) as client:
        receivers = [
            client.get_queue_receiver(QUEUE, prefetch_count=args.batch)
            for _ in range(args.receivers)
        ]
        for r in receivers:
            await r.__aenter__()

        async def run(receiver: object) -> None:
            nonlocal done
            while True:
                async with lock:
                    if done >= total:
                        return
                msgs = await receiver.receive_messages(  # type: ignore[attr-defined]
                    max_message_count=args.batch, max_wait_time=1
                )
                if not msgs:
                    async with lock:
                        if done >= total:
                            return
                    continue
                await asyncio.gather(*(receiver.complete_message(m) for m in msgs))  # type: ignore[attr-defined]
                async with lock:
                    done += len(msgs)

        try:
            cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
            async with asyncio.timeout(600):
                await asyncio.gather(*(run(r) for r in receivers))
            seconds, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
        finally:
            for r in receivers:
                await r.close()
    return Phase("receive + complete", done, seconds, cpu)


async def main(args: argparse.Namespace) -> list[Phase]:
    async with BrokerProcess() as broker:
        assert broker.pid is not None
        await broker.control.create_entity(
            "primary", QUEUE, "queue", {"max_size_in_megabytes": 5120}
        )
        conn_str = broker.connection_string("primary")
        send = await _send_phase(conn_str, broker.pid, args)
        stored = (await broker.control.entity("primary", QUEUE))["active"]
        receive = await _receive_phase(conn_str, broker.pid, args, stored)
        idle0 = _cpu_seconds(broker.pid)
        await asyncio.sleep(1.0)
        idle = Phase("idle (1 s)", 0, 1.0, _cpu_seconds(broker.pid) - idle0)
    return [send, receive, idle]


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.broker_bench", description=__doc__)
    p.add_argument("--messages", type=int, default=20000, help="messages in the send phase")
    p.add_argument("--size", type=int, default=1024, help="body size in bytes")
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--receivers", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print one JSON line instead")
    return parse_args(p, argv, {"messages": 5000})


def run(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    phases = asyncio.run(main(args))
    if args.json:
        print(
            json.dumps(
                [
                    asdict(p) | {"per_second": p.per_second, "cpu_per_message": p.cpu_per_message}
                    for p in phases
                ]
            )
        )
        return
    print(
        f"sblocal broker bench: {args.size} B messages, {args.senders} senders x batches of "
        f"{args.batch}, {args.receivers} receivers (prefetch {args.batch}), {os.cpu_count()} CPUs"
    )
    for p in phases:
        print(p.line())


if __name__ == "__main__":
    run()
