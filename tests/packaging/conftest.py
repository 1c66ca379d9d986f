"""The chart rendered with the sample values and with ci/production-values.yaml."""

from __future__ import annotations

from typing import Any

import pytest

from tests.packaging.chart import PRODUCTION, SAMPLE, render


@pytest.fixture(scope="session")
def production() -> dict[str, Any]:
    return render(PRODUCTION)


@pytest.fixture(scope="session")
def sample() -> dict[str, Any]:
    return render(SAMPLE)
