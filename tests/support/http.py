"""Raw HTTP/1.1 over a socket, for tests that must control every byte a client writes."""

from __future__ import annotations

import asyncio


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer's head (with its blank line) and body, read by its Content-Length, so
    nothing is left over: a partial or doubled write shows as a wrong length or stray bytes."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


async def exchange(
    port: int, raw: bytes, within: float = 15.0
) -> tuple[int, dict[str, str], bytes]:
    """Write `raw` on a new connection to 127.0.0.1:`port`; read one answer with a
    Content-Length: (status, lower-cased headers, body). Fails after `within` seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        try:
            writer.write(raw)
            await writer.drain()
        except ConnectionError:
            pass  # the server answered and closed before taking everything
        async with asyncio.timeout(within):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            body = await reader.readexactly(int(headers["content-length"]))
    finally:
        writer.close()
    return int(lines[0].split()[1]), headers, body
