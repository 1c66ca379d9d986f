"""The HTTP edge does what docs/http-api.md says, over real sockets: other REST operations get a
405, ingress headers never become properties, oversized heads get a 431, no answer quotes a
header value, and every answer (the HTTP parser's own included) is JSON with an X-Request-Id.
Nothing is sent upstream for any refused request."""

from __future__ import annotations

import orjson
import pytest

from gateway.web import rest
from sblocal.testing import BrokerProcess, ControlClient
from tests.conftest import GatewayFactory
from tests.gateway.test_integration import receive
from tests.security.test_slow_clients import open_raw, read_until_closed
from tests.support.http import exchange


async def nothing_sent(control: ControlClient) -> None:
    assert (await control.counters("primary")).get("sends", 0) == 0


# -- other REST operations: 405 ------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "operation", "allow"),
    [
        ("POST", "/orders/messages/head?timeout=60", "peek-lock", ""),
        ("DELETE", "/orders/messages/head", "receive-and-delete", ""),
        ("POST", "/orders/subscriptions/audit/Messages/Head", "peek-lock", ""),
        ("DELETE", "/orders/messages/31/7a1c7a9e-0b9c-4d1f-a6e2-3a9f6b0e1d2c", "complete", ""),
        ("PUT", "/orders/messages/31/7a1c7a9e-0b9c-4d1f-a6e2-3a9f6b0e1d2c", "unlock", ""),
        ("POST", "/orders/messages/31/7a1c7a9e-0b9c-4d1f-a6e2-3a9f6b0e1d2c", "renew-lock", ""),
        ("PUT", "/orders", "create-or-update-entity", ""),
        ("GET", "/orders?api-version=2017-04", "get-entity", ""),
        ("DELETE", "/orders", "delete-entity", ""),
        ("GET", "/orders/messages", "unsupported", "POST"),
        ("GET", "/queues/orders/messages", "unsupported", "POST"),
        ("PUT", "/topics/events/messages", "unsupported", "POST"),
        ("POST", "/metrics", "unsupported", "GET, HEAD"),
        ("GET", "/admin/entities/orders/healthy", "unsupported", "POST"),
        ("GET", "/admin/entities/orders/failover", "unsupported", "POST"),
        ("GET", "/", "unsupported", ""),
        ("DELETE", "/admin/entities", "unsupported", "GET, HEAD"),
    ],
)
async def test_other_rest_operations_get_405_with_allow_and_a_json_reason(
    gateway: GatewayFactory, control: ControlClient, method, path, operation, allow
):
    gw = await gateway()
    resp = await gw.request(method, path, data=b"<entry/>" if method == "PUT" else None)
    assert resp.status == 405
    assert resp.headers["Allow"] == allow and resp.headers["X-Request-Id"]
    body = await resp.json()
    assert body["error"] == "method_not_allowed" and body["operation"] == operation
    assert "only ingests" in body["message"]
    if path == "/" or path.startswith("/admin/"):
        # The gateway's own paths: no Service Bus operation, and nothing reads as forwarded.
        assert "Service Bus" not in body["message"] and "/openapi.json" in body["message"]
    await nothing_sent(control)


# -- ingress headers ------------------------------------------------------------------------

# What each controller adds on its way to the backend (docs/security.md names the sources).
INGRESS_HEADERS = {
    "ingress-nginx": {
        "X-Request-ID": "5f3c6a0e9b2d4c1a8e7f6d5c4b3a2910",
        "X-Real-IP": "203.0.113.7",
        "X-Forwarded-For": "203.0.113.7",
        "X-Forwarded-Host": "sb.example.com",
        "X-Forwarded-Port": "443",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Scheme": "https",
        "X-Scheme": "https",
        "X-Original-URI": "/orders/messages",
        "X-Original-Forwarded-For": "198.51.100.2",
        "X-Forwarded-Prefix": "/sb",
        "Proxy": "",
        "ssl-client-verify": "NONE",
        "ssl-client-subject-dn": "CN=client",
        "ssl-client-issuer-dn": "CN=ca",
    },
    "traefik": {
        "X-Forwarded-For": "203.0.113.7",
        "X-Forwarded-Host": "sb.example.com",
        "X-Forwarded-Port": "443",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Server": "traefik-7d9f",
        "X-Forwarded-Prefix": "/sb",
        "X-Real-Ip": "203.0.113.7",
        "X-Forwarded-Tls-Client-Cert": "MIIB",
        "X-Forwarded-Tls-Client-Cert-Info": "Subject%3D%22CN%3Dclient%22",
    },
    "envoy-istio": {
        "x-forwarded-for": "203.0.113.7",
        "x-forwarded-proto": "https",
        "x-forwarded-client-cert": "By=spiffe://cluster.local/ns/sb/sa/gw;Hash=ab",
        "x-request-id": "0f7d2f8e-9c1b-4a55-8d8e-2c6b0f5e7a11",
        "x-envoy-attempt-count": "1",
        "x-envoy-expected-rq-timeout-ms": "15000",
        "x-envoy-external-address": "203.0.113.7",
        "x-envoy-internal": "true",
        "x-envoy-original-path": "/orders/messages",
        "x-envoy-peer-metadata": "ChQKDkFQUF9DT05UQUlORVJTEgIaAA==",
        "x-envoy-peer-metadata-id": "sidecar~10.0.0.1~gw.sb~sb.svc.cluster.local",
        "x-envoy-decorator-operation": "gw.sb.svc.cluster.local:80/*",
        "x-b3-traceid": "80f198ee56343ba864fe8b2a57d3eff7",
        "x-b3-spanid": "e457b5a2e4d86bd1",
        "x-b3-parentspanid": "05e3ac9a4f6e3b90",
        "x-b3-sampled": "1",
        "b3": "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1",
        "x-ot-span-context": "80f198ee56343ba8;e457b5a2e4d86bd1;05e3ac9a4f6e3b90",
        "traceparent": "00-80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-01",
    },
    "azure-application-gateway": {
        "X-Forwarded-For": "203.0.113.7:50212",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Port": "443",
        "X-Original-Host": "sb.example.com",
        "X-Original-URL": "/orders/messages",
        "X-AppGW-Trace-Id": "f3a1c2b4d5e6f708",
        "X-ARR-LOG-ID": "7a1c7a9e-0b9c-4d1f-a6e2-3a9f6b0e1d2c",
        "X-ARR-SSL": "2048|256|CN=issuer|CN=sb.example.com",
        "X-ARR-ClientCert": "MIIB",
    },
    "azure-front-door": {
        "Via": "1.1 Azure",
        "X-Azure-ClientIP": "203.0.113.7",
        "X-Azure-SocketIP": "203.0.113.7",
        "X-Azure-Ref": "0zxV+XAAAAABKMMOjBv2NT4TY6SQVjC0zV1NURURHRTA2MTkANDM3",
        "X-Azure-RequestChain": "hops=1",
        "X-Azure-FDID": "a0a0a0a0-bbbb-cccc-dddd-e1e1e1e1e1e1",
        "X-Forwarded-For": "203.0.113.7",
        "X-Forwarded-Host": "sb.example.com",
        "X-Forwarded-Proto": "https",
        "X-FD-HealthProbe": "1",
    },
    "other proxies and CDNs": {
        "Forwarded": "for=203.0.113.7;proto=https",
        "X-Request-Start": "t=1700000000123",
        "True-Client-IP": "203.0.113.7",
        "X-Client-IP": "203.0.113.7",
        "X-Cluster-Client-IP": "203.0.113.7",
        "CF-Connecting-IP": "203.0.113.7",
        "X-Amzn-Trace-Id": "Root=1-67891233-abcdef012345678912345678",
        "X-Cloud-Trace-Context": "105445aa7843bc8bf206b120001000/1;o=1",
        "Origin": "https://app.example.com",  # a browser's, unquoted
    },
}


@pytest.mark.parametrize("controller", INGRESS_HEADERS)
def test_ingress_headers_never_become_properties(controller: str):
    headers = [*INGRESS_HEADERS[controller].items(), ("Priority", '"High"')]
    message = rest.parse_single(b"x", "text/plain", headers, None, None)
    assert message.application_properties == {"Priority": "High"}


async def test_ingress_headers_never_reach_the_broker(
    gateway: GatewayFactory, broker: BrokerProcess, control: ControlClient
):
    gw = await gateway()
    every = {k: v for headers in INGRESS_HEADERS.values() for k, v in headers.items()}
    resp = await gw.post(
        "/orders/messages",
        data=b"x",
        headers={**every, "BrokerProperties": '{"MessageId": "ingress-1"}', "n": "7"},
    )
    assert resp.status == 201, await resp.text()
    [m] = await receive(broker, "orders")
    props = {
        (k.decode() if isinstance(k, bytes) else k): v.decode() if isinstance(v, bytes) else v
        for k, v in (m.application_properties or {}).items()
    }
    # The W3C context is not copied as headers are: it goes on as the Azure SDK puts it.
    traceparent = INGRESS_HEADERS["envoy-istio"]["traceparent"]
    assert props == {"n": 7, "Diagnostic-Id": traceparent, "traceparent": traceparent}


# -- oversized heads: 431 -------------------------------------------------------------------

SECRETISH = "sig=" + "Zm9yZ2VkLXNpZ25hdHVyZS1ub3QtdG8tYmUtZWNob2Vk" * 1700  # ~70 KB


def _head(*fields: str, path: str = "/orders/messages", body: bytes = b"x") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _echoes(body: bytes, value: str, window: int = 12) -> bool:
    text = body.decode("latin-1")
    return any(value[i : i + window] in text for i in range(0, len(value) - window, 7))


async def test_one_header_line_over_the_limit_is_431_and_not_echoed(
    gateway: GatewayFactory, control: ControlClient
):
    gw = await gateway()  # max_header_bytes: 64 KB
    auth = f"SharedAccessSignature sr=https%3a%2f%2fh%2forders&{SECRETISH}&se=1&skn=k"
    status, headers, body = await exchange(gw.server.port, _head(f"Authorization: {auth}"))
    assert status == 431 and headers["x-request-id"]
    assert orjson.loads(body)["error"] == "request_header_fields_too_large"
    assert not _echoes(body, auth)
    await nothing_sent(control)


async def test_a_whole_head_over_the_limit_in_one_read_is_431(
    gateway: GatewayFactory, control: ControlClient
):
    """80 KB of 4 KB headers under a 64 KB limit: each field fits, the head does not."""
    gw = await gateway()
    fields = [f"X-Big-{i}: {'b' * 4000}" for i in range(20)]
    status, headers, body = await exchange(gw.server.port, _head(*fields))
    assert status == 431 and headers["x-request-id"]
    assert orjson.loads(body)["error"] == "request_header_fields_too_large"
    await nothing_sent(control)


async def test_a_head_just_under_the_limit_is_served(gateway: GatewayFactory, control):
    gw = await gateway({"SBGATE_MAX_HEADER_BYTES": "16384"})
    fields = [f"X-Big-{i}: {'b' * 3000}" for i in range(5)]  # ~15 KB with the rest
    status, _, body = await exchange(gw.server.port, _head(*fields))
    assert status == 201, body


# -- the HTTP parser's own rejections --------------------------------------------------------

PARSER_REJECTIONS = {
    "content-length not a number": b"POST /orders/messages HTTP/1.1\r\nHost: h\r\n"
    b"Content-Length: 1x\r\n\r\nx",
    "two content-lengths": _head("Content-Length: 2"),
    "content-length and chunked": _head("Transfer-Encoding: chunked"),
    "bad chunk size": b"POST /orders/messages HTTP/1.1\r\nHost: h\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "nul in a header value": _head("X-A: a\x00b"),
    "nul in the target": b"POST /orders\x00/messages HTTP/1.1\r\nHost: h\r\n\r\n",
    "garbage request line": b"HELLO THERE\r\n\r\n",
    "unknown version": b"POST /orders/messages HTTP/7.3\r\nHost: h\r\n\r\n",
    "space in a header name": _head("Bad Header: v"),
    "header without a colon": _head("NoColonHere"),
    "too many headers": _head(*(f"X-H{i}: v" for i in range(120))),
    "raw UTF-8 path": "POST /ördrers/messages HTTP/1.1\r\nHost: h\r\n\r\n".encode(),
    "request line too long": _head(path="/orders/messages?" + "q" * 9000),
    "TLS on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
}


@pytest.mark.parametrize("raw", PARSER_REJECTIONS.values(), ids=PARSER_REJECTIONS.keys())
async def test_every_rejection_is_json_with_a_request_id_and_sends_nothing(
    gateway: GatewayFactory, control: ControlClient, raw: bytes
):
    gw = await gateway()
    status, headers, body = await exchange(gw.server.port, raw)
    assert 400 <= status < 500, (status, body)
    assert headers["x-request-id"] and headers["content-type"].startswith("application/json")
    answer = orjson.loads(body)
    assert set(answer) >= {"error", "message"}
    assert "\\x" not in answer["message"] and "b'" not in answer["message"]  # nothing quoted
    await nothing_sent(control)


def _chunked(*chunks: bytes, last: bool = True) -> bytes:
    head = (
        b"POST /orders/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return head + body + (b"0\r\n\r\n" if last else b"")


async def test_a_chunked_body_within_the_limit_is_sent_whole(
    gateway: GatewayFactory, broker: BrokerProcess
):
    gw = await gateway({"SBGATE_MAX_BODY_BYTES": "1024"})
    status, _, answer = await exchange(gw.server.port, _chunked(b"a" * 600, b"b" * 424))
    assert status == 201, answer
    [m] = await receive(broker, "orders")
    assert b"".join(m.body) == b"a" * 600 + b"b" * 424


@pytest.mark.parametrize("complete", [True, False], ids=["whole body at once", "body still open"])
async def test_a_chunked_body_over_the_limit_is_413_and_sends_nothing(
    gateway: GatewayFactory, control: ControlClient, complete: bool
):
    """No Content-Length to refuse up front: the limit holds on the bytes read, whether the
    whole body came with the head or the handler waits for the rest of it."""
    gw = await gateway({"SBGATE_MAX_BODY_BYTES": "1024"})
    raw = _chunked(b"a" * 700, b"b" * 700, last=complete)
    status, headers, answer = await exchange(gw.server.port, raw)
    assert status == 413, answer
    assert orjson.loads(answer)["error"] == "payload_too_large" and headers["x-request-id"]
    # Chunked: the limit is known, the body's whole size is not (reading stops at the limit).
    assert orjson.loads(answer)["limit"] == 1024 and "size" not in orjson.loads(answer)
    await nothing_sent(control)


async def test_a_body_over_the_limit_by_its_length_is_413_with_size_and_limit(
    gateway: GatewayFactory, control: ControlClient
):
    gw = await gateway({"SBGATE_MAX_BODY_BYTES": "1024"})
    resp = await gw.post("/orders/messages", data=b"x" * 2000)
    assert resp.status == 413
    body = await resp.json()
    assert (body["error"], body["size"], body["limit"]) == ("payload_too_large", 2000, 1024)
    await nothing_sent(control)


async def test_after_a_431_the_connection_is_closed(gateway: GatewayFactory):
    gw = await gateway()
    reader, writer = await open_raw(gw.server.port)
    writer.write(_head(*(f"X-Big-{i}: {'b' * 4000}" for i in range(20))) + _head())
    data = await read_until_closed(reader, within=10)
    writer.close()
    # One answer (aiohttp writes its parse-error answers as HTTP/1.0: closed after it).
    assert data.startswith((b"HTTP/1.0 431", b"HTTP/1.1 431")) and data.count(b"HTTP/1.") == 1


# -- open mode: only loopback names and public hosts (DNS rebinding) ---------------------------


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8080",
        "10.0.0.1",
        "localhost.evil.example",
        "[::2]",
        "bad host",
    ],
)
async def test_open_mode_answers_421_to_a_foreign_host(
    gateway: GatewayFactory, control: ControlClient, host: str
) -> None:
    gw = await gateway()
    for method, path in (("GET", "/admin/entities"), ("POST", "/orders/messages")):
        resp = await gw.request(method, path, data=b"x", headers={"Host": host})
        body = await resp.json()
        assert resp.status == 421, body
        assert body["error"] == "misdirected_request" and resp.headers["X-Request-Id"]
    await nothing_sent(control)


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LocalHost:8080",
        "127.0.0.1",
        "127.1.2.3:9",
        "[::1]:80",
        "app.localhost",
        "gw.internal:8080",
    ],
)
async def test_open_mode_serves_loopback_names_and_public_hosts(
    gateway: GatewayFactory, host: str
) -> None:
    gw = await gateway({"SBGATE_PUBLIC_HOSTS": "gw.internal"})
    resp = await gw.post("/orders/messages", data=b"x", headers={"Host": host})
    assert resp.status == 201, await resp.text()


async def test_with_rules_the_token_decides_not_the_host(gateway: GatewayFactory) -> None:
    rules = orjson.dumps(
        {"rules": [{"name": "s", "primary_key": "k" * 44, "rights": ["Send"], "entities": ["*"]}]}
    ).decode()
    gw = await gateway({"SBGATE_AUTH_RULES": rules})
    resp = await gw.post("/orders/messages", data=b"x", headers={"Host": "evil.example"})
    assert resp.status == 401
