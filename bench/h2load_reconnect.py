"""What h2load's open loop does after the server closes a connection: a check of the load
generator, not of the gateway.

The overload ladder paces h2load's clients with ``--rps`` over HTTP/1.1 (`bench.native`).
Under overload the gateway refuses some requests on their handler's path with ``503`` and
closes their connection; h2load then reconnects that client. Measured with h2load 1.52
(Debian's nghttp2-client), the client's count of requests in flight is then off, and it
either sends nothing more or sends every request it owes in one write: several requests
pipelined on one connection, which then wait behind each other in the server (the
overload bench flags a phase where that happened: "h2load pipelined").

This module shows it without the gateway: a raw asyncio server answers each odd-numbered
connection's first request ``503`` with ``Connection: close`` after 0.3 s (so the client
falls behind its schedule) and every other request ``201`` after 20 ms; h2load runs 4
clients at ``--rps 25``. It prints how many requests each read of the server held (1 for a
client of one request at a time), how many connections there were, and whether h2load
finished within its bound. Loopback only, bounded (15 s), stops by itself::

    python -m bench.h2load_reconnect
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import tempfile
from pathlib import Path

from bench.native import tool

CLIENTS = 4
REQUESTS = 200
RPS = 25
BOUND = 15.0  # seconds: h2load's run takes ~2 s when every request is answered


class _Server:
    """Counts the requests each read holds; closes odd connections after one 503."""

    def __init__(self) -> None:
        self.per_read: collections.Counter[int] = collections.Counter()
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        refuse_first = self.connections % 2 == 1
        buffer = b""
        served = 0
        try:
            while data := await reader.read(65536):
                buffer += data
                requests, buffer = _split(buffer)
                if not requests:
                    continue
                self.per_read[requests] += 1
                for _ in range(requests):
                    served += 1
                    if refuse_first and served == 1:
                        await asyncio.sleep(0.3)
                        writer.write(
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                            b"Connection: close\r\n\r\n"
                        )
                        await writer.drain()
                        return
                    await asyncio.sleep(0.02)
                    writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _split(buffer: bytes) -> tuple[int, bytes]:
    """How many whole requests `buffer` holds, and what is left of it."""
    count = 0
    while (end := buffer.find(b"\r\n\r\n")) >= 0:
        length = 0
        for line in buffer[:end].split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(buffer) < end + 4 + length:
            break
        buffer = buffer[end + 4 + length :]
        count += 1
    return count, buffer


async def check() -> tuple[_Server, bool]:
    """Run h2load against the server; whether it finished within `BOUND`."""
    server = _Server()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(b"x" * 100)
        proc = await asyncio.create_subprocess_exec(
            tool("h2load"),
            "--h1",
            "-c",
            str(CLIENTS),
            "-n",
            str(REQUESTS),
            "--rps",
            str(RPS),
            "-d",
            str(body),
            f"http://127.0.0.1:{port}/",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await asyncio.wait_for(proc.wait(), BOUND)
            finished = True
        except TimeoutError:
            finished = False
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            listening.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listening.wait_closed(), 1.0)
    return server, finished


def main() -> int:
    server, finished = asyncio.run(check())
    print(
        f"h2load --h1 --rps {RPS}, {CLIENTS} clients, {REQUESTS} requests; every odd "
        f"connection's first request answered 503 and closed: {server.connections} "
        f"connections; requests per read of the server: {dict(sorted(server.per_read.items()))} "
        f"(1: one request at a time; more: pipelined); h2load "
        + ("finished" if finished else f"had not finished after {BOUND:g} s (killed)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
