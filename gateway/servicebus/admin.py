"""Backlog queue provisioning with the management (ATOM/HTTPS) API, and the check that the
configured entities exist at the primary (`missing_entities`).

At start-up each backlog queue ``<primary-ns>/x-servicebus-transfer/<i>`` is checked in the
secondary namespace: it exists → used as it is (the owner's choice); missing → created with
exactly the properties of docs/design.md#backlog-queues (or, in verify-only mode, reported as
a clear error and left out of rotation). Extra queues are left alone; nothing is ever deleted.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
)
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from gateway.config import NamespaceSettings
from gateway.core.backlog import BACKLOG_LOCK_DURATION
from gateway.core.presence import CheckUnavailable

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

log = logging.getLogger(__name__)

TIMESPAN_MAX = "P10675199DT2H48M5.4775807S"
# Exactly these properties (docs/design.md#backlog-queues); every other one keeps its default.
BACKLOG_QUEUE_PROPERTIES: dict[str, Any] = {
    "max_size_in_megabytes": 5120,
    "max_delivery_count": 2147483647,
    "default_message_time_to_live": TIMESPAN_MAX,
    "auto_delete_on_idle": TIMESPAN_MAX,
    "lock_duration": dt.timedelta(seconds=BACKLOG_LOCK_DURATION),
    "dead_lettering_on_message_expiration": True,
    "enable_batched_operations": True,
}


@dataclass
class ProvisionResult:
    usable: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def admin_client(
    ns: NamespaceSettings, credential: AsyncTokenCredential | None = None
) -> ServiceBusAdministrationClient:
    """The admin client for `ns`, honouring the local broker's separate management endpoint
    and CA file. A namespace given by name uses `credential`, the process's shared one (the
    caller owns it: closing this client leaves it open)."""
    kwargs: dict[str, Any] = {}
    if ns.admin_ca_cert:
        kwargs["connection_verify"] = ns.admin_ca_cert
    cs = ns.admin_connection_string or ns.connection_string
    if cs is not None:
        return ServiceBusAdministrationClient.from_connection_string(cs.get(), **kwargs)
    if credential is None or ns.fully_qualified_namespace is None:
        raise ValueError(f"namespace {ns.name}: no connection string, no credential")
    return ServiceBusAdministrationClient(ns.fully_qualified_namespace, credential, **kwargs)


async def ensure_backlog_queues(
    ns: NamespaceSettings,
    paths: Sequence[str],
    *,
    create: bool,
    deadline: float,
    credential: AsyncTokenCredential | None = None,
) -> ProvisionResult:
    """Check (and create, when `create`) every backlog queue in `paths`; never raises.

    Each queue's check is bounded by `deadline` seconds; a queue that cannot be verified is
    left out of rotation with its error in the result. `credential`: see `admin_client`.
    """
    result = ProvisionResult()
    client = admin_client(ns, credential)
    async with client:
        for i, path in enumerate(paths):
            try:
                async with asyncio.timeout(deadline):
                    created = await _ensure_one(client, path, create)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, ServiceRequestError, OSError) as exc:
                # The namespace, not the queue: the others would wait as long to fail alike.
                error = _unreachable(ns, exc, deadline)
                result.errors.update(dict.fromkeys(paths[i:], error))
                break
            except ResourceNotFoundError:
                result.errors[path] = (
                    "missing, and create_backlog_queues is off (verify-only mode): create it "
                    "with the backlog-queue properties or grant Manage on the secondary "
                    "namespace"
                )
                continue
            except ClientAuthenticationError as exc:
                # Also a credential that could not get a token (CredentialUnavailableError).
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                result.errors[path] = (
                    f"not authorized ({first}): the secondary namespace's credentials need the "
                    "Manage right to create backlog queues (or pre-create them and set "
                    "create_backlog_queues=false)"
                )
                continue
            except HttpResponseError as exc:
                result.errors[path] = f"management API error {exc.status_code}: {exc.reason}"
                continue
            except Exception as exc:  # any other failure: out of rotation, reported
                result.errors[path] = f"{type(exc).__name__}: {exc}"
                continue
            result.usable.append(path)
            if created:
                result.created.append(path)
    by_error: dict[str, list[str]] = {}
    for path, err in result.errors.items():
        by_error.setdefault(err, []).append(path)
    for err, failed in by_error.items():  # one line per cause, not one per queue
        what = f"backlog queue {failed[0]}"
        if len(failed) > 1:
            what = f"{len(failed)} backlog queues ({failed[0]} to {failed[-1]})"
        log.error("%s unusable: %s", what, err, extra={"backlogs": failed})
    if result.created:
        log.info(
            "created backlog queues %s", result.created, extra={"backlogs_created": result.created}
        )
    return result


def _unreachable(ns: NamespaceSettings, exc: BaseException, deadline: float) -> str:
    """Why the management endpoint of `ns` cannot be used at all, in one line."""
    if isinstance(exc, TimeoutError):
        why = f"no answer within {deadline:g}s"
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = first
    return (
        f"the {ns.name} namespace's management endpoint cannot be reached ({why}): check its "
        "connection string or name, the network, and (local broker) admin_ca_cert"
    )


async def _ensure_one(client: ServiceBusAdministrationClient, path: str, create: bool) -> bool:
    try:
        await client.get_queue(path)
        return False
    except ResourceNotFoundError:
        if not create:
            raise
    try:
        await client.create_queue(path, **BACKLOG_QUEUE_PROPERTIES)
    except ResourceExistsError:  # another replica created it first
        return False
    return True


async def missing_entities(
    ns: NamespaceSettings,
    entities: Sequence[tuple[str, str]],
    *,
    deadline: float,
    credential: AsyncTokenCredential | None = None,
) -> list[str]:
    """Which of `entities` (path, ``queue`` or ``topic``) `ns` lacks, by listing its queues and
    topics (names compare case-insensitively, as Service Bus does); at most `deadline`
    seconds per 100 entities looked for. Raises `CheckUnavailable` when the namespace cannot
    be listed: without the Manage right (not worth retrying), or unreachable (worth it)."""
    kinds = {kind for _, kind in entities}
    found: set[tuple[str, str]] = set()
    # One deadline per page of the listing (100 entities each) a namespace of that many
    # entities needs at least: thousands of entities are a long listing, not a dead endpoint.
    within = deadline * (1 + len(entities) // 100)
    try:
        async with asyncio.timeout(within), admin_client(ns, credential) as client:
            if "queue" in kinds:
                found |= {("queue", q.name.lower()) async for q in client.list_queues()}
            if "topic" in kinds:
                found |= {("topic", t.name.lower()) async for t in client.list_topics()}
    except asyncio.CancelledError:
        raise
    except ClientAuthenticationError:
        raise CheckUnavailable(
            f"the {ns.name} namespace's credentials may not list its entities (the Manage "
            "right): sends will say it when an entity is missing",
            retry=False,
        ) from None
    except HttpResponseError as exc:
        if exc.status_code in (401, 403):
            raise CheckUnavailable(
                f"the {ns.name} namespace's credentials may not list its entities (the Manage "
                "right): sends will say it when an entity is missing",
                retry=False,
            ) from None
        raise CheckUnavailable(
            f"the {ns.name} namespace's management API answered {exc.status_code}", retry=True
        ) from None
    except (TimeoutError, ServiceRequestError, OSError, ValueError) as exc:
        raise CheckUnavailable(_unreachable(ns, exc, within), retry=True) from None
    return [path for path, kind in entities if (kind, path.lower()) not in found]
