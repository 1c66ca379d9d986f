"""One send request, whatever edge it came through (docs/design.md, "How a request flows").

An HTTP POST (gateway.web.handlers) and an AMQP transfer (gateway.amqp) are the same request:
the edge translates its wire format into an entity name, an authorization check and a list
of `OutboundMessage`s, calls `ingest`, and translates the result back into its own answer
(a status code and a JSON body; a settled delivery state). Everything in between is here,
once: the catalog lookup and the rights check, the size limits, `Router.submit`, and the
record of the outcome (metrics with a `protocol` label, ledger events, the access line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from gateway.auth import AuthError
from gateway.config import EntityKind, LimitSettings
from gateway.core.entities import EntityCatalog, EntityRef, validate_entity_path
from gateway.core.message import OutboundMessage, envelope_size
from gateway.core.ports import Tracer
from gateway.core.router import Delivery, Router
from gateway.errors import GatewayError, PayloadTooLarge, Saturated, SendFailure
from gateway.ledger import EventLedger, NullLedger
from gateway.logs import AccessLog
from gateway.tracing import log_ids

Protocol = Literal["http", "amqp"]
# The edge's rights check for an entity path: the name of the key that may send to it (None
# in open mode); raises `AuthError` (401/403) otherwise.
Authorize = Callable[[str], str | None]
# The edge's reading of the request's messages, once it is known whom they are for: raises a
# `RequestError` for a body it cannot parse.
ReadMessages = Callable[[EntityRef], Awaitable[list[OutboundMessage]]]


class IngestObserver:
    """What every edge reports, as hooks the metrics implement (gateway.metrics; the edges
    never import it). The default does nothing, so an edge without metrics needs none."""

    def admission_refused(self) -> None:
        """A request was answered 503: no room freed up within ``admission_timeout``."""

    def request_answered(
        self,
        entity: str,
        status: int,
        route: str,
        seconds: float,
        protocol: str = "http",
        messages: int = 0,
    ) -> None:
        """A send request was answered `status` after `seconds`, over `protocol`: accepted by
        `route` (``primary`` or ``backlog``) with its `messages`, or refused (route
        ``none``, no messages). One call per request: the metrics count it as plain
        numbers, exported at scrape time."""

    def amqp_put_token(self, result: str) -> None:
        """A `$cbs` put-token was ``granted`` or ``refused`` (gateway.amqp)."""

    def amqp_refused(self, kind: str) -> None:
        """The AMQP edge refused a ``connection``, a ``link`` or a ``management`` operation."""

    def bind_amqp(self, connections: Callable[[], int]) -> None:
        """Read the AMQP edge's open connections (at scrape time)."""


@dataclass(slots=True)
class Lifecycle:
    """Readiness as `/readyz` reports it. `checks` return a reason when not ready."""

    started: bool = False
    draining: bool = False
    checks: list[Callable[[], str | None]] = field(default_factory=list)

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.started:
            return "starting"
        for check in self.checks:
            reason = check()
            if reason:
                return reason
        return None

    @property
    def ready(self) -> bool:
        return self.not_ready_reason() is None


@dataclass(frozen=True, slots=True)
class EdgeState:
    """What every edge needs, stored once in the app (`gateway.web.handlers.EDGE`)."""

    catalog: EntityCatalog
    limits: LimitSettings
    observer: IngestObserver  # the metrics, in the app
    lifecycle: Lifecycle
    ledger: EventLedger = field(default_factory=NullLedger)
    access_log: AccessLog = field(default_factory=AccessLog)
    tracer: Tracer = field(default_factory=Tracer)  # off: the no-op one
    # Open mode's Host check (gateway.web.hosts.host_check), run by the HTTP edge's
    # middleware; typed loosely so that this module needs no aiohttp.
    host_check: Callable[..., None] | None = None


@dataclass(slots=True)
class Outcome:
    """What a send request's access line names besides its result."""

    request_id: str
    protocol: Protocol = "http"
    key_name: str | None = None  # the SAS rule that authorized it
    # Edge-specific fields of the access line (AMQP: container id, link, delivery id).
    fields: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class Ingested:
    """A request's result: where it was stored, or why not (already recorded)."""

    entity: str  # ``_unknown`` until a declared entity was named
    messages: list[OutboundMessage]
    result: Delivery | GatewayError


def check_sizes(messages: list[OutboundMessage], limits: LimitSettings) -> None:
    """Each message, and the request as one broker send, within the limits. `size` and
    `batch_size` are upper bounds of the encoding (gateway/core/message.py), so what passes
    here fits the link as far as the settings match the entity's real limit."""
    total = 0
    for m in messages:
        size = m.size
        if size > limits.max_message_bytes:
            raise PayloadTooLarge(
                f"message {m.message_id!r} is {size} bytes with its properties; "
                f"the limit is {limits.max_message_bytes}",
                messageId=m.message_id,
                size=size,
                limit=limits.max_message_bytes,
            )
        total += size
    if len(messages) > 1:  # `batch_size`, from the sizes summed above
        total += envelope_size(messages[0])
    if total > limits.max_batch_bytes:
        raise PayloadTooLarge(
            f"the batch is {total} bytes with its properties; "
            f"the limit is {limits.max_batch_bytes}",
            size=total,
            limit=limits.max_batch_bytes,
        )


def addressed_entity(
    catalog: EntityCatalog,
    name: str,
    kind: EntityKind | None,
    authorize: Authorize,
    outcome: Outcome,
) -> EntityRef:
    """The declared entity `name` (of `kind`, when the edge says), once the caller may send
    to it: 400 for a bad path before 401/403, and those before 404 (don't reveal)."""
    found = catalog.find(name, kind)
    if found is None:
        validate_entity_path(name)  # 400 before 401: a bad path names no resource
    key_name = authorize(name)
    if key_name is not None:
        outcome.key_name = key_name
    if found is None:
        raise catalog.unknown(name, kind)
    return found


async def ingest(
    state: EdgeState,
    router: Router,
    outcome: Outcome,
    name: str,
    kind: EntityKind | None,
    authorize: Authorize,
    read: ReadMessages,
) -> Ingested:
    """Authorize, look up, read, size, submit and record one send request.

    Every refusal is a `GatewayError` raised before anything is sent (bad path, auth, unknown
    entity, bad body, limits) or by the router (saturated, send failed); either way the
    outcome is recorded once and returned, never raised. Anything else (a bug, cancellation)
    propagates unrecorded, as it did from the HTTP handler."""
    started = time.perf_counter()
    entity_path = "_unknown"
    messages: list[OutboundMessage] = []
    result: Delivery | GatewayError
    try:
        entity = addressed_entity(state.catalog, name, kind, authorize, outcome)
        entity_path = entity.path
        read_messages = await read(entity)
        check_sizes(read_messages, state.limits)
        messages = read_messages  # recorded only once within the limits, as before
        result = await router.submit(entity, messages)
    except GatewayError as err:
        result = err
    record_outcome(outcome, state, started, entity_path, messages, result)
    return Ingested(entity_path, messages, result)


def record_outcome(
    outcome: Outcome,
    state: EdgeState,
    started: float,
    entity: str,
    messages: list[OutboundMessage],
    result: Delivery | GatewayError,
) -> None:
    """Metrics, ledger events and the one log line of a send request, whatever its outcome.

    `entity` is ``_unknown`` until the request named a declared entity; `messages` is empty
    until they were read within the limits (nothing to put in the ledger before that)."""
    elapsed = time.perf_counter() - started
    observer = state.observer
    accepted = 0
    if isinstance(result, GatewayError):
        status, route, error = result.status, "none", result
        if isinstance(result, Saturated):
            observer.admission_refused()
    else:
        status, route, error = result.status, result.route, None
        accepted = len(messages)
    if messages and state.ledger.enabled:
        _emit_ledger(state.ledger, entity, messages, result, elapsed)
    observer.request_answered(entity, status, route, elapsed, outcome.protocol, accepted)
    log_outcome(state.access_log, outcome, entity, status, route, messages, elapsed, error)


def _emit_ledger(
    ledger: EventLedger,
    entity: str,
    messages: list[OutboundMessage],
    result: Delivery | GatewayError,
    elapsed: float,
) -> None:
    """One ``accepted`` or ``rejected`` event per message (read by the audit pipeline)."""
    latency_ms = elapsed * 1000
    if isinstance(result, GatewayError):
        for m in messages:
            ledger.emit(
                "rejected",
                message_id=m.message_id,
                entity=entity,
                latency_ms=latency_ms,
                status=result.status,
                error=result.code,
            )
        return
    backlog = result.destination if result.route == "backlog" else None
    for m in messages:
        ledger.emit(
            "accepted",
            message_id=m.message_id,
            entity=entity,
            route=result.route,
            backlog=backlog,
            session_id=m.session_id,  # the audit checks per-session order (docs/pipeline.md)
            size=m.size,
            latency_ms=latency_ms,
        )


def log_outcome(
    access_log: AccessLog,
    outcome: Outcome,
    entity: str,
    status: int,
    route: str,
    messages: list[OutboundMessage],
    elapsed: float,
    error: GatewayError | None,
) -> None:
    """The request's access line: INFO, or WARNING when the broker failed or the gateway was
    saturated (`SBGATE_LOG_LEVEL=WARNING` keeps only those). `status` is the HTTP status of
    the result on every edge (an AMQP delivery's line says which outcome settled it)."""
    level = logging.INFO
    if error is not None and isinstance(error, SendFailure | Saturated):
        level = logging.WARNING
    elif 400 <= status < 500:
        level = access_log.client_errors  # WARNING in the development profile
    if not access_log.enabled(level):
        return
    request_id = outcome.request_id
    line = access_log.head(level, f"request {request_id} -> {status}")
    line["request_id"] = request_id
    line["protocol"] = outcome.protocol
    line["entity"] = entity
    line["status"] = status
    line["route"] = route
    count = len(messages)
    line["message_ids"] = (
        [messages[0].message_id] if count == 1 else [m.message_id for m in messages[:20]]
    )
    line["messages"] = count
    line["latency_ms"] = int(elapsed * 1_000_000 + 0.5) / 1000  # round(, 3), a third of it
    if outcome.fields:
        line.update(outcome.fields)
    if outcome.key_name is not None:
        line["key_name"] = outcome.key_name
    elif isinstance(error, AuthError) and error.key_name is not None:
        line["key_name"] = error.key_name  # the log may say which rule; the answer never does
    if error is not None:
        line["error"] = error.code
        line["error_message"] = error.message
    ids = log_ids()  # the active span's trace ids, with tracing on
    if ids:
        line.update(ids)
    access_log.write_line(line)
