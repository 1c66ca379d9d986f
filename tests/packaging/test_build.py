"""The lock, the Dockerfile's targets and `gateway audit` where pyspark is missing.

The lock check and the Dockerfile check are the scripts `make test` runs
(scripts/lock.sh --check, scripts/dockerfile_check.py); here they are shown to fail on the
changes they exist to catch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / ".venv-tools" / "bin" / "uv"
sys.path.insert(0, str(ROOT / "scripts"))

import dockerfile_check  # noqa: E402
import pipeline_dist  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # builds and subprocesses


def lock_check(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(tree / "scripts" / "lock.sh"), "--check"],
        env={**os.environ, "UV": str(UV)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not UV.exists(), reason="no .venv-tools: run scripts/lint-packaging.sh first")
@pytest.mark.integration  # a subprocess
def test_lock_check_fails_when_pyproject_changes(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "requirements", tree / "requirements")
    shutil.copy(ROOT / "scripts" / "lock.sh", tree / "scripts" / "lock.sh")
    ok = lock_check(tree)
    assert ok.returncode == 0, ok.stderr

    pyproject = (tree / "pyproject.toml").read_text()
    (tree / "pyproject.toml").write_text(pyproject.replace('"orjson>=3.9"', '"orjson>=3.10"'))
    stale = lock_check(tree)
    assert stale.returncode == 1
    assert "uv.lock does not match pyproject.toml" in stale.stderr

    (tree / "pyproject.toml").write_text(pyproject)
    gateway_txt = tree / "requirements" / "gateway.txt"
    gateway_txt.write_text(gateway_txt.read_text().replace("redis==", "redis>="))
    edited = lock_check(tree)
    assert edited.returncode == 1
    assert "requirements/gateway.txt is not what uv.lock exports" in edited.stderr


def test_lock_pins_every_runtime_dependency_with_hashes() -> None:
    text = (ROOT / "requirements" / "gateway.txt").read_text()
    pins = {line.split("==")[0] for line in text.splitlines() if "==" in line}
    assert {"azure-servicebus", "azure-identity", "aiohttp", "redis", "uvloop"} <= pins
    # The image can trace (the otel extra); tracing stays off until OTEL_TRACES_EXPORTER says.
    assert {
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
    } <= pins
    assert "aiohttp==3.14." in text and "azure-servicebus==7.15.0" in text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "==" in line:  # every pin is followed by its hashes
            assert lines[i + 1].strip().startswith("--hash=sha256:"), line
    audit = (ROOT / "requirements" / "audit.txt").read_text()
    assert "pyspark==" in audit and "matplotlib==" in audit and "uvloop" not in audit


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_targets_pass_the_content_check() -> None:
    assert dockerfile_check.check_dockerfile(dockerfile()) == []
    ignore = (ROOT / ".dockerignore").read_text()
    assert dockerfile_check.check_dockerignore(ignore) == []
    stages = dockerfile_check.parse(dockerfile())
    assert [s.name for s in dockerfile_check.closure(stages, "gateway")][:2] == [
        "gateway",
        "build-gateway",
    ]


def test_dockerfile_check_catches_what_it_is_for() -> None:
    text = dockerfile()
    pipeline_in_gateway = text.replace(
        "COPY gateway/ ./gateway/\nRUN pip install --no-deps --no-build-isolation . \\\n"
        "    && pip uninstall --yes setuptools \\\n    && pip check \\\n"
        "    && rm -f /opt/venv/bin/sblocal\n\n\n# The audit's venv",
        "COPY gateway/ ./gateway/\nCOPY pipeline/ ./pipeline/\n"
        "RUN pip install --no-deps --no-build-isolation .\n\n\n# The audit's venv",
        1,
    )
    assert pipeline_in_gateway != text
    assert any(
        "target gateway" in e and "pipeline/" in e
        for e in dockerfile_check.check_dockerfile(pipeline_in_gateway)
    )
    locked = "--require-hashes --no-deps --requirement requirements/gateway.txt"
    unlocked = text.replace(locked, "--requirement requirements/gateway.txt")
    assert any("outside the lock" in e for e in dockerfile_check.check_dockerfile(unlocked))
    root = text.replace("USER 10001:10001\nEXPOSE 8080", "USER root\nEXPOSE 8080")
    assert any("non-root" in e for e in dockerfile_check.check_dockerfile(root))
    shell_form = text.replace('CMD ["gateway", "serve"]', "CMD gateway serve")
    assert any("exec (JSON) form" in e for e in dockerfile_check.check_dockerfile(shell_form))
    assert dockerfile_check.check_dockerignore("*\n!gateway/\n!tests/\n")


@pytest.mark.integration  # a subprocess
def test_gateway_audit_without_pyspark_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # pyspark made unimportable for this interpreter only, as in the gateway image (which has
    # neither pyspark nor the pipeline: scripts/build-check.sh runs that case in a real venv).
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['pyspark'] = None\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "audit",
            "--ledger",
            "l",
            "--delivered",
            "d",
            "--out",
            "o",
        ],
        env={**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "needs pyspark" in proc.stderr and "docker build --target audit" in proc.stderr


@pytest.mark.integration  # a subprocess
def test_pipeline_dist_is_importable_and_reproducible(tmp_path: Path) -> None:
    first = pipeline_dist.build(tmp_path / "a.zip")
    second = pipeline_dist.build(tmp_path / "b.zip")
    assert first.read_bytes() == second.read_bytes()
    names = zipfile.ZipFile(first).namelist()
    assert "pipeline/job.py" in names and "pipeline/__init__.py" in names
    assert all(n.startswith("pipeline/") and n.endswith(".py") for n in names)
    # Imported from the archive alone (as --py-files makes the cluster's Python do).
    probe = "import pipeline.job, pipeline.report; print(pipeline.job.__file__)"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {[str(first)]!r}; {probe}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    # -S leaves out site-packages (and pyspark): the import fails on pyspark, not on pipeline.
    assert "No module named 'pyspark'" in proc.stderr, proc.stderr
    assert "No module named 'pipeline" not in proc.stderr
