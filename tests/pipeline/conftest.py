"""One SparkSession for the whole pipeline suite (local[2], UI off, loopback, UTC)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="the pipeline needs the 'spark' extra (pyspark)")

from pipeline.cli import JRE_HINT, java_available


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if not java_available():
        pytest.skip(JRE_HINT)
    from pipeline.session import build_local_session

    session = build_local_session(
        "local[2]",
        app_name="sbgate-pipeline-tests",
        driver_memory="1g",
        conf={"spark.sql.shuffle.partitions": "2"},
    )
    yield session
    session.stop()


def pytest_configure(config: pytest.Config) -> None:
    # pyspark 4.3 warns about pandas 3 at start-up; the pipeline does not use pandas.
    config.addinivalue_line(
        "filterwarnings", "ignore:PySpark does not yet fully support pandas:FutureWarning"
    )
