"""The requests each Service Bus REST client family builds, reproduced byte for byte.

Each builder follows the client's own code, described with its source in docs/compat.md, and
returns the raw HTTP/1.1 request (head and body) that client writes on the socket. The legacy
clients' builders are checked against requests captured from the real packages
(tests/compat/data/captured.json) in the family's test module.

Everything here is pure: the expiry is passed in, so a request can be rebuilt exactly.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import quote, quote_plus

Scalar = str | int | float | bool | datetime


@dataclass(frozen=True)
class HttpRequest:
    """One request as a client writes it: method, target, ordered header fields, body."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""

    def raw(self) -> bytes:
        head = f"{self.method} {self.target} HTTP/1.1\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in self.headers)
        return head.encode("latin-1") + b"\r\n" + self.body

    def header(self, name: str) -> str | None:
        return next((v for n, v in self.headers if n.lower() == name.lower()), None)


@dataclass(frozen=True)
class Message:
    """What an application hands its client: a body and properties."""

    body: str
    broker_properties: Mapping[str, Scalar] = field(default_factory=dict)
    custom_properties: Mapping[str, Scalar] = field(default_factory=dict)
    content_type: str | None = None


def _hmac_b64(key: str, text: str) -> str:
    """Every family signs with the key string's UTF-8 bytes (never base64-decoded)."""
    digest = hmac.new(key.encode("utf-8"), text.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def _rfc1123(value: datetime) -> str:
    return value.strftime("%a, %d %b %Y %H:%M:%S GMT")


# -- legacy Python: azure-servicebus 0.21.1 / 0.50 control_client, ServiceBusService ----------

PYTHON_ATOM = "application/atom+xml;type=entry;charset=utf-8"


def _py_basic(value: Scalar) -> str:
    """`Message._serialize_basic_properties_value`: strings as they are, the rest str().lower()."""
    if isinstance(value, str):
        return value
    if isinstance(value, datetime):
        return _rfc1123(value)
    return str(value).lower()


def _py_escaped(value: Scalar) -> str:
    """`Message._serialize_escaped_properties_value`: a custom-property header value."""
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, datetime):
        return f'"{_rfc1123(value)}"'
    return str(value).lower()


def _py_authorization(host: str, path: str, key_name: str, key: str, expiry: int) -> str:
    """`ServiceBusSASAuthentication._get_authorization` over `_HTTPClient.get_uri`: the URL
    with the scheme's default port written out, quote(safe='') then lower-cased."""
    uri = quote(f"https://{host}:443{path}", "").lower()
    signature = quote(_hmac_b64(key, f"{uri}\n{expiry}"), "")
    return f"SharedAccessSignature sig={signature}&se={expiry}&skn={key_name}&sr={uri}"


def legacy_python(
    entity: str,
    message: Message,
    *,
    host: str,
    key_name: str,
    key: str,
    expiry: int,
) -> HttpRequest:
    """`ServiceBusService.send_queue_message` / `send_topic_message` (same request)."""
    path = f"/{entity}/messages"
    headers: list[tuple[str, str]] = [
        (name, _py_escaped(value)) for name, value in message.custom_properties.items()
    ]
    headers.append(("Content-Type", message.content_type or PYTHON_ATOM))
    if message.broker_properties:
        props = {k: _py_basic(v) for k, v in message.broker_properties.items()}
        headers.append(("BrokerProperties", json.dumps(props)))
    return _py_request(path, headers, message.body.encode(), host, key_name, key, expiry)


def legacy_python_batch(
    entity: str,
    messages: Sequence[Message],
    *,
    host: str,
    key_name: str,
    key: str,
    expiry: int,
) -> HttpRequest:
    """`ServiceBusService.send_queue_message_batch`: every property as a string."""
    items = []
    for m in messages:
        item: dict[str, object] = {"Body": m.body}
        if m.custom_properties:
            item["UserProperties"] = {k: _py_basic(v) for k, v in m.custom_properties.items()}
        if m.broker_properties:
            item["BrokerProperties"] = {k: _py_basic(v) for k, v in m.broker_properties.items()}
        items.append(item)
    headers = [("Content-Type", "application/vnd.microsoft.servicebus.json")]
    body = json.dumps(items).encode()
    return _py_request(f"/{entity}/messages", headers, body, host, key_name, key, expiry)


def _py_request(
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    host: str,
    key_name: str,
    key: str,
    expiry: int,
) -> HttpRequest:
    # requests adds Host, User-Agent, Accept-Encoding and Connection first; the client's own
    # headers follow in the order it appended them, Content-Length and Authorization last.
    fields = [
        ("Host", host),
        ("User-Agent", "pyazure/0.21.1"),
        ("Accept-Encoding", "gzip, deflate"),
        ("Connection", "keep-alive"),
        *headers,
        ("Content-Length", str(len(body))),
        ("Authorization", _py_authorization(host, path, key_name, key, expiry)),
    ]
    return HttpRequest("POST", path, tuple(fields), body)


# -- legacy Node.js: azure-sb 0.11.2 (azure-common 0.9.27), ServiceBusService ----------------

NODE_API_VERSION = "2016-07"


def _encode_uri_component(text: str) -> str:
    """JavaScript's encodeURIComponent (upper-case hex)."""
    return quote(text, safe="-_.!~*'()")


def _node_value(value: Scalar) -> str:
    """`setRequestHeaders`: strings and dates quoted, everything else `toString()`."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, datetime):
        return f'"{_rfc1123(value)}+0000"'  # azure-common's RFC1123.format
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def legacy_node(
    entity: str,
    message: Message | str,
    *,
    host: str,
    key_name: str,
    key: str,
    expiry: int,
) -> HttpRequest:
    """`ServiceBusService.sendQueueMessage` / `sendTopicMessage` (same request).

    A plain string message sets no header, so azure-common sends ``content-type:`` empty; a
    message object with properties gets ``text/plain`` unless it names a ``contentType`` (the
    way Node.js applications send batches with this client)."""
    target = f"/{entity}/Messages?api-version={NODE_API_VERSION}"
    # Header order: what setRequestHeaders sets (in the message object's key order, taken
    # here as contentType, brokerProperties, customProperties; then text/plain when it set
    # anything but no content type), Accept-Charset, then azure-common's empty content-type
    # when nothing was set at all, content-length, host, authorization, user-agent.
    fields: list[tuple[str, str]] = []
    body = message if isinstance(message, str) else message.body
    if not isinstance(message, str):
        if message.content_type:
            fields.append(("content-type", message.content_type))
        if message.broker_properties:
            props = json.dumps(dict(message.broker_properties), separators=(",", ":"))
            fields.append(("brokerproperties", props))
        for name, value in message.custom_properties.items():
            fields.append((name, _node_value(value)))
        if fields and not message.content_type:
            fields.append(("content-type", "text/plain"))
    set_any = bool(fields)
    fields.append(("Accept-Charset", "UTF-8"))
    if not set_any:
        fields.append(("content-type", ""))
    raw = body.encode()
    # The signed URL is the request URL as url.format builds it: port written out, query kept.
    url = f"https://{host}:443{target}"
    uri = _encode_uri_component(url.lower()).lower()
    signature = _encode_uri_component(_hmac_b64(key, f"{uri}\n{expiry}"))
    authorization = f"SharedAccessSignature sig={signature}&se={expiry}&skn={key_name}&sr={uri}"
    fields += [
        ("content-length", str(len(raw))),
        ("host", host),  # azure-common writes the host name without the port
        ("authorization", authorization),
        ("user-agent", "Azure-SDK-For-Node.js/0.9.27"),
        ("Connection", "keep-alive"),
    ]
    return HttpRequest("POST", target, tuple(fields), raw)


# -- the REST API reference's own example (curl, sr = https://<namespace>/<entity>) ----------


def rest_reference_token(resource: str, key_name: str, key: str, expiry: int) -> str:
    """The "Generate SAS token" sample: sr and sig quote_plus()'d, fields sr, sig, se, skn."""
    sr = quote_plus(resource)
    signature = quote_plus(_hmac_b64(key, f"{sr}\n{expiry}"))
    return f"SharedAccessSignature sr={sr}&sig={signature}&se={expiry}&skn={key_name}"


def rest_reference(
    entity: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    *,
    host: str,
    key_name: str,
    key: str,
    expiry: int,
) -> HttpRequest:
    """``curl -X POST https://<ns>/<entity>/messages?timeout=60 -H ...``: curl's own Host,
    User-Agent and Accept first, then the example's headers, then Content-Length."""
    token = rest_reference_token(f"https://{host}/{entity}", key_name, key, expiry)
    fields = [
        ("Host", host),
        ("User-Agent", "curl/8.5.0"),
        ("Accept", "*/*"),
        ("Authorization", token),
        *headers,
        ("Content-Length", str(len(body))),
    ]
    return HttpRequest("POST", f"/{entity}/messages?timeout=60", tuple(fields), body)


# -- today's SDKs: tokens for the sb:// resource URI -----------------------------------------


def sdk_token(resource: str, key_name: str, key: str, expiry: int) -> str:
    """The token azure-servicebus 7 mints for a resource (its own helper, unmodified)."""
    from azure.servicebus._pyamqp.utils import generate_sas_token

    token: str = generate_sas_token(resource, key_name, key, expiry)  # type: ignore[no-untyped-call]
    return token
