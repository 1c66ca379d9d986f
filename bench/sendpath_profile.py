"""The CPU of one unbatched send over a pooled sender link, in this process.

What `bench.entities_bench` spreads over many entities, without the HTTP edge and the
dispatcher: the local broker in its own process with `--entities` queues, one
`SdkNamespaceClient` (4 pooled connections) with a sender open to each, then `--sends` single
1 KB messages, `--concurrency` at a time, round-robin over the senders, each send awaited
settled. Prints this process's CPU (`time.process_time`) per cold open and per send;
`--profile FILE` writes a cProfile of the sends.

    .venv/bin/python -m bench.sendpath_profile [--entities 200] [--sends 20000] [--profile F]

Instructions per send, repeatable on a busy machine (the count for the sends only):

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.%p \
        .venv/bin/python -m bench.sendpath_profile --entities 50 --sends 1000 --callgrind sends
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import subprocess
import tempfile
import time
from pathlib import Path

from gateway.config import NamespaceSettings, Secret, TimeoutSettings
from gateway.core.message import OutboundMessage
from gateway.servicebus import internals
from gateway.servicebus.client import SdkNamespaceClient, SdkSender


async def _main(args: argparse.Namespace) -> None:
    from sblocal.testing import BrokerProcess

    with tempfile.TemporaryDirectory(prefix="sendpath-") as tmp:
        config = Path(tmp) / "broker.toml"
        lines = ['[[namespaces]]\nname = "primary"\n']
        lines += [f'[[namespaces.queues]]\npath = "q{i}"\n' for i in range(args.entities)]
        config.write_text("\n".join(lines))
        broker = BrokerProcess(config=config, startup_timeout=120)
        await broker.astart()
        try:
            ns = NamespaceSettings(
                name="primary", connection_string=Secret(broker.connection_string("primary"))
            )
            internals.install()  # as the app's wiring does: the pool shares connections
            client = SdkNamespaceClient(ns, TimeoutSettings(), connections=4)
            try:
                await _measure(client, args)
            finally:
                await client.close()
        finally:
            await broker.astop()


async def _measure(client: SdkNamespaceClient, args: argparse.Namespace) -> None:
    body = b"x" * 1024
    await (await client.open_sender("q0")).close()  # the pool's first connection
    opening = cProfile.Profile(time.process_time) if args.profile_opens else None
    t0 = time.process_time()
    if opening is not None:
        opening.enable()
    _callgrind(args, "on", "opens")
    senders: list[SdkSender] = []
    for i in range(args.entities):
        senders.append(await client.open_sender(f"q{i}"))
    _callgrind(args, "off", "opens")
    opens = time.process_time() - t0
    if opening is not None:
        opening.disable()
        opening.dump_stats(args.profile_opens)
    print(f"cold open: {opens / args.entities * 1e6:,.0f} µs CPU each ({args.entities} opens)")

    async def run(total: int) -> None:
        counter = iter(range(total))

        async def one() -> None:
            for i in counter:
                s = senders[i % len(senders)]
                await s.send([OutboundMessage(body=body, message_id=str(i))])

        await asyncio.gather(*(one() for _ in range(args.concurrency)))

    await run(len(senders) * 2)  # warm
    profile = cProfile.Profile(time.process_time) if args.profile else None
    t0, w0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    _callgrind(args, "on", "sends")
    await run(args.sends)
    _callgrind(args, "off", "sends")
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    print(
        f"send: {cpu / args.sends * 1e6:,.0f} µs CPU each ({args.sends:,} sends, "
        f"{args.sends / wall:,.0f}/s wall, {args.concurrency} at a time, "
        f"{len(senders)} senders)"
    )


def _callgrind(args: argparse.Namespace, state: str, phase: str) -> None:
    """Under `valgrind --tool=callgrind --instr-atstart=no`: count one phase only."""
    if args.callgrind == phase:
        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entities", type=int, default=200)
    parser.add_argument("--sends", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", default=None, help="a cProfile of the sends")
    parser.add_argument("--profile-opens", default=None, help="a cProfile of the opens")
    parser.add_argument(
        "--callgrind",
        choices=("sends", "opens"),
        default=None,
        help="switch callgrind's counting on for the sends, or the cold opens, only",
    )
    parser.add_argument("--sdk", action="store_true", help="the SDK's own send path only")
    args = parser.parse_args(argv)
    if args.sdk:
        from gateway.servicebus.internals import lean

        lean.usable = lambda sender: False
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
