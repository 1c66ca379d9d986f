"""What a kept-alive connection holds while it idles between requests.

    .venv/bin/python -m bench.idle_objects [--connections 200]

Serves the gateway's app (null sink) in this process with its hardened connection handler,
opens `--connections` raw keep-alive connections, sends one request on each and reads the
answer, and counts the cycle collector's tracked objects by type before the requests and
after them (each count after a full collection): what every idle connection keeps of its
last request. Counts, not times: the same on a busy machine. Those objects matter under
load because the collector walks every one of them that outlives a young collection
(docs/performance-results.md, "What an idle connection holds").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
from collections import Counter

from bench.harness import IN_MEMORY_ENV

BODY = b'{"n": 1}' * 16


def _tracked() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


async def measure(connections: int) -> tuple[float, list[tuple[str, float]]]:
    """Tracked objects per idle connection after one request, and the commonest types."""
    os.environ.update(IN_MEMORY_ENV)
    from bench.gateway_server import gateway_app, gateway_runner
    from gateway.web.listener import ShedSite

    app, settings = gateway_app("null")
    runner = gateway_runner(app, settings)
    await runner.setup()
    site = ShedSite(runner, "127.0.0.1", 0)
    await site.start()
    loop = asyncio.get_running_loop()
    port = runner.addresses[0][1]
    head = (
        f"POST /queues/orders/messages HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    )
    request = head.encode() + BODY
    socks: list[socket.socket] = []

    async def connect() -> socket.socket:
        s = socket.socket()
        s.setblocking(False)
        await loop.sock_connect(s, ("127.0.0.1", port))
        socks.append(s)
        return s

    async def one(s: socket.socket) -> None:
        await loop.sock_sendall(s, request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await loop.sock_recv(s, 65536)
            if not chunk:
                raise ConnectionError("closed before an answer")
            data += chunk
        if not data.startswith(b"HTTP/1.1 201"):
            raise RuntimeError(data.split(b"\r\n", 1)[0].decode())

    try:
        async with asyncio.timeout(60):
            await one(await connect())  # warm the app's caches on a connection of its own
            idle = [await connect() for _ in range(connections)]
            await asyncio.sleep(0.2)  # the server's side of each connect, all made
            before = _tracked()
            await asyncio.gather(*(one(s) for s in idle))
            await asyncio.sleep(0.2)  # every answer's loop back to idle
            after = _tracked()
    finally:
        for s in socks:
            s.close()
        await runner.cleanup()
    held = after - before
    per = [(name, count / connections) for name, count in held.most_common(12)]
    return sum(held.values()) / connections, per


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_objects", description=__doc__)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="the same (it takes a second)")
    args = parser.parse_args(argv)
    total, per = asyncio.run(measure(args.connections))
    print(f"tracked objects an idle kept-alive connection holds of its last request: {total:.1f}")
    print("  " + ", ".join(f"{name} {count:.2f}" for name, count in per))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
