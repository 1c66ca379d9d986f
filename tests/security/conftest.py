"""Gateways served the way `gateway serve` serves them: the shared `gateway` fixture already
uses `HardenedAppRunner`; `hardened_gateway` names it for the slow-client tests."""

from __future__ import annotations

import pytest

from tests.conftest import GatewayFactory


@pytest.fixture
def hardened_gateway(gateway: GatewayFactory) -> GatewayFactory:
    return gateway
