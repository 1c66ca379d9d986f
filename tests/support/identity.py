"""A local stand-in for Microsoft Entra ID's token endpoints, for azure-identity's real classes.

    async with TokenEndpoint(tmp_path) as idp:
        env = idp.managed_identity_env()     # IDENTITY_ENDPOINT/IDENTITY_HEADER (App Service)
        env = idp.workload_identity_env(token_file, tenant="t", client_id="c")

* Managed identity, App Service protocol (what `ManagedIdentityCredential` speaks when
  ``IDENTITY_ENDPOINT`` and ``IDENTITY_HEADER`` are set): ``GET /msi/token?api-version=
  2019-08-01&resource=...[&client_id=...]`` with header ``X-IDENTITY-HEADER``, over plain HTTP.
* Entra ID's token endpoint for a client assertion (what `WorkloadIdentityCredential` posts
  with the federated token file's content): ``POST /<tenant>/oauth2/v2.0/token``, over HTTPS
  with the local broker's development certificate (azure-identity refuses a plain-HTTP
  authority): pass ``connection_verify=idp.ca_cert`` to the credential.

Both listen on 127.0.0.1 only and record every request in `requests`.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from sblocal.certs import ensure_dev_cert, server_ssl_context


@dataclass
class TokenRequest:
    kind: str  # "managed" or "workload"
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    form: dict[str, str] = field(default_factory=dict)


class TokenEndpoint:
    def __init__(
        self,
        cert_dir: Path,
        *,
        lifetime: int = 3600,
        oid: str | None = None,
        on_issue: Callable[[str], None] | None = None,
    ) -> None:
        self._cert_dir = cert_dir
        self.lifetime = lifetime
        # With `oid`: tokens shaped like Entra ID's JWTs (unsigned), carrying that object id,
        # as Redis reads them. `on_issue` sees each token before the client does.
        self.oid = oid
        self.on_issue = on_issue
        self.header_secret = secrets.token_hex(8)
        self.requests: list[TokenRequest] = []
        self.issued: list[str] = []
        self._runners: list[web.AppRunner] = []
        self.http_url = ""
        self.https_url = ""
        self.ca_cert = ""

    def _token(self) -> str:
        token = f"local-token-{len(self.issued)}-{secrets.token_hex(4)}"
        if self.oid is not None:
            claims = {"oid": self.oid, "exp": int(time.time()) + self.lifetime, "jti": token}
            token = (
                ".".join(
                    base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
                    for part in ({"alg": "none", "typ": "JWT"}, claims)
                )
                + ".local"
            )
        if self.on_issue is not None:
            self.on_issue(token)
        self.issued.append(token)
        return token

    async def _managed(self, request: web.Request) -> web.Response:
        self.requests.append(
            TokenRequest("managed", request.path, dict(request.query), dict(request.headers))
        )
        if request.headers.get("X-IDENTITY-HEADER") != self.header_secret:
            return web.json_response({"error": "bad identity header"}, status=401)
        return web.json_response(
            {
                "access_token": self._token(),
                "expires_on": str(int(time.time()) + self.lifetime),
                "resource": request.query.get("resource", ""),
                "token_type": "Bearer",
            }
        )

    async def _workload(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.requests.append(
            TokenRequest("workload", request.path, dict(request.query), dict(request.headers), form)
        )
        return web.json_response(
            {"access_token": self._token(), "expires_in": self.lifetime, "token_type": "Bearer"}
        )

    async def _site(self, app: web.Application, ssl: Any = None) -> int:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl)
        await site.start()
        self._runners.append(runner)
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def __aenter__(self) -> TokenEndpoint:
        mi = web.Application()
        mi.router.add_get("/msi/token", self._managed)
        self.http_url = f"http://127.0.0.1:{await self._site(mi)}"
        aad = web.Application()
        aad.router.add_post("/{tenant}/oauth2/v2.0/token", self._workload)
        cert, key = ensure_dev_cert(self._cert_dir)
        self.ca_cert = str(cert)
        self.https_url = f"https://127.0.0.1:{await self._site(aad, server_ssl_context(cert, key))}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()

    def managed_identity_env(self) -> dict[str, str]:
        return {
            "IDENTITY_ENDPOINT": f"{self.http_url}/msi/token",
            "IDENTITY_HEADER": self.header_secret,
        }

    def workload_identity_env(
        self, token_file: Path, *, tenant: str, client_id: str
    ) -> dict[str, str]:
        return {
            "AZURE_AUTHORITY_HOST": self.https_url,
            "AZURE_TENANT_ID": tenant,
            "AZURE_CLIENT_ID": client_id,
            "AZURE_FEDERATED_TOKEN_FILE": str(token_file),
        }


# Variables through which azure-identity could pick up a real identity (or reach a real
# endpoint): cleared in every identity test.
AZURE_ENV = (
    "AZURE_AUTHORITY_HOST",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "AZURE_TENANT_ID",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_USERNAME",
    "AZURE_PASSWORD",
    "AZURE_POD_IDENTITY_AUTHORITY_HOST",
    "IDENTITY_ENDPOINT",
    "IDENTITY_HEADER",
    "IDENTITY_SERVER_THUMBPRINT",
    "IMDS_ENDPOINT",
    "MSI_ENDPOINT",
    "MSI_SECRET",
)
