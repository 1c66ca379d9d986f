"""`make chart-render VALUES=...`: the chart seen without a cluster (README, Deploy), through the
chart tests' own renderer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.packaging.chart import RENDERS, ROOT, SAMPLE

pytestmark = RENDERS


def chart_render(values: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "chart-render", f"VALUES={values}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # the first run installs the tools
        check=False,
    )


def test_a_values_file_renders_to_manifests(tmp_path: Path) -> None:
    values = tmp_path / "my-values.yaml"
    values.write_text(yaml.safe_dump(SAMPLE))
    done = chart_render(values)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}


def test_values_the_chart_refuses_are_one_message(tmp_path: Path) -> None:
    values = tmp_path / "bad.yaml"
    values.write_text("replicaCount: many\n")
    done = chart_render(values)
    assert done.returncode != 0 and done.stdout == ""
    assert "chart-render:" in done.stderr and "replicaCount" in done.stderr
