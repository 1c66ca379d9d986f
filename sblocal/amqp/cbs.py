"""`$cbs`: the claims-based-security node the SDK puts its SAS token to before any link.

The SDK's put-token request has no reply-to: the reply goes on the connection's link whose
source is `$cbs`, with `correlation_id` = the request's `message_id` and the application
properties `status-code` (an int; 200..299 accepts) and `status-description` — hyphenated,
unlike `$management`'s `statusCode` (see docs/design.md, "What the SDK needs from a broker").
"""

from __future__ import annotations

from typing import Any

from proton import Message

from sblocal import codec, sas
from sblocal.store import Namespace


def put_token(ns: Namespace, request: Message) -> tuple[Message, bool]:
    """The reply to one `$cbs` request, and whether the connection is now authorized."""
    props: dict[Any, Any] = request.properties or {}
    status, description = 200, "OK"
    if props.get("operation") != "put-token":
        status, description = 400, f"Unsupported $cbs operation {props.get('operation')!r}."
    elif ns.config.keys:
        body = request.body
        token = body if isinstance(body, str) else codec.to_text(body) or ""
        try:
            sas.verify(token, ns.config.key_map)
        except sas.SasError as exc:
            status, description = 401, f"amqp:unauthorized-access: {exc}"
    with ns.lock:
        if status == 200:
            ns.counters.cbs_tokens += 1
        else:
            ns.counters.cbs_rejected += 1
    reply = Message(
        correlation_id=request.id,
        properties={"status-code": status, "status-description": description},
    )
    return reply, status == 200
