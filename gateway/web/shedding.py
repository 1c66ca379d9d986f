"""Admission at the request head: each request counted, or refused, as its head is parsed.

`gateway.web.overload` says why; this is where, for the main app's connections
(`HardenedAppRunner` builds them; the probe port's are plain `HardenedRequestHandler`s).
`ShedRequestHandler.data_received` lets aiohttp's C parser split the bytes into requests, then
looks at each new one before aiohttp's ``start()`` sees it:

* under the limit, it is counted in progress at once (`Shedder.admit_head`), so that heads
  parsed in the same turn of a busy loop see each other (a handler starts two turns later);
* at the limit, if the connection is idle (``start()`` waits for a head: nothing queued,
  nothing being answered, so no answer can overtake another) and the body is already in,
  it is removed from the queue and pre-encoded ``503 overloaded`` bytes are written: no
  request object, no task, no handler, and the connection stays open. Otherwise it is left
  to the handler path (`HardenedRequestHandler._handle_request`), which refuses it before
  reading its body and closes the connection.

Cheaper still, and first: while the process is at its limit, bytes arriving on an idle
connection with nothing of a head buffered are looked at before aiohttp parses them
(`_refuse_raw`). If they are exactly one whole ``HTTP/1.1`` request whose framing is beyond
doubt (CRLF line ends only, one ``Content-Length`` of digits or none, no
``Transfer-Encoding``, ``Connection``, ``Upgrade`` or ``Expect`` field, the body complete and
nothing after it, the head within ``max_header_bytes``, not an exempt route), they are
answered ``503 overloaded`` at once and never parsed: the connection is left at a request
boundary, as aiohttp would have left it, so the client's next request is read as usual.
Anything else goes to the parser, as above. A request refused unparsed is not validated
(a malformed one gets the 503, not a 400): an overloaded process owes it no more.

A request counted here that never reaches its handler (the connection is lost first) is
uncounted in `connection_lost`.

**aiohttp's private names used here**, beyond `gateway.web.protocol`'s (guarded the same
way): `BaseRequest._message` (the parsed head a request was made from); `RequestHandler`'s
``_waiter`` (woken only once the new requests are looked at),
``_messages``, ``_parser`` (``message_consumed``, a parser slot freed for a removed request),
``_keepalive_timeout``, ``_next_keepalive_close_time`` and ``_keepalive_handle`` (a
connection answered only by refusals is still closed when idle), ``_process_keepalive``;
and `HardenedRequestHandler`'s ``_head_deadline`` (None: no head begun) and
``_open_bodies``.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import HttpVersion11
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.web.overload import Shedder, ShedReason, exempt
from gateway.web.protocol import Deadlines, HardenedRequestHandler, HardenedServer


class ShedRequestHandler(HardenedRequestHandler):
    """`HardenedRequestHandler` that admits or refuses each request at its head."""

    __slots__ = ("_admitted",)

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        # Requests counted in progress at their head, not yet at their handler, in order.
        self._admitted: deque[RawRequestMessage] = deque()

    def data_received(self, data: bytes) -> None:
        shedder = self._shedder
        if shedder is None or self._force_close or self._close or self._upgraded:
            super().data_received(data)
            return
        before = len(self._messages)
        waiter = self._waiter
        idle = waiter is not None and not waiter.done()
        if (
            idle
            and self._head_deadline is None  # nothing of a head buffered in the parser
            and not self._open_bodies
            and shedder.at_limit()
            and self._refuse_raw(data, shedder)
        ):
            return
        if idle:
            # start() is woken below, once the new requests are seen; meanwhile aiohttp wakes
            # (and a refusal cancels) a stand-in, which still says start() is idle.
            self._waiter = self._loop.create_future()
        try:
            super().data_received(data)
        finally:
            if idle:
                self._waiter = waiter
        if len(self._messages) > before and not self._force_close:
            self._at_heads(shedder, before, idle)
        if idle and waiter is not None and not waiter.done():
            if self._force_close or self._close:
                waiter.cancel()  # as force_close() and close() do
            elif self._messages:
                waiter.set_result(None)

    def _refuse_raw(self, data: bytes, shedder: Shedder) -> bool:
        """Refuse `data` unparsed, if it is exactly one whole request whose framing is
        beyond doubt (see the module docstring); False (nothing done) otherwise."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > self._deadlines.max_head_bytes:
            return False
        line_end = data.find(b"\r\n")
        line = data[:line_end]
        if not line.endswith(b" HTTP/1.1"):
            return False
        head = data[line_end : end + 2].lower()  # every field line, each after a CRLF
        if head.count(b"\n") != head.count(b"\r\n") or _NOT_PLAIN.search(head) is not None:
            return False
        at = head.find(b"\r\ncontent-length:")
        length = 0
        if at >= 0:
            if head.find(b"\r\ncontent-length:", at + 2) >= 0:
                return False  # repeated: aiohttp's 400, not ours to frame
            value = head[at + 17 : head.find(b"\r\n", at + 2)].strip(b" \t")
            if not value.isdigit():
                return False
            length = int(value)
        if len(data) != end + 4 + length:
            return False  # a body still to come, or more requests behind it
        target = line[line.find(b" ") + 1 : -9]
        if exempt(target.partition(b"?")[0].decode("latin-1")):
            return False
        transport = self.transport
        if transport is None:
            return False
        transport.write(shedder.raw_503_in_progress(keep_alive=True))
        shedder.refused()
        self._kept_alive()
        return True

    def _at_heads(self, shedder: Shedder, first: int, idle: bool) -> None:
        """Count or refuse the requests queued from index `first` on (see the module
        docstring)."""
        messages = self._messages
        i = first
        while i < len(messages):
            message, payload = messages[i]
            if not isinstance(message, RawRequestMessage) or exempt(message.url.path):
                i += 1
                continue
            if shedder.admit_head():
                self._admitted.append(message)
                i += 1
                continue
            transport = self.transport
            if not (idle and i == 0 and payload.is_eof() and transport is not None):
                return  # the handler path refuses it, and decides for those behind it
            if message.version != HttpVersion11:
                return  # HTTP/1.0 keep-alive rules: leave it to aiohttp's writer
            messages.popleft()
            if self._heads:
                self._heads.popleft()
            if self._parser is not None:
                self._parser.message_consumed()
            keep = not message.should_close
            transport.write(shedder.raw_503_in_progress(keep_alive=keep))
            if not keep:
                self.force_close()
                return
            self._kept_alive()

    def _kept_alive(self) -> None:
        """A request was answered here: the keep-alive deadline moves on, as after one
        answered by a handler."""
        timeout = self._keepalive_timeout
        if timeout > 0:
            close_time = self._loop.time() + timeout
            self._next_keepalive_close_time = close_time
            if self._keepalive_handle is None:
                self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)

    def _admit(self, request: BaseRequest, waited: float) -> ShedReason | None:
        admitted = self._admitted
        shedder = self._shedder
        assert shedder is not None
        if admitted and admitted[0] is request._message:
            admitted.popleft()
            return shedder.admitted_at_head(waited)
        return shedder.admit(waited)

    def connection_lost(self, exc: BaseException | None) -> None:
        shedder = self._shedder
        if shedder is not None:
            while self._admitted:  # counted at the head, never handled
                self._admitted.popleft()
                shedder.done()
        super().connection_lost(exc)


# Field lines that change a request's framing or its connection: such a request is parsed.
_NOT_PLAIN = re.compile(rb"\r\n(?:transfer-encoding|connection|upgrade|expect|content-length[ \t])")


class ShedServer(HardenedServer):
    """`HardenedServer` building `ShedRequestHandler` connections."""

    def __init__(self, base: web.Server, deadlines: Deadlines, shedder: Shedder) -> None:
        super().__init__(base, deadlines, shedder)

    def __call__(self) -> RequestHandler:
        return ShedRequestHandler(
            self, loop=self._loop, deadlines=self._deadlines, shedder=self._shedder, **self._kwargs
        )
