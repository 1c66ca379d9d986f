"""Microsoft Entra ID for Redis: an access token as the password, the identity's object id
as the user name, renewed before it expires.

Azure Cache for Redis and Azure Managed Redis accept a token for the scope
`https://redis.azure.com/.default` in `AUTH <object id> <token>`, and close a connection
whose token has expired unless it re-authenticated first. The token comes from the same
azure-identity credential kinds as Service Bus uses (`workload`, `managed`, `default`:
`gateway.servicebus.identity.create_credential`), so one identity configuration serves both.

The store asks `prepare()` before it opens connections (fetching a token may take seconds;
a connection attempt is bounded by `op_timeout`, so the fetch happens before, under its own
deadline) and `renew_in()` after: it opens a new session with the fresh token at least
`RENEW_MARGIN` seconds (plus jitter, so replicas do not renew in step) before the token
expires and closes the old one (`RedisStateStore._renew`). No connection outlives its
token, the subscriber's and any checked-out one included.

Why not the `redis-entraid` package: it has no workload-identity credential (the one AKS
uses), its token fetches are synchronous (they would block the event loop), and its
re-authentication rides on redis-py's in-place `AUTH`, which a subscribed connection
accepts only under RESP3 and which races our own reads of that connection. A fresh session
needs none of that and works the same in every mode.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from gateway.state.connect import ExpiringCredentialProvider

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

log = logging.getLogger(__name__)

SCOPE = "https://redis.azure.com/.default"
RENEW_MARGIN = 180.0  # seconds before expiry, at least
RENEW_JITTER = 60.0  # more, at random, at most (never more than a quarter of the lifetime)
FETCH_TIMEOUT = 30.0  # one token request, our own deadline


class TokenError(Exception):
    """No usable token: the credential failed, or its token carries no object id."""


def object_id(token: str) -> str:
    """The `oid` claim of a JWT access token (read, not verified: Redis verifies it)."""
    try:
        payload = token.split(".")[1]
        claims = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        oid = claims["oid"]
    except (IndexError, ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise TokenError(f"the access token has no readable oid claim ({exc!r})") from None
    if not isinstance(oid, str) or not oid:
        raise TokenError("the access token's oid claim is empty")
    return oid


class EntraIdCredentials(ExpiringCredentialProvider):
    """`(object id, token)` for each new Redis connection, from `credential`; owns it and
    closes it in `aclose`. `clock` is wall time (token expiry is absolute)."""

    def __init__(
        self,
        credential: AsyncTokenCredential,
        *,
        clock: Callable[[], float] = time.time,
        margin: float = RENEW_MARGIN,
        jitter: float = RENEW_JITTER,
    ) -> None:
        self._credential = credential
        self._clock = clock
        self._margin = margin
        self._jitter = jitter
        self._current: tuple[str, str] | None = None
        self._renew_at = 0.0
        self._lock = asyncio.Lock()

    async def prepare(self) -> None:
        """Fetch a token if there is none or the current one is due for renewal. Bounded
        by `FETCH_TIMEOUT`; raises `TokenError` (or TimeoutError) if none can be had."""
        async with self._lock:
            if self._current is not None and self._clock() < self._renew_at:
                return
            try:
                async with asyncio.timeout(FETCH_TIMEOUT):
                    token = await self._credential.get_token(SCOPE)
            except TimeoutError:
                raise
            except Exception as exc:  # azure-identity's errors vary by credential kind
                raise TokenError(f"no Entra ID token for Redis: {exc}") from exc
            user = object_id(token.token)
            now = self._clock()
            lifetime = max(0.0, token.expires_on - now)
            jitter = random.uniform(0.0, min(self._jitter, lifetime / 4))  # noqa: S311  # jitter
            self._renew_at = token.expires_on - self._margin - jitter
            self._current = (user, token.token)
            log.info(
                "state: Entra ID token for redis user %s, expires in %.0f s, renewed in %.0f s",
                user,
                lifetime,
                self._renew_at - now,
            )

    async def get_credentials_async(self) -> tuple[str, str]:
        if self._current is None:
            await self.prepare()
        assert self._current is not None
        return self._current

    def renew_in(self) -> float | None:
        return self._renew_at - self._clock()

    async def aclose(self) -> None:
        await self._credential.close()
