"""schemathesis against a live `gateway serve` (a real process over the local broker).

Every operation of the served /openapi.json gets positive and negative generated cases
(>= 1,000 in all); each response must not be a 5xx and must conform to the document (status
code, content type, headers, body schema). The gateway runs with authorization on (one
Send+Manage token is sent with every case), failover on (so the admin levers work), and
room enough that one client at a time never saturates it: a 503 would be a finding too.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.auth import mint_token, resource_uri
from gateway.web.openapi import DOCUMENT
from sblocal.testing import BrokerProcess
from tests.support.processes import GatewayProcess, broker_env, free_port

# A `gateway serve` subprocess and hundreds of generated requests.
pytestmark = pytest.mark.slow

KEY = "c2NoZW1hdGhlc2lzLWtleS1mb3ItdGVzdHMtb25seS0wMDA="
RULES = {"rules": [{"name": "fuzz", "primary_key": KEY, "rights": ["Manage"], "entities": ["*"]}]}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Configured entities, their case variants, a queue named as a topic and vice versa, and
# unknown ones: the generated cases reach the parser and the broker, not only the 404.
ENTITY_NAMES = ["orders", "events", "ORDERS", "Events", "unknown-entity", "a.b-c_d"]
# Examples per operation and generation mode; the open GETs have nothing to vary.
EXAMPLES = {"messages": (180, 110), "admin": (40, 30), "open": (3, 0), "not served": (8, 4)}
MIN_CASES = 1000


@dataclass
class LiveGateway:
    base_url: str
    token: str
    log: Path


@pytest.fixture(scope="module")
def live_gateway(broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = broker_env(
        broker,
        SBGATE_ENABLE_FAILOVER="true",
        SBGATE_AUTH_RULES=orjson.dumps(RULES).decode(),
        SBGATE_LOG_LEVEL="WARNING",
        SBGATE_MAX_IN_FLIGHT="256",
        SBGATE_ADMISSION_TIMEOUT="10",
        SBGATE_DRAIN_DELAY="0",
        SBGATE_SHUTDOWN_TIMEOUT="2",
    )
    port = free_port()
    gw = GatewayProcess("gateway", env, port=port, log_dir=tmp_path_factory.mktemp("gateway"))
    asyncio.run(gw.start())  # a sync, module-wide fixture: schemathesis drives `requests`
    try:
        token = mint_token(
            resource_uri(f"127.0.0.1:{port}", None, scheme="http"), "fuzz", KEY, 3600
        )
        yield LiveGateway(gw.url, token, gw.log_path)
    finally:
        asyncio.run(gw.stop(20))


def fuzzable(document: dict[str, Any]) -> dict[str, Any]:
    """The served document, with entity path parameters drawn from `ENTITY_NAMES`.

    The document itself names no entity (it is open; entities stay hidden before
    authorization). Negative cases still send names outside this list."""
    doc = copy.deepcopy(document)
    for item in doc["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param.get("in") == "path":
                    param["schema"] = {"type": "string", "enum": ENTITY_NAMES}
    return doc


def group(path: str) -> str:
    if path.endswith("/messages"):
        return "messages"
    if path.startswith("/{entity}"):
        return "not served"
    return "admin" if path.startswith("/admin") else "open"


def test_the_served_document_is_the_module_document(live_gateway: LiveGateway):
    resp = requests.get(f"{live_gateway.base_url}/openapi.json", timeout=5)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/json")
    assert resp.json() == orjson.loads(orjson.dumps(DOCUMENT))


def test_schemathesis_finds_no_5xx_and_no_response_outside_the_schema(
    live_gateway: LiveGateway,
):
    served = requests.get(f"{live_gateway.base_url}/openapi.json", timeout=5).json()
    schema = schemathesis.openapi.from_dict(fuzzable(served))
    session = requests.Session()
    auth = {"Authorization": live_gateway.token}
    statuses: Counter[tuple[str, int]] = Counter()
    started = time.monotonic()

    for result in schema.get_all_operations():
        operation = result.ok()
        positive, negative = EXAMPLES[group(operation.path)]
        for mode, examples in (
            (GenerationMode.POSITIVE, positive),
            (GenerationMode.NEGATIVE, negative),
        ):
            if not examples:
                continue

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,  # the same cases on every run: a failure reproduces
                suppress_health_check=list(HealthCheck),
            )
            def run(case: schemathesis.Case) -> None:
                response = case.call(
                    base_url=live_gateway.base_url, session=session, headers=auth, timeout=15
                )
                statuses[(case.operation.label, response.status_code)] += 1
                case.validate_response(response, checks=CHECKS, headers=auth)

            try:
                run()
            except Exception:
                print(f"gateway log (tail):\n{live_gateway.log.read_text()[-3000:]}")
                raise

    total = sum(statuses.values())
    elapsed = time.monotonic() - started
    print(f"schemathesis: {total} cases in {elapsed:.1f} s")
    for (label, status), n in sorted(statuses.items()):
        print(f"  {label:45} {status}: {n}")
    assert total >= MIN_CASES, total
    # The cases reached past authorization and validation into the broker, both ways.
    assert any(s in (201, 202) for _, s in statuses), statuses
    assert any(s == 400 for _, s in statuses), statuses
