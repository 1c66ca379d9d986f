"""A tiny asyncio AMQP server on sbamqp's engine, for tests only (not the gateway).

It answers `$cbs` put-tokens with 200, accepts sender links, and settles each delivery by
the entity's outcome in `outcomes` (accepted when absent); deliveries are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sbamqp import addresses, conventions, engine, sections
from sbamqp.codec import Array, Int, Long
from sbamqp.performatives import Accepted, DeliveryState
from sbamqp.sections import Properties

MAX_MESSAGE_SIZE = 256 * 1024


@dataclass
class Received:
    entity: str
    message_format: int
    payload: bytes


@dataclass
class Peer:
    """What the server saw, and how it answers."""

    limits: engine.Limits = field(default_factory=engine.Limits)
    outcomes: dict[str, DeliveryState] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    events: list[engine.Event] = field(default_factory=list)
    tokens: list[tuple[str, Any]] = field(default_factory=list)
    management: list[tuple[dict[str, Any], Any]] = field(default_factory=list)
    credit: int = 20
    refuse_receivers: bool = True
    transports: list[asyncio.Transport] = field(default_factory=list)


class _Protocol(asyncio.Protocol):
    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.conn = engine.ServerConnection(peer.limits, now=time.monotonic())
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer.transports.append(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data, time.monotonic()):
            self.peer.events.append(event)
            self._on_event(event)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        assert self.transport is not None
        if out:
            self.transport.write(out)
            self.conn.sent(time.monotonic())
        if self.conn.finished:
            self.transport.close()
        else:
            self._arm()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        now = time.monotonic()
        deadline = self.conn.next_deadline(now)
        if deadline is not None:
            self.timer = asyncio.get_running_loop().call_later(max(0.0, deadline - now), self._tick)

    def _tick(self) -> None:
        self.timer = None
        for event in self.conn.tick(time.monotonic()):
            self.peer.events.append(event)
        self._flush()

    def _on_event(self, event: engine.Event) -> None:
        conn = self.conn
        if isinstance(event, engine.LinkAttached):
            link = event.link
            if link.is_server_sender and self.peer.refuse_receivers:
                node = addresses.entity_path(link.source_address or "")
                if node != conventions.CBS_NODE and not node.endswith("$management"):
                    conn.refuse_link(
                        link,
                        conventions.Condition.NOT_IMPLEMENTED,
                        "this endpoint only accepts senders",
                    )
                    return
            conn.accept_attach(
                link,
                max_message_size=MAX_MESSAGE_SIZE,
                properties={conventions.VENDOR_MAX_MESSAGE_BATCH_SIZE: MAX_MESSAGE_SIZE},
            )
            if not link.is_server_sender:
                conn.grant_credit(link, self.peer.credit)
        elif isinstance(event, engine.Transfer):
            self._on_transfer(event)

    def _on_transfer(self, event: engine.Transfer) -> None:
        conn = self.conn
        link = event.link
        entity = addresses.entity_path(link.target_address or "")
        if entity == conventions.CBS_NODE:
            self._put_token(event)
        elif entity.endswith("/" + conventions.MANAGEMENT_NODE):
            self._management(event)
        else:
            self.peer.received.append(Received(entity, event.message_format, event.payload))
            outcome = self.peer.outcomes.get(entity, Accepted())
            if not event.settled:
                conn.settle(link, event.delivery_id, outcome)
        conn.grant_credit(link, self.peer.credit)

    def _management(self, event: engine.Transfer) -> None:
        """Every request is a schedule: sequence numbers 1..n, one per message."""
        request = sections.split(event.payload)
        props = request.properties_view()
        body = sections.value_of(request)
        self.peer.management.append(
            ({k: v for k, _, v in request.application_properties_items()}, body)
        )
        if not event.settled:
            self.conn.settle(event.link, event.delivery_id, Accepted())
        count = len(body.get("messages", [])) if isinstance(body, dict) else 0
        self._reply(
            event,
            props,
            conventions.MANAGEMENT_NODE,
            {conventions.MGMT_STATUS_CODE: Int(200), conventions.MGMT_STATUS_DESCRIPTION: "OK"},
            {"sequence-numbers": Array([Long(i + 1) for i in range(count)], code=0x81)},
        )

    def _reply(
        self,
        event: engine.Transfer,
        props: Properties,
        node: str,
        status: dict[str, Any],
        value: Any,
    ) -> None:
        link = event.link
        node_address = addresses.entity_path(link.target_address or node)
        reply_link = addresses.reply_link(
            props.reply_to, node_address, link.session.links.values(), self.conn.links
        )
        assert reply_link is not None, f"no reply link for {node_address}"
        reply = sections.message(
            properties=Properties(correlation_id=props.message_id, to=props.reply_to),
            application_properties=status,
            value=value,
        )
        self.conn.send(reply_link, reply)

    def _put_token(self, event: engine.Transfer) -> None:
        request = sections.split(event.payload)
        props = request.properties_view()
        app = {k: v for k, _, v in request.application_properties_items()}
        self.peer.tokens.append((str(app.get("name")), sections.value_of(request)))
        if not event.settled:
            self.conn.settle(event.link, event.delivery_id, Accepted())
        status = {conventions.CBS_STATUS_CODE: Int(200), conventions.CBS_STATUS_DESCRIPTION: "OK"}
        self._reply(event, props, conventions.CBS_NODE, status, None)


@contextlib.asynccontextmanager
async def serve(peer: Peer) -> AsyncIterator[int]:
    """Listen on 127.0.0.1 (a free port) for as long as the context lasts; the port."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Protocol(peer), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for transport in peer.transports:
            transport.abort()
        async with asyncio.timeout(5):
            await server.wait_closed()


def connection_string(port: int) -> str:
    return (
        f"Endpoint=sb://localhost:{port};SharedAccessKeyName=k;SharedAccessKey=x;"
        "UseDevelopmentEmulator=true"
    )
