"""Microsoft Entra ID credentials for namespaces given by name (no connection string).

One credential per process, picked by the ``azure_credential`` setting and shared by every
`ServiceBusClient` and the administration client, so a token is fetched once and cached
(azure-identity refreshes it before it expires) instead of once per client or per call:

* ``workload`` — `WorkloadIdentityCredential`: AKS workload identity. The webhook projects
  ``AZURE_CLIENT_ID``, ``AZURE_TENANT_ID`` and ``AZURE_FEDERATED_TOKEN_FILE`` into the pod;
  azure-identity reads them (``azure_client_id`` overrides the client id).
* ``managed`` — `ManagedIdentityCredential`: the VM's or node's managed identity;
  ``azure_client_id`` picks a user-assigned one.
* ``default`` — `DefaultAzureCredential`: tries a chain (environment, workload, managed
  identity, Azure CLI, ...) — for development. Azure's guidance for production is a
  deterministic credential: the chart sets ``workload`` when workload identity is on.

The owner (`gateway.app`, `gateway drain`) closes the credential once, after every client that
uses it is closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, get_args

from gateway.config import ConfigError, CredentialKind

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

CREDENTIAL_KINDS: Final[tuple[str, ...]] = get_args(CredentialKind)


def create_credential(
    kind: CredentialKind, client_id: str | None = None, **kwargs: Any
) -> AsyncTokenCredential:
    """A new async azure-identity credential of `kind`.

    `kwargs` go to the credential (azure-core transport options such as ``connection_verify``,
    or ``authority``). Raises ValueError when the environment lacks what the credential
    needs (workload identity without its token file, for example).
    """
    from azure.identity import aio

    if kind == "workload":
        return aio.WorkloadIdentityCredential(client_id=client_id, **kwargs)
    if kind == "managed":
        return aio.ManagedIdentityCredential(client_id=client_id, **kwargs)
    if kind == "default":
        if client_id:
            kwargs.setdefault("managed_identity_client_id", client_id)
            kwargs.setdefault("workload_identity_client_id", client_id)
        return aio.DefaultAzureCredential(**kwargs)
    raise ValueError(f"azure_credential must be one of {list(CREDENTIAL_KINDS)}, got {kind!r}")


class SharedCredential:
    """The process's one credential: created on first use, closed once by its owner.

    A process whose namespaces all use connection strings never creates one.
    """

    def __init__(self, kind: CredentialKind, client_id: str | None = None, **kwargs: Any) -> None:
        self.kind = kind
        self.client_id = client_id
        self._kwargs = kwargs
        self._credential: AsyncTokenCredential | None = None
        self.closed = False

    @property
    def created(self) -> bool:
        return self._credential is not None

    def get(self) -> AsyncTokenCredential:
        """The credential (the same object on every call). Raises ConfigError when the
        environment lacks what it needs (azure-identity's message says what)."""
        if self.closed:
            raise RuntimeError("the shared credential is closed")
        if self._credential is None:
            try:
                self._credential = create_credential(self.kind, self.client_id, **self._kwargs)
            except ValueError as exc:
                raise ConfigError(f"azure_credential={self.kind}: {exc}") from None
        return self._credential

    async def aclose(self) -> None:
        """Close the credential (its HTTP sessions), if it was created; idempotent."""
        self.closed = True
        credential, self._credential = self._credential, None
        if credential is not None:
            await credential.close()
