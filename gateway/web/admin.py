"""Admin API: failover state per entity, and the operator's two levers.

``GET /admin/entities``; ``POST /admin/entities/{entity}/healthy`` (the old SDK's
MarkPathHealthy); ``POST /admin/entities/{entity}/failover``. Protected by the ``Manage``
right once authorization is configured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from gateway.auth import Right
from gateway.core.failover import Failover
from gateway.core.presence import Check, EntityPresence
from gateway.entitypath import validate_entity_path
from gateway.errors import GatewayError
from gateway.state.base import EntityState
from gateway.web.auth import PRINCIPAL, authorize
from gateway.web.handlers import EDGE, edge, json_response


class FailoverNotConfigured(GatewayError):
    """No namespace pair has a secondary namespace, or failover is disabled."""

    status = 409
    code = "failover_not_configured"


FAILOVER = web.AppKey("failover", Failover)
# Whether the configured entities exist at the primary: the check (set by the app factory)
# and, once started, its results.
ENTITY_CHECK = web.AppKey[Check]("entity_check")
PRESENCE = web.AppKey("presence", EntityPresence)


def _failover(request: web.Request) -> Failover:
    failover = request.app.get(FAILOVER)
    if failover is None:
        raise FailoverNotConfigured(
            "failover is not configured: set a secondary namespace and failover.enabled"
        )
    return failover


async def list_entities(request: web.Request) -> web.StreamResponse:
    authorize(request, None, Right.MANAGE)
    failover = request.app.get(FAILOVER)
    if failover is None:
        entities = [
            {"entity": e.path, "kind": e.kind, "state": "healthy", "failover": False}
            for e in request.app[EDGE].catalog.all()
        ]
    else:
        entities = await failover.describe()
    _add_presence(entities, request.app.get(PRESENCE))
    return json_response(200, {"entities": entities})


def _add_presence(entities: list[dict[str, Any]], presence: EntityPresence | None) -> None:
    """Each row's `missing`: why the entity does not exist at its primary, or null (it does,
    or it could not be checked: then `checkUnavailable` says why)."""
    for row in entities:
        row["missing"] = presence.reason(row["entity"]) if presence is not None else None
        if presence is not None and presence.unchecked is not None:
            row["checkUnavailable"] = presence.unchecked


def _entity_path(request: web.Request) -> str:
    path = validate_entity_path(request.match_info["entity"])
    authorize(request, path, Right.MANAGE)
    return path


def _operator(request: web.Request) -> str | None:
    """Who acts: the rule name of the key that authorized the request (None: open mode)."""
    principal = request.get(PRINCIPAL)
    return None if principal is None else principal.key_name


async def mark_healthy(request: web.Request) -> web.StreamResponse:
    path = _entity_path(request)
    failover = _failover(request)
    entity = request.app[EDGE].catalog.resolve(path)
    return json_response(200, _answer(failover.mark_healthy(entity, _operator(request))))


async def force_failover(request: web.Request) -> web.StreamResponse:
    path = _entity_path(request)
    failover = _failover(request)
    entity = request.app[EDGE].catalog.resolve(path)
    return json_response(200, _answer(failover.force_failover(entity, _operator(request))))


def _answer(st: EntityState) -> dict[str, Any]:
    """The entity's new state, named `state` as in `GET /admin/entities` (`status`, the
    same value, stays for scripts written against earlier versions)."""
    return {"state": st.status, **dataclasses.asdict(st)}


def add_admin_routes(app: web.Application) -> None:
    # Registered before the catch-all message routes would match "/admin/.../messages".
    app.router.add_get("/admin/entities", edge(list_entities))
    app.router.add_post("/admin/entities/{entity:.+}/healthy", edge(mark_healthy))
    app.router.add_post("/admin/entities/{entity:.+}/failover", edge(force_failover))
