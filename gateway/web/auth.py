"""SAS authorization at the HTTP edge: one `Authorizer`, built once at start-up.

Message routes need the ``Send`` right on the entity; admin routes need ``Manage``. Health,
readiness and metrics stay open (probes and Prometheus). Without rules the gateway runs
open — which the CLI allows only on a loopback address unless told otherwise.
"""

from __future__ import annotations

from aiohttp import web

from gateway.auth import Authorizer, Principal, Right, load_rules, rules_from_json
from gateway.config import Settings

AUTHORIZER = web.AppKey("authorizer", Authorizer)
PRINCIPAL = web.RequestKey("principal", Principal)


def build_authorizer(settings: Settings) -> Authorizer | None:
    """The authorizer for `settings`, or None when no rules are configured.

    Raises `AuthConfigError` (a ValueError naming the bad field) on a bad rules file."""
    if settings.auth_rules_file:
        rules = load_rules(settings.auth_rules_file)
    elif settings.auth_rules is not None:
        rules = rules_from_json(settings.auth_rules.get(), source="SBGATE_AUTH_RULES")
    else:
        return None
    hosts = settings.public_hosts or ("localhost", "127.0.0.1", settings.listen_host)
    return Authorizer(
        rules,
        hosts,
        clock_skew=settings.auth_clock_skew,
        max_token_lifetime=settings.auth_max_token_lifetime or None,
        token_cache_size=settings.auth_token_cache_size,
        token_cache_bytes=settings.auth_token_cache_bytes,
    )


def authorize(request: web.Request, entity_path: str | None, right: Right) -> Principal | None:
    """Raise `Unauthorized` (401) / `Forbidden` (403) unless the request may do `right`;
    the principal that may (also stored as the request's `PRINCIPAL`), None in open mode."""
    authorizer = request.app.get(AUTHORIZER)
    if authorizer is None:
        return None
    principal = authorizer.authorize(
        request.headers.get("Authorization"), entity_path=entity_path, right=right
    )
    request[PRINCIPAL] = principal
    return principal
