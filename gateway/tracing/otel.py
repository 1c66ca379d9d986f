"""The OpenTelemetry tracer (the `otel` extra): spans for requests, broker batches and moves.

A small aiohttp middleware on the OpenTelemetry API makes the server span, rather than
opentelemetry-instrumentation-aiohttp-server: that one works only through the global tracer
provider and propagators (configured by more environment variables, one provider per
process, so no app of its own per test), records HTTP metrics that /metrics already has, and
is a 0.x package pinned to exact SDK releases. Ours is a dozen lines on the stable API, uses
this app's own provider, and names spans by the route as the HTTP conventions say.

Spans (the names are docs/observability.md's):

* ``POST /{kind}/{name}/messages`` (server; ``POST /{name}/messages`` for the short path):
  one per request, a child of the client's
  ``traceparent`` when it sends one (else a new trace, as the sampler says). An admission
  wait of 1 ms or more is an event on it (``sbgate.admission.wait``).
* ``send <entity>`` (client): one per broker batch, with the messaging conventions'
  attributes and a link to the span of every request (or move) whose messages it carried;
  a child of that span when there is only one.
* ``move <entity>`` (consumer): one per syphon move, a new trace linked to each message's
  original context (the one its properties carry, which it keeps: it arrives home with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import sampling as samplers
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.re import parse_env_headers

from gateway.config import TracingSettings
from gateway.core.ports import Tracer
from gateway.tracing import TRACEPARENT, TRACESTATE, links_of, use_log_ids

log = logging.getLogger(__name__)

SCOPE = "sbgate"
MESSAGING_SYSTEM = "servicebus"
_ROOT = Context()  # no parent: batches and moves are not children of whatever was active
_PROPAGATOR = TraceContextTextMapPropagator()


def _sampler(settings: TracingSettings) -> samplers.Sampler:
    name, ratio = settings.sampler, settings.sampler_arg
    root: samplers.Sampler
    if name.endswith("traceidratio"):
        root = samplers.TraceIdRatioBased(ratio)
    elif name.endswith("always_off"):
        root = samplers.ALWAYS_OFF
    else:
        root = samplers.ALWAYS_ON
    return samplers.ParentBased(root) if name.startswith("parentbased_") else root


def _resource(settings: TracingSettings) -> Resource:
    attributes: dict[str, Any] = {}
    if settings.resource_attributes:
        attributes.update(parse_env_headers(settings.resource_attributes, liberal=True))
    attributes["service.name"] = settings.service_name
    return Resource.create(attributes)


def _exporter(settings: TracingSettings) -> SpanExporter:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = settings.otlp_traces_endpoint or (settings.otlp_endpoint.rstrip("/") + "/v1/traces")
    headers = (
        parse_env_headers(settings.otlp_headers.get(), liberal=True)
        if settings.otlp_headers
        else None
    )
    return OTLPSpanExporter(
        endpoint=endpoint, headers=headers, timeout=settings.otlp_timeout / 1000
    )


def _log_ids() -> dict[str, str]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def _remote(traceparent: str, tracestate: str | None) -> SpanContext | None:
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    ctx = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None


class OtelTracer(Tracer):
    """The `Tracer` port over an OpenTelemetry `TracerProvider` this tracer owns (never the
    global one): `aclose` exports what is left and stops it."""

    enabled = True

    def __init__(self, provider: TracerProvider, export_timeout: float = 10.0) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE)
        self._export_timeout = export_timeout
        use_log_ids(_log_ids)

    @classmethod
    def from_settings(cls, settings: TracingSettings) -> OtelTracer:
        return cls.with_processor(
            BatchSpanProcessor(_exporter(settings)),
            sampler=_sampler(settings),
            resource=_resource(settings),
            export_timeout=settings.otlp_timeout / 1000,
        )

    @classmethod
    def with_processor(
        cls,
        processor: SpanProcessor,
        *,
        sampler: samplers.Sampler | None = None,
        resource: Resource | None = None,
        export_timeout: float = 10.0,
    ) -> OtelTracer:
        """Tests and benchmarks: spans go to `processor` (an in-memory exporter's, say)."""
        provider = TracerProvider(
            sampler=sampler or samplers.ParentBased(samplers.ALWAYS_ON),
            resource=resource or Resource.create({"service.name": SCOPE}),
            shutdown_on_exit=False,
        )
        provider.add_span_processor(processor)
        return cls(provider, export_timeout)

    async def aclose(self) -> None:
        try:
            async with asyncio.timeout(self._export_timeout + 1.0):
                await asyncio.to_thread(self._provider.shutdown)
        except TimeoutError:
            log.warning("tracing: spans not exported within %gs at shutdown", self._export_timeout)

    # -- the port --------------------------------------------------------------------------

    def current(self) -> object | None:
        ctx = trace.get_current_span().get_span_context()
        return ctx if ctx.is_valid else None

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier

    def admission_waited(self, seconds: float) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("sbgate.admission.wait", {"sbgate.admission.wait_ms": seconds * 1000})

    def batch_sent(
        self,
        namespace: str,
        path: str,
        links: Sequence[object | None],
        messages: int,
        seconds: float,
        error: str | None,
    ) -> None:
        contexts = [c for c in links if isinstance(c, SpanContext)]
        parent = _ROOT
        if len(contexts) == 1:  # one request: the send is its child, as well as linked
            parent = trace.set_span_in_context(NonRecordingSpan(contexts[0]), _ROOT)
        end = time.time_ns()
        span = self._tracer.start_span(
            f"send {path}",
            context=parent,
            kind=SpanKind.CLIENT,
            links=[Link(c) for c in contexts],
            start_time=end - int(seconds * 1e9),
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": path,
                "messaging.batch.message_count": messages,
                "sbgate.namespace": namespace,
            },
        )
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)

    @contextlib.contextmanager
    def moving(
        self, entity: str, backlog: str, origins: Sequence[Mapping[str, object]]
    ) -> Iterator[None]:
        contexts = [c for tp, ts in links_of(origins) if (c := _remote(tp, ts)) is not None]
        with self._tracer.start_as_current_span(
            f"move {entity}",
            context=_ROOT,
            kind=SpanKind.CONSUMER,
            links=[Link(c) for c in contexts],
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "move",
                "messaging.destination.name": entity,
                "messaging.batch.message_count": len(origins),
                "sbgate.backlog": backlog,
            },
        ):
            yield

    @contextlib.contextmanager
    def delivery(
        self, entity: str, request_id: str, origins: Sequence[Mapping[str, object]]
    ) -> Iterator[Callable[[int], None]]:
        # The messages' context is the parent (the SDK's send span, as an HTTP request's
        # traceparent is) when they share one; a batch whose messages carry several is
        # linked to each, as a move is.
        distinct = {tp: ts for tp, ts in links_of(origins)}  # the same one: once (in order)
        contexts = [c for tp, ts in distinct.items() if (c := _remote(tp, ts)) is not None]
        parent = _ROOT
        if len(contexts) == 1:
            parent = trace.set_span_in_context(NonRecordingSpan(contexts[0]), _ROOT)
        with self._tracer.start_as_current_span(
            f"transfer {entity}",
            context=parent,
            kind=SpanKind.SERVER,
            links=[Link(c) for c in contexts] if len(contexts) > 1 else None,
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.type": "receive",
                "messaging.operation.name": "transfer",
                "messaging.destination.name": entity,
                "messaging.batch.message_count": len(origins),
                "network.protocol.name": "amqp",
                "sbgate.request_id": request_id,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:

            def outcome(status: int) -> None:
                if span.is_recording():
                    span.set_attribute("sbgate.status_code", status)
                    if status >= 500:
                        span.set_attribute("error.type", str(status))
                        span.set_status(Status(StatusCode.ERROR))

            yield outcome

    # -- the server span -------------------------------------------------------------------

    @property
    def middleware(self) -> Any:
        tracer = self._tracer

        @web.middleware
        async def tracing_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            resource = request.match_info.route.resource
            # The route's template, its fixed words without their regex names.
            route = resource.canonical if resource is not None else request.path
            route = route.replace("{messages}", "messages").replace("{head}", "head")
            with tracer.start_as_current_span(
                f"{request.method} {route}",
                context=_PROPAGATOR.extract(request.headers),
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": request.method,
                    "http.route": route,
                    "url.path": request.path,
                    "url.scheme": request.scheme,
                },
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    response: web.StreamResponse = await handler(request)
                except web.HTTPException as exc:
                    span.set_attribute("http.response.status_code", exc.status)
                    raise
                except BaseException as exc:
                    span.set_attribute("error.type", type(exc).__qualname__)
                    span.set_status(Status(StatusCode.ERROR))
                    raise
                if span.is_recording():
                    span.set_attribute("http.response.status_code", response.status)
                    request_id = response.headers.get("X-Request-Id")
                    if request_id:
                        span.set_attribute("sbgate.request_id", request_id)
                    if response.status >= 500:
                        span.set_attribute("error.type", str(response.status))
                        span.set_status(Status(StatusCode.ERROR))
                return response

        return tracing_middleware
