"""sbgate: gateway/auth — Service Bus-compatible SAS authorization, as pure logic.

The HTTP layer builds one `Authorizer` at start-up from `load_rules` / `rules_from_json` and calls
`Authorizer.authorize` per request; it raises `Unauthorized` (401) or `Forbidden` (403), request
errors of the gateway's error tree carrying ``status``, ``code`` and a ``message`` safe to
return and log. `mint_token` and `gateway.auth.cli.main` (``gateway token ...``) mint tokens.
See docs/auth.md.
"""

from gateway.auth.errors import AuthConfigError, AuthError, ErrorCode, Forbidden, Unauthorized
from gateway.auth.rules import (
    RULES_ENV_VAR,
    AuthRule,
    Right,
    Secret,
    load_rules,
    parse_rules,
    rules_from_json,
)
from gateway.auth.sas import (
    Authorizer,
    Principal,
    SasToken,
    mint_token,
    parse_token,
    resource_uri,
    sign_token,
)

__all__ = [
    "RULES_ENV_VAR",
    "AuthConfigError",
    "AuthError",
    "AuthRule",
    "Authorizer",
    "ErrorCode",
    "Forbidden",
    "Principal",
    "Right",
    "SasToken",
    "Secret",
    "Unauthorized",
    "load_rules",
    "mint_token",
    "parse_rules",
    "parse_token",
    "resource_uri",
    "rules_from_json",
    "sign_token",
]
