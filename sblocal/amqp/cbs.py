"""`$cbs`: the claims-based-security node the SDK puts its SAS token to before any link.

The reply carries `correlation_id` = the request's `message_id` (the same AMQP type: the
SDKs compare the two) and the application properties `status-code` (an int; 200..299
accepts) and `status-description` — hyphenated, unlike `$management`'s `statusCode` (see
docs/design.md, "What the SDK needs from a broker"). Where it goes is the server's choice
(`sblocal.amqp.server`): the link the request's reply-to names (Node: a link name; .NET: a
target address), or with no reply-to (Python) the requester session's `$cbs` link.
"""

from __future__ import annotations

from typing import Any

from proton import Message

from sblocal import codec, sas
from sblocal.store import Namespace


def put_token(ns: Namespace, request: Message) -> tuple[Message, str | None]:
    """The reply to one `$cbs` request, and the entity path it now authorizes on the
    connection ('' for the whole namespace), or None when it authorizes nothing.

    The token must cover the request's ``name`` (the audience the client asks for), as on
    Service Bus: a token signed for another entity is refused here, not at attach.
    """
    props: dict[Any, Any] = request.properties or {}
    status, description = 200, "OK"
    name = props.get("name")
    audience = name if isinstance(name, str) else None
    granted: str | None = None
    if props.get("operation") != "put-token":
        status, description = 400, f"Unsupported $cbs operation {props.get('operation')!r}."
    elif ns.config.keys:
        body = request.body
        token = body if isinstance(body, str) else codec.to_text(body) or ""
        try:
            resource = sas.verify(token, ns.config.key_map, audience=audience)
        except sas.SasError as exc:
            status, description = 401, f"amqp:unauthorized-access: {exc}"
        else:
            granted = sas.scope(audience if audience is not None else resource)
    else:
        granted = ""
    with ns.lock:
        if status == 200:
            ns.counters.cbs_tokens += 1
        else:
            ns.counters.cbs_rejected += 1
    reply = Message(
        correlation_id=request.id,
        properties={"status-code": status, "status-description": description},
    )
    return reply, granted
