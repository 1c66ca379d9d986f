"""Link addresses and token audiences → entity paths, and where a request's reply goes.

The SDKs name the same entity three ways on a sender's target: Python
``amqps://host:port/orders`` (even in plain mode), Node ``orders``, .NET ``/orders``. A
token audience is ``sb://host[:port]/orders`` (or ``.../orders/$management``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = ["ReplyCandidate", "audience_path", "entity_path", "reply_link"]


def entity_path(address: str) -> str:
    """The entity path of a link address: scheme and host dropped, no outer slashes.

    ``amqps://h:5671/orders`` → ``orders``; ``/orders`` → ``orders``;
    ``orders/$management`` stays as it is. Case is kept (entity names compare without
    case; that is the caller's business).
    """
    if "://" in address:
        rest = address.split("://", 1)[1]
        address = rest.split("/", 1)[1] if "/" in rest else ""
    return address.strip("/")


def audience_path(audience: str) -> str:
    """The entity path a token audience names (``sb://host:port/orders`` → ``orders``)."""
    return entity_path(audience)


L = TypeVar("L", bound="ReplyCandidate")


class ReplyCandidate(Protocol):
    """What reply routing needs to know of a link (``sbamqp.engine.Link`` has it)."""

    @property
    def name(self) -> str: ...

    @property
    def is_server_sender(self) -> bool: ...

    @property
    def source_address(self) -> str | None: ...

    @property
    def target_address(self) -> str | None: ...


def reply_link(
    reply_to: str | None, node: str, same_session: Iterable[L], connection: Iterable[L]
) -> L | None:
    """The link (on which this side sends) to carry a request's reply, or None.

    With a ``reply_to``: the connection's sending link whose name is it (Node names its
    reply receiver so), else whose target address is it (.NET), else whose source address
    is it. Without one (Python): the sending link on the request's session whose source is
    the node (``$cbs`` or ``orders/$management``).
    """
    senders = [link for link in connection if link.is_server_sender]
    if reply_to:
        for attr in ("name", "target_address", "source_address"):
            for link in senders:
                if getattr(link, attr) == reply_to:
                    return link
        return None
    wanted = entity_path(node)
    for link in same_session:
        if link.is_server_sender and entity_path(link.source_address or "") == wanted:
            return link
    return None
