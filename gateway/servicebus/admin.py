"""Backlog queue provisioning with the management (ATOM/HTTPS) API.

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
from typing import Any

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.servicebus.aio.management import ServiceBusAdministrationClient

from gateway.config import NamespaceSettings
from gateway.core.backlog import BACKLOG_LOCK_DURATION

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


def admin_client(ns: NamespaceSettings) -> tuple[ServiceBusAdministrationClient, Any]:
    """The admin client for `ns` (and its credential, to close), honouring the local
    broker's separate management endpoint and CA file."""
    kwargs: dict[str, Any] = {}
    if ns.admin_ca_cert:
        kwargs["connection_verify"] = ns.admin_ca_cert
    cs = ns.admin_connection_string or ns.connection_string
    if cs is not None:
        return ServiceBusAdministrationClient.from_connection_string(cs.get(), **kwargs), None
    from azure.identity.aio import DefaultAzureCredential

    credential = DefaultAzureCredential()
    assert ns.fully_qualified_namespace is not None
    return (
        ServiceBusAdministrationClient(ns.fully_qualified_namespace, credential, **kwargs),
        credential,
    )


async def ensure_backlog_queues(
    ns: NamespaceSettings, paths: Sequence[str], *, create: bool, deadline: float
) -> ProvisionResult:
    """Check (and create, when `create`) every backlog queue in `paths`; never raises.

    Each queue's check is bounded by `deadline` seconds; a queue that cannot be verified is
    left out of rotation with its error in the result.
    """
    result = ProvisionResult()
    client, credential = admin_client(ns)
    try:
        async with client:
            for path in paths:
                try:
                    async with asyncio.timeout(deadline):
                        created = await _ensure_one(client, path, create)
                except asyncio.CancelledError:
                    raise
                except TimeoutError:
                    result.errors[path] = f"no answer from the management API within {deadline:g}s"
                    continue
                except ResourceNotFoundError:
                    result.errors[path] = (
                        "missing, and create_backlog_queues is off (verify-only mode): create it "
                        "with the backlog-queue properties or grant Manage on the secondary "
                        "namespace"
                    )
                    continue
                except ClientAuthenticationError:
                    result.errors[path] = (
                        "not authorized: the secondary namespace's credentials need the Manage "
                        "right to create backlog queues (or pre-create them and set "
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
    finally:
        if credential is not None:
            await credential.close()
    for path, err in result.errors.items():
        log.error("backlog queue %s unusable: %s", path, err, extra={"backlog": path})
    if result.created:
        log.info(
            "created backlog queues %s", result.created, extra={"backlogs_created": result.created}
        )
    return result


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
