"""One `$cbs` link pair per pooled connection, carrying every sender's put-token.

Why: the SDK's handler opens, for each sender, a `CBSAuthenticator` of its own — a
request/response link pair to `$cbs` in the handler's session (`AMQPClientAsync.open_async`)
— used for one audience, that sender's entity. On a pooled connection spread over many
entities that is two more attaches per cold open (and two detaches per close), the largest
part of a cold open's frames (docs/performance.md, "Many entities").

How: each slot opens one `SharedCbs` on its connection (a session of its own and the `$cbs`
pair, `ManagementLink` as the SDK builds it), and each handler bound to the pool gets a
`SharedCbsAuthenticator` instead of the SDK's: the SDK's class, with its own token, audience,
expiry and state, so that `handle_token` checks, puts, refreshes (the SDK's 10% refresh
window, `_update_status`) and fails per audience exactly as before, and only its requests go
over the connection's pair. A put-token refused for one audience completes that handler's
operation only (`ManagementLink` matches each reply to its request by correlation id, any
number pending), and that handler raises the SDK's `TokenAuthFailure`, as it does today.

What a broker accepts: CBS is a node of the connection and a token authorizes the audience
on the whole connection (AMQP CBS draft, "put-token"; sblocal keeps scopes per connection,
`sblocal/amqp/server.py` `_authorized`). The SDKs' own connection-sharing designs put
every entity's token over one `$cbs` link per connection: uamqp's `AMQPClient.open` (the
transport of azure-servicebus 7.x before pyamqp) creates `connection.cbs` once and every
later client on that connection reuses it; pyamqp's `AMQPClientAsync.open_async` says of an
external connection that it "may have an existing CBS authentication Session, which will be
used for this client as well"; and the .NET Microsoft.Azure.ServiceBus
`ServiceBusConnection.CreateConnectionAsync` ("Always create the CBS Link + Session": one
`AmqpCbsLink` per connection, `SendTokenAsync` with each entity's audience).
tests/broker/test_pooled_links.py
holds this to the local broker: one pair per connection, a refused audience, a refresh.

A handler falls back to its own pair (the SDK's path) when the connection has no reader
(`Slot.reading`) or the shared pair fails to open in time.

One put-token per audience per connection (`Grant`). A token put for an audience authorizes
every link to that entity on the connection until it expires (Service Bus "promptly drops
all links on the connection to the respective entity" when it does: the AMQP protocol
guide, "Claims-based authorization"; sblocal keeps the scope per connection): so a handler
whose audience already has a token on its connection, accepted and not yet in the SDK's
refresh window, takes that token's state (token, expiry, refresh window) instead of putting
its own, and one whose audience has a put in flight waits for that put's answer instead of
sending another. Its open is then the attach alone: one round trip and no put-token frames
(the pool binds a sender to the connection that holds its audience, `ConnectionPool.bind`).
A put that fails or is dropped sends its waiters back to putting their own (each then gets
its own answer, refusal included); each handler still refreshes on its own schedule, and a
refresh first looks for a newer token another handler put.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import uuid4

from azure.servicebus._pyamqp.aio._cbs_async import CBSAuthenticator
from azure.servicebus._pyamqp.cbs import check_expiration_and_refresh_status
from azure.servicebus._pyamqp.constants import (
    CBS_EXPIRATION,
    CBS_NAME,
    CBS_OPERATION,
    CBS_PUT_TOKEN,
    CBS_TYPE,
    INCOMING_WINDOW,
    OUTGOING_WINDOW,
    CbsAuthState,
    CbsState,
    ManagementOpenResult,
)
from azure.servicebus._pyamqp.message import Message, Properties

log = logging.getLogger(__name__)

# Our deadline on opening a connection's shared pair (then the handler opens its own).
OPEN_TIMEOUT = 30.0


class Grant:
    """The latest token put for one audience on a connection: in flight (`waiting`: the
    authenticators that wait for its answer instead of putting their own), accepted (`ok`,
    with the token's state), or failed (neither)."""

    __slots__ = ("expires_on", "ok", "put_time", "refresh_window", "since", "token", "waiting")

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.ok = False
        self.token: str | None = None
        self.expires_on: int | None = None
        self.refresh_window: int | None = None
        self.put_time: int | None = None
        self.waiting: list[SharedCbsAuthenticator] | None = []  # None once answered

    def in_flight(self, timeout: float) -> bool:
        """Put, not answered, and not older than the put's deadline (`timeout`)."""
        return self.waiting is not None and time.monotonic() - self.since < timeout

    @property
    def current(self) -> bool:
        """Accepted, and neither expired nor due for the SDK's refresh."""
        if not self.ok or self.expires_on is None or self.refresh_window is None:
            return False
        expired, refresh = check_expiration_and_refresh_status(self.expires_on, self.refresh_window)
        return not expired and not refresh


class SharedCbs:
    """The `$cbs` request/response link pair of one pooled connection, in a session of its
    own. `begin` writes the frames; `wait_open` waits for the broker's answers. `grants`:
    the token put over it for each audience."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.state = CbsState.OPENING
        self.started = False
        self.grants: dict[str, Grant] = {}
        # The SDK's handler windows (`AMQPClientAsync`): with pyamqp's default of 1, the
        # session would answer every put-token's reply with a FLOW.
        self.session: Any = conn.create_session(
            incoming_window=INCOMING_WINDOW, outgoing_window=OUTGOING_WINDOW
        )
        # As `CBSAuthenticator.__init__` builds it.
        self.link: Any = self.session.create_request_response_link_pair(
            endpoint="$cbs",
            on_amqp_management_open_complete=self._on_open_complete,
            on_amqp_management_error=self._on_error,
            status_code_field=b"status-code",
            status_description_field=b"status-description",
        )

    def holds(self, audience: str) -> bool:
        """Whether a token for `audience` is on this connection (or being put)."""
        grant = self.grants.get(audience)
        return grant is not None and (grant.in_flight(OPEN_TIMEOUT) or grant.current)

    def wake(self) -> None:
        """A frame to this session was dispatched: the waiting handlers are woken by their
        own operations' completion, `wait_open` by the reader's pulse."""

    @property
    def usable(self) -> bool:
        return self.state == CbsState.OPEN and self.conn._error is None

    @property
    def failed(self) -> bool:
        return self.state in (CbsState.ERROR, CbsState.CLOSED) or self.conn._error is not None

    async def _on_open_complete(self, result: ManagementOpenResult) -> None:
        if self.state == CbsState.OPENING:
            self.state = CbsState.OPEN if result == ManagementOpenResult.OK else CbsState.ERROR

    async def _on_error(self) -> None:
        self.state = CbsState.ERROR

    async def begin(self) -> None:
        await self.session.begin()
        await self.link.open()
        self.started = True

    async def wait_open(self, frame: Callable[[], Awaitable[Any]]) -> bool:
        """Wait until the pair is open or failed (`frame`: until the next frame was read);
        the caller owns the deadline."""
        while self.state == CbsState.OPENING and self.conn._error is None:
            await frame()
        return self.usable


class SharedCbsAuthenticator(CBSAuthenticator):
    """The SDK's `CBSAuthenticator` for one handler (its audience, token and state), its
    put-tokens sent over the connection's `SharedCbs`; completing one wakes the handler."""

    def __init__(
        self,
        handler: Any,
        shared: SharedCbs,
        renew: Callable[[], Awaitable[SharedCbs | None]],
    ) -> None:
        # `CBSAuthenticator.__init__` but the link pair (tests/gateway/test_pyamqp_sharing.py
        # pins its source).
        self._session = handler._session
        self._connection = handler._connection  # the handler's view (`pool._View`)
        self._shared = shared
        self._mgmt_link = shared.link
        self._renew = renew
        self._auth = handler._auth
        self._encoding = "UTF-8"
        self._auth_timeout = handler._auth_timeout
        self._token_put_time = None
        self._expires_on = None
        self._token = None
        self._refresh_window = None
        self._network_trace_params = {
            "amqpConnection": shared.conn._container_id,
            "amqpSession": shared.session.name,
            "amqpLink": "",
        }
        self._token_status_code = None
        self._token_status_description = None
        self.state = CbsState.CLOSED
        self.auth_state = CbsAuthState.IDLE
        self._pending: Any = None
        self._grant: Grant | None = None  # the put this one made, or waits for

    async def update_token(self) -> None:
        """The SDK's put (first, or a refresh), unless the connection already has a current
        token for this audience (taken), or one in flight (waited for): see the module."""
        grant = self._shared.grants.get(self._auth.audience)
        if grant is not None and grant is not self._grant:
            if grant.current:
                self._take(grant)
                self._connection.wake()  # `handle_token` listens next: no frame is coming
                return
            waiting = grant.waiting
            if waiting is not None and grant.in_flight(self._auth_timeout or OPEN_TIMEOUT):
                waiting.append(self)
                self._grant = grant
                self.auth_state = CbsAuthState.IN_PROGRESS
                self._token_put_time = int(time.time())  # the SDK's put deadline holds
                return
        self._grant = self._shared.grants[self._auth.audience] = Grant()
        await super().update_token()

    def _take(self, grant: Grant) -> None:
        self._grant = grant
        self._token = grant.token
        self._expires_on = grant.expires_on
        self._refresh_window = grant.refresh_window
        self._token_put_time = grant.put_time
        self.auth_state = CbsAuthState.OK

    def _answered(self) -> None:
        """This one's put was answered (or dropped): record it, and settle its waiters."""
        grant = self._grant
        if grant is None or grant.waiting is None:
            return
        waiting, grant.waiting = grant.waiting, None
        if self.auth_state == CbsAuthState.OK:
            grant.ok = True
            grant.token, grant.expires_on = self._token, self._expires_on
            grant.refresh_window, grant.put_time = self._refresh_window, self._token_put_time
        elif self._shared.grants.get(self._auth.audience) is grant:
            del self._shared.grants[self._auth.audience]
        for other in waiting:
            if other._grant is not grant or other.auth_state != CbsAuthState.IN_PROGRESS:
                continue  # closed, or moved on
            if grant.ok:
                other._take(grant)
            else:  # it puts its own, and gets its own answer
                other._grant = None
                other.auth_state = CbsAuthState.IDLE
            other._connection.wake()

    async def open(self) -> None:
        self.state = CbsState.OPEN if self._shared.usable else CbsState.ERROR

    async def close(self) -> None:
        # The pair is the connection's: only this handler's pending request is dropped (its
        # waiters then put their own).
        if self._pending is not None:
            self._shared.link.cancel_operation(self._pending)
            self._pending = None
            self.auth_state = CbsAuthState.IDLE
            self._answered()
        self._grant = None
        self.state = CbsState.CLOSED

    async def _cbs_link_ready(self) -> bool:
        # The SDK's: not ready (the handler keeps waiting, bounded by its deadline) unless
        # open. A failed pair is replaced by the connection's next one; the tokens already
        # put hold for the connection, and a put still pending is put again on the new one.
        if self.state != CbsState.OPEN:
            return False
        if not self._shared.usable:
            fresh = await self._renew()
            if fresh is None:
                return False
            self._shared, self._mgmt_link, self._pending = fresh, fresh.link, None
            if self.auth_state == CbsAuthState.IN_PROGRESS:
                self.auth_state = CbsAuthState.IDLE
                self._grant = None  # the new pair has no grants: this one puts again
        return True

    async def _put_token(
        self, token: str, token_type: str, audience: str, expires_on: Any = None
    ) -> None:
        # `CBSAuthenticator._put_token`, keeping the pending operation (for `close`).
        message = Message(  # type: ignore[call-arg]
            value=token,
            properties=Properties(message_id=uuid4()),  # type: ignore[call-arg]
            application_properties={
                CBS_NAME: audience,
                CBS_OPERATION: CBS_PUT_TOKEN,
                CBS_TYPE: token_type,
                CBS_EXPIRATION: expires_on,
            },
        )
        self._pending = await self._shared.link.execute_operation(
            message,
            self._on_execute_operation_complete,
            timeout=self._auth_timeout,
            operation=CBS_PUT_TOKEN,
            type=token_type,
        )

    async def _on_execute_operation_complete(self, *args: Any, **kwargs: Any) -> None:
        self._pending = None
        await super()._on_execute_operation_complete(*args, **kwargs)
        self._answered()
        # The reply came on the shared session: wake this handler, which waits for frames
        # to its own session only (`pool._View.listen`).
        self._connection.wake()


async def open_shared(
    handler: Any,
    connection: Any,
    shared: SharedCbs,
    renew: Callable[[], Awaitable[SharedCbs | None]],
) -> None:
    """`AMQPClientAsync.open_async(connection)` for an external connection, its CBS
    authenticator a `SharedCbsAuthenticator` (tests/gateway/test_pyamqp_sharing.py pins the
    SDK's source)."""
    if handler._session:
        return
    handler._connection = connection
    handler._external_connection = True
    handler._session = connection.create_session(
        incoming_window=handler._incoming_window, outgoing_window=handler._outgoing_window
    )
    await handler._session.begin()
    handler._cbs_authenticator = SharedCbsAuthenticator(handler, shared, renew)
    await handler._cbs_authenticator.open()
    handler._network_trace_params["amqpConnection"] = connection._container_id
    handler._network_trace_params["amqpSession"] = handler._session.name
    handler._shutdown = False
    if handler._keep_alive_interval:
        handler._keep_alive_thread = asyncio.ensure_future(handler._keep_alive_async())
