"""Routing of the management API: which resource a raw path names, its checks, and SAS."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final, Literal
from urllib.parse import unquote

from aiohttp import web

from sblocal import sas

MAX_PAGE: Final = 100


class HttpError(Exception):
    """A failure answered as the service answers it: an HTTP status and an Error body."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


RouteKind = Literal["entity", "entities", "subscriptions", "subscription", "namespace"]


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    kind: RouteKind
    path: str = ""  # entity path, topic path, or the entity type of a listing
    name: str = ""  # subscription name


def parse_route(raw_path: str) -> Route:
    raw = raw_path.strip("/").split("/") if raw_path.strip("/") else []
    if not raw:
        raise HttpError(400, "The request has no entity path.")
    segments = [unquote(part) for part in raw]
    lowered = [part.lower() for part in raw]
    if lowered[0] == "$namespaceinfo" and len(raw) == 1:
        return Route("namespace")
    if lowered[0] == "$resources" and len(raw) == 2:
        return Route("entities", path=segments[1].lower())
    if len(raw) >= 2 and lowered[-1] == "subscriptions":
        return Route("subscriptions", path=_entity_path(segments[:-1]))
    if len(raw) >= 3 and lowered[-2] == "subscriptions":
        return Route(
            "subscription", path=_entity_path(segments[:-2]), name=_subscription_name(segments[-1])
        )
    if "rules" in lowered and "subscriptions" in lowered:
        raise HttpError(400, "Subscription rules are not emulated by sblocal.")
    return Route("entity", path=_entity_path(segments))


_FORBIDDEN_CHARS: Final = frozenset("@?#*\\")


def _entity_path(segments: list[str]) -> str:
    path = "/".join(segments).strip("/")
    if not path or len(path) > 260:
        raise HttpError(400, f"The entity path {path!r} must be 1 to 260 characters long.")
    if _FORBIDDEN_CHARS & set(path) or "//" in path:
        raise HttpError(400, f"The entity path {path!r} contains invalid characters.")
    if any(part.startswith("$") for part in path.split("/")):
        raise HttpError(400, f"The entity path {path!r} uses a reserved name.")
    return path


def _subscription_name(name: str) -> str:
    if not name or len(name) > 50 or "/" in name or _FORBIDDEN_CHARS & set(name):
        raise HttpError(400, f"The subscription name {name!r} is invalid.")
    if name.startswith("$"):
        raise HttpError(400, f"The subscription name {name!r} uses a reserved name.")
    return name


def check_sas(header: str | None, keys: Mapping[str, str], resource: str) -> None:
    """Verify the request's SAS token for `resource` with the broker's one verifier
    (`sblocal.sas.verify`, shared with AMQP `$cbs`). Raises HttpError(401)."""
    if not header:
        raise HttpError(401, "MissingToken: The authorization header was not found.")
    try:
        sas.verify(header, keys, audience=resource)
    except sas.SasError as exc:
        raise HttpError(401, str(exc)) from None


def paging(request: web.Request) -> tuple[int, int]:
    try:
        skip = int(request.query.get("$skip", "0"))
        top = int(request.query.get("$top", str(MAX_PAGE)))
    except ValueError:
        raise HttpError(400, "$skip and $top must be integers.") from None
    if skip < 0 or top < 1:
        raise HttpError(400, "$skip must be >= 0 and $top >= 1.")
    return skip, min(top, MAX_PAGE)
