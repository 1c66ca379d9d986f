"""Tracing: the trace context on every message (tracing on or off), and the OpenTelemetry
spans (server, send per broker batch, syphon move) recorded by the SDK's in-memory exporter,
through the real gateway app, the real SDK and the local broker."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Sequence

import orjson
import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageHeader, AmqpMessageProperties
from azure.servicebus.exceptions import MessagingEntityNotFoundError, ServiceBusError
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import AMQP_SERVER
from gateway.config import ConfigError, LimitSettings, TimeoutSettings, TracingSettings
from gateway.core.dispatcher import Destination, Dispatcher
from gateway.core.message import OutboundMessage
from gateway.core.ports import Tracer
from gateway.logs import JsonFormatter
from gateway.tracing import context_properties, create_tracer, message_context
from gateway.tracing.otel import OtelTracer
from gateway.web import rest
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_amqp_sdk import AUTH as AMQP_AUTH
from tests.gateway.test_amqp_sdk import connection_string as amqp_connection_string
from tests.gateway.test_amqp_sdk import send as amqp_send
from tests.gateway.test_integration import receive
from tests.gateway.test_syphon import SYPHON, backlog_total, depth, receive_all
from tests.support.fakes import FakeClient, msg
from tests.support.processes import free_port
from tests.support.waiting import eventually

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def tracer() -> tuple[OtelTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return OtelTracer.with_processor(SimpleSpanProcessor(exporter)), exporter


def props_of(m: object) -> dict[str, object]:
    raw = getattr(m, "application_properties", None) or {}
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }


def named(spans: Sequence[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def traceparent_of(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


# -- the context on the messages (pure) -------------------------------------------------------


def test_a_valid_traceparent_gives_the_sdk_properties():
    assert context_properties(PARENT, STATE) == {
        "Diagnostic-Id": PARENT,
        "traceparent": PARENT,
        "tracestate": STATE,
    }
    assert context_properties(PARENT, None) == {"Diagnostic-Id": PARENT, "traceparent": PARENT}


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "garbage",
        f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # version ff is invalid
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero span id
        f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01",  # upper-case hex
        f"{PARENT}-extra",  # version 00 has exactly four fields
    ],
)
def test_an_invalid_traceparent_is_ignored(bad: str):
    assert context_properties(bad, STATE) is None


def test_a_clients_own_properties_win_over_the_stamped_context():
    ctx = context_properties(PARENT, None)
    assert ctx is not None
    mine = rest.parse_single(b"x", None, [("Diagnostic-Id", "c")], None, None, ctx)
    plain = rest.parse_single(b"x", None, [], None, None, ctx)
    assert mine.application_properties == {"Diagnostic-Id": "c", "traceparent": PARENT}
    assert plain.application_properties == ctx
    assert plain.size > rest.parse_single(b"x", None, [], None, None).size, "counted in size"
    batch = orjson.dumps([{"Body": "a"}, {"Body": "b", "UserProperties": {"traceparent": "t"}}])
    a, b = rest.parse_batch(batch, None, 10, ctx)
    assert a.application_properties == ctx
    assert b.application_properties == {"Diagnostic-Id": PARENT, "traceparent": "t"}


def test_a_received_message_context_is_read_as_the_sdk_reads_it():
    assert message_context({"traceparent": PARENT.encode()}) == (PARENT, None)
    assert message_context({"Diagnostic-Id": PARENT, "tracestate": STATE}) == (PARENT, STATE)
    assert message_context({"traceparent": "junk"}) is None
    assert message_context({}) is None


# -- configuration ----------------------------------------------------------------------------


def test_tracing_is_off_by_default_and_the_tracer_is_the_no_op_one():
    settings = TracingSettings()
    assert not settings.enabled
    t = create_tracer(settings)
    assert type(t) is Tracer and not t.enabled


def test_tracing_on_without_opentelemetry_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gateway.tracing.otel", None)  # as if not installed
    with pytest.raises(ConfigError) as err:
        create_tracer(TracingSettings(exporter="otlp"))
    assert "sbgate[otel]" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.integration
def test_the_gateway_imports_and_builds_its_app_without_opentelemetry():
    code = (
        "import sys\n"
        "for name in ('opentelemetry',):\n"
        "    sys.modules[name] = None  # any import of it fails\n"
        "from gateway.app import create_app\n"
        "from gateway.config import load_settings\n"
        "import gateway.cli\n"
        "app = create_app(load_settings({}))\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- the dispatcher's hooks (a recording tracer at the port) ----------------------------------


class RecordingTracer(Tracer):
    enabled = True

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.batches: list[tuple[str, list[object | None], int, str | None]] = []
        self.context: object | None = None

    def current(self) -> object | None:
        return self.context

    def admission_waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def batch_sent(
        self,
        namespace: str,
        path: str,
        links: Sequence[object | None],
        messages: int,
        seconds: float,
        error: str | None,
    ) -> None:
        self.batches.append((path, list(links), messages, error))


async def test_each_batch_links_every_request_in_it_and_long_admission_waits_are_told():
    rec = RecordingTracer()
    release = asyncio.Event()

    async def slow(path: str, messages: Sequence[OutboundMessage]) -> None:
        await release.wait()

    client = FakeClient(behaviour=slow)
    limits = LimitSettings(
        max_pending_bytes=1024, max_batch_bytes=1024, max_message_bytes=1024, senders_per_entity=1
    )
    now = [0.0]
    d = Dispatcher(limits, TimeoutSettings(send_timeout=5.0), clock=lambda: now[0], tracer=rec)
    dest = Destination(client, "orders")

    async def send(i: int, size: int) -> None:
        rec.context = f"request-{i}"  # what `current()` says while this request sends
        await d.send(dest, [msg(i, size=size)])

    first = asyncio.create_task(send(1, 600))  # holds most of the byte budget
    await eventually(lambda: d.gate.used > 0)
    second = asyncio.create_task(send(2, 600))  # waits for room
    await eventually(lambda: d.gate.waiting == 1)
    now[0] = 0.5  # the second request has waited half a second when room frees up
    release.set()
    await asyncio.gather(first, second)
    await d.close(grace=1.0)
    assert [(p, links, n, err) for p, links, n, err in rec.batches] == [
        ("orders", ["request-1"], 1, None),
        ("orders", ["request-2"], 1, None),
    ]
    assert rec.waits == [0.5], "only the second request waited"


# -- through the real gateway, the SDK and the local broker -----------------------------------


async def test_tracing_off_the_clients_context_still_goes_on_the_message(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
):
    gw = await gateway()
    r = await gw.post(
        "/orders/messages",
        data=b"x",
        headers={
            "traceparent": PARENT,
            "tracestate": STATE,
            "BrokerProperties": '{"MessageId": "a"}',
        },
    )
    assert r.status == 201, await r.text()
    batch = [
        {"Body": "b", "BrokerProperties": {"MessageId": "b"}},
        {
            "Body": "c",
            "BrokerProperties": {"MessageId": "c"},
            "UserProperties": {"Diagnostic-Id": "mine"},
        },
    ]
    r = await gw.post(
        "/orders/messages",
        data=orjson.dumps(batch),
        headers={
            "traceparent": PARENT,
            "Content-Type": "application/vnd.microsoft.servicebus.json",
        },
    )
    assert r.status == 201, await r.text()
    r = await gw.post(
        "/orders/messages", data=b"x", headers={"BrokerProperties": '{"MessageId": "d"}'}
    )
    assert r.status == 201
    got = {m.message_id: props_of(m) for m in await receive(broker, "orders", count=4)}
    assert got["a"] == {"Diagnostic-Id": PARENT, "traceparent": PARENT, "tracestate": STATE}
    assert got["b"] == {"Diagnostic-Id": PARENT, "traceparent": PARENT}
    assert got["c"] == {"Diagnostic-Id": "mine", "traceparent": PARENT}, "the client's wins"
    assert got["d"] == {}, "no context, nothing added"


async def test_a_request_makes_a_server_span_a_linked_send_span_and_the_message_continues_it(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient, caplog, capsys
):
    t, exporter = tracer()
    gw = await gateway({"SBGATE_LOG_FORMAT": "json"}, tracer=t)
    caplog.set_level(logging.INFO, logger="gateway.requests")  # the access line's level
    r = await gw.post(
        "/queues/orders/messages",
        data=b"x",
        headers={
            "traceparent": PARENT,
            "tracestate": STATE,
            "BrokerProperties": '{"MessageId": "t1"}',
        },
    )
    assert r.status == 201, await r.text()
    [m] = await receive(broker, "orders")
    spans = exporter.get_finished_spans()
    [server] = named(spans, "POST ")
    [send] = named(spans, "send orders")
    assert server.kind == SpanKind.SERVER and server.name == "POST /{kind}/{name}/messages"
    assert server.parent is not None and server.parent.span_id == int(PARENT[36:52], 16)
    assert server.context.trace_id == int(TRACE_ID, 16), "the client's trace continues"
    assert server.attributes["http.response.status_code"] == 201
    assert send.kind == SpanKind.CLIENT
    assert dict(send.attributes or {}) == {
        "messaging.system": "servicebus",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "orders",
        "messaging.batch.message_count": 1,
        "sbgate.namespace": "primary",
    }
    assert [link.context.span_id for link in send.links] == [server.context.span_id]
    # The message carries the server span's context: an SDK consumer continues this trace.
    here = traceparent_of(server)
    assert props_of(m) == {"Diagnostic-Id": here, "traceparent": here, "tracestate": STATE}
    await gw.close()  # the access line is flushed at shutdown at the latest
    lines = [orjson.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    [line] = [x for x in lines if x["logger"] == "gateway.requests"]
    assert line["trace_id"] == TRACE_ID and line["span_id"] == f"{server.context.span_id:016x}"


async def test_concurrent_requests_each_link_from_the_batch_that_carried_them(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
):
    t, exporter = tracer()
    gw = await gateway(tracer=t)
    rs = await asyncio.gather(
        *(
            gw.post(
                "/orders/messages",
                data=b"x",
                headers={"BrokerProperties": f'{{"MessageId": "c{i}"}}'},
            )
            for i in range(20)
        )
    )
    assert {r.status for r in rs} == {201}
    spans = exporter.get_finished_spans()
    servers = {s.context.span_id for s in named(spans, "POST ")}
    sends = named(spans, "send orders")
    assert len(servers) == 20, "no traceparent: each request starts its own trace"
    linked = [link.context.span_id for s in sends for link in s.links]
    assert sorted(linked) == sorted(servers), "every request is linked from exactly one batch"
    counts = [s.attributes["messaging.batch.message_count"] for s in sends]
    assert sum(counts) == 20 and all(c == len(s.links) for c, s in zip(counts, sends, strict=True))


async def test_an_amqp_delivery_makes_a_server_span_that_continues_the_senders_context(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
):
    """The AMQP edge's server span, as an HTTP request's: the child of the message's own
    context (one message), linked to each message's (a batch), told the outcome, and linked
    from the broker send that carried it; the messages arrive with their properties as the
    SDK sent them."""
    t, exporter = tracer()
    gw = await gateway({"SBGATE_AMQP_PLAIN_PORT": str(free_port()), **AMQP_AUTH}, tracer=t)
    conn = amqp_connection_string(gw.app[AMQP_SERVER].ports["plain"])
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    await amqp_send(
        conn,
        "orders",
        ServiceBusMessage(
            b"one",
            message_id="a1",
            application_properties={"traceparent": PARENT, "tracestate": STATE},
        ),
    )
    await amqp_send(
        conn,
        "orders",
        [
            ServiceBusMessage(
                b"two", message_id="a2", application_properties={"traceparent": PARENT}
            ),
            ServiceBusMessage(
                b"three", message_id="a3", application_properties={"Diagnostic-Id": other}
            ),
            ServiceBusMessage(b"four", message_id="a4"),
        ],
    )
    await amqp_send(
        conn,
        "orders",
        [
            ServiceBusMessage(
                b, message_id=b.decode(), application_properties={"traceparent": PARENT}
            )
            for b in (b"five", b"six")
        ],
    )
    # A message the edge cannot carry unchanged (a priority) is refused at the transfer,
    # with tracing on as off: read before the span opens, it fails alone, and is answered.
    with pytest.raises(ServiceBusError, match="priority"):
        await amqp_send(
            conn,
            "orders",
            AmqpAnnotatedMessage(
                data_body=b"prio",
                header=AmqpMessageHeader(priority=9),
                properties=AmqpMessageProperties(message_id="a6"),
            ),
        )
    with pytest.raises(MessagingEntityNotFoundError):
        await amqp_send(conn, "nope", ServiceBusMessage(b"lost", message_id="a5"))
    got = {m.message_id: props_of(m) for m in await receive(broker, "orders", count=6)}
    spans = exporter.get_finished_spans()
    one, batch, shared, _ = sorted(named(spans, "transfer orders"), key=lambda s: s.start_time or 0)
    for span in (one, batch, shared):  # (the fourth: the refused message, below)
        assert span.kind == SpanKind.SERVER
        assert span.attributes is not None
        assert span.attributes["sbgate.status_code"] == 201
        assert span.attributes["network.protocol.name"] == "amqp"
        assert span.attributes["messaging.destination.name"] == "orders"
    assert one.parent is not None and one.parent.span_id == int(PARENT[36:52], 16)
    assert one.context.trace_id == int(TRACE_ID, 16), "the sender's trace continues"
    assert one.attributes is not None and one.attributes["messaging.batch.message_count"] == 1
    assert batch.parent is None, "a batch's messages name two traces: linked, not a child"
    assert sorted(link.context.trace_id for link in batch.links) == sorted(
        [int(TRACE_ID, 16), int("1" * 32, 16)]
    )
    assert batch.attributes is not None and batch.attributes["messaging.batch.message_count"] == 3
    assert shared.parent is not None and shared.parent.span_id == int(PARENT[36:52], 16)
    assert not shared.links, "a batch whose messages share one context is its child"
    linked = {link.context.span_id for s in named(spans, "send orders") for link in s.links}
    assert {one.context.span_id, batch.context.span_id} <= linked
    assert len(str(one.attributes["sbgate.request_id"])) == 32  # its access line's id
    [refused] = [
        s
        for s in named(spans, "transfer orders")
        if s.attributes and s.attributes["messaging.batch.message_count"] == 0
    ]
    assert refused.attributes is not None and refused.attributes["sbgate.status_code"] == 400
    [missing] = named(spans, "transfer nope")
    assert missing.attributes is not None and missing.attributes["sbgate.status_code"] == 404
    # The AMQP edge carries a message as it was sent: the sender's context, not the span's.
    assert got["a1"] == {"traceparent": PARENT, "tracestate": STATE}
    assert got["a3"] == {"Diagnostic-Id": other}
    assert got["a4"] == {}


async def test_through_failover_and_the_syphon_the_message_keeps_its_original_context(
    gateway: GatewayFactory, control: ControlClient, broker: BrokerProcess
):
    t, exporter = tracer()
    fault = await control.add_fault("primary", "amqp:internal-error", operation="send")
    gw = await gateway(SYPHON, tracer=t)
    r = await gw.post(
        "/orders/messages",
        data=b"late",
        headers={"traceparent": PARENT, "BrokerProperties": '{"MessageId": "f1"}'},
    )
    assert r.status == 202, await r.text()
    assert await backlog_total(control) == 1
    await control.remove_fault("primary", fault)

    async def home() -> bool:
        return await backlog_total(control) == 0 and await depth(control, "primary", "orders") == 1

    await eventually(home, within=20, every=0.1)
    [m] = await receive_all(broker, "orders")
    spans = exporter.get_finished_spans()
    [server] = named(spans, "POST ")
    original = traceparent_of(server)
    assert props_of(m) == {"Diagnostic-Id": original, "traceparent": original}, (
        "home with its original context, not the move's"
    )
    to_backlog = named(spans, "send primary/x-servicebus-transfer/")
    assert [link.context.span_id for s in to_backlog for link in s.links] == [
        server.context.span_id
    ], "the backlog write is linked to the request"
    failed = [s for s in named(spans, "send orders") if s.links and not s.status.is_ok]
    assert {link.context.span_id for s in failed for link in s.links} == {server.context.span_id}
    assert failed[0].attributes["error.type"], "the failed primary send is an error"
    [move] = named(spans, "move orders")
    assert move.kind == SpanKind.CONSUMER and move.parent is None, "a trace of its own"
    assert [link.context.span_id for link in move.links] == [server.context.span_id]
    assert move.links[0].context.trace_id == int(TRACE_ID, 16)
    assert move.attributes["sbgate.backlog"].startswith("primary/x-servicebus-transfer/")
    # (the pinger's sends to the entity link to nothing)
    [moved] = [s for s in named(spans, "send orders") if s.links and s.status.is_ok]
    assert moved.parent is not None and moved.parent.span_id == move.context.span_id
    assert [link.context.span_id for link in moved.links] == [move.context.span_id]


def test_json_log_lines_carry_the_active_spans_ids():
    t, _ = tracer()
    fmt = JsonFormatter()
    record = logging.LogRecord("x", logging.INFO, "", 0, "hello", (), None)
    with t.moving("orders", "primary/x-servicebus-transfer/0", [{"traceparent": PARENT}]):
        inside = orjson.loads(fmt.format(record))
        span_id = t.current()
    outside = orjson.loads(fmt.format(record))
    assert inside["trace_id"] and len(inside["trace_id"]) == 32 and inside["trace_id"] != TRACE_ID
    assert inside["span_id"] == f"{span_id.span_id:016x}"  # type: ignore[attr-defined]
    assert "trace_id" not in outside and "span_id" not in outside
