"""Open mode's ``Host`` check, run by the edge middleware (`gateway.web.handlers`).

In open mode (no authorization rules, listening on loopback), `host_check` answers 421 to a
request whose ``Host`` is neither a loopback name nor one of ``public_hosts``: a web page the
operator opens could otherwise reach the gateway (its admin API included) through a name its
own DNS points at 127.0.0.1 (DNS rebinding). `is_loopback` is the one rule for "a loopback
name", also used by ``gateway serve`` to refuse listening open elsewhere.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from aiohttp import web

from gateway.auth import AuthConfigError
from gateway.auth.sas import parse_host_entry
from gateway.errors import RequestError


class MisdirectedRequest(RequestError):
    """Open mode: the request's ``Host`` is neither a loopback name nor a public host (421)."""

    status = 421
    code = "misdirected_request"


def is_loopback(host: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761), or a loopback IP literal."""
    host = host.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_HOST_VERDICTS = 256  # Host values whose verdict the open mode's check remembers


def host_check(public_hosts: Iterable[str]) -> Callable[[web.Request], None]:
    """The open mode's ``Host`` check (see the module docstring), run by the edge middleware
    (gateway.web.handlers), which turns its 421 into the JSON answer: one middleware fewer
    a request. A request without ``Host`` (HTTP/1.0; no browser sends one) passes. Raises
    `AuthConfigError` for a bad *public_hosts* entry."""
    hosts = frozenset(parse_host_entry(entry) for entry in public_hosts)
    # The verdict per Host value: a client sends the same one on every request, and parsing
    # it (an IP literal through `ipaddress`) cost more than the rest of the check. Bounded:
    # the header is the client's, so the cache starts over when full.
    verdicts: dict[str, bool] = {}

    def allowed(header: str) -> bool:
        try:
            host, port = parse_host_entry(header)
        except AuthConfigError:
            host, port = "", None
        ok = is_loopback(host) or (host, None) in hosts or (host, port) in hosts
        if len(verdicts) >= _HOST_VERDICTS:
            verdicts.clear()
        verdicts[header] = ok
        return ok

    def check(request: web.Request) -> None:
        header = request.headers.get("Host")
        if header is not None:
            ok = verdicts.get(header)
            if not (ok if ok is not None else allowed(header)):
                raise MisdirectedRequest(
                    "without authorization rules the gateway answers only requests for "
                    "a loopback name or one of public_hosts (the Host header)"
                )

    return check
