"""The chart tests' one kit: the sample values, Helm's merge of values, and the chart rendered,
linted and its manifests validated through scripts/helm_render.py.

That script runs in .venv-tools (helm-sdkpy, kubernetes-validate and promql-parser live there;
`scripts/lint-packaging.sh --install-only` creates it), one subprocess per call. The rendered
environment of each container is handed to `gateway.config.load_settings`, so a chart value
the gateway would refuse at start-up fails here instead of in a cluster.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sbgate"
TOOLS_PYTHON = ROOT / ".venv-tools" / "bin" / "python"
PRODUCTION_FILE = CHART / "ci" / "production-values.yaml"
DASHBOARD = CHART / "dashboards" / "sbgate.json"

# Marks for a module that renders the chart (each render is a subprocess of about a second).
RENDERS = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not TOOLS_PYTHON.exists(), reason="no .venv-tools: run scripts/lint-packaging.sh first"
    ),
]

PRIMARY_CS = (
    "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=cA=="
)
SECONDARY_CS = (
    "Endpoint=sb://contoso-dr.servicebus.windows.net/;SharedAccessKeyName=manage;"
    "SharedAccessKey=cw=="
)
# The least that makes the default values installable (see values.yaml's header).
SAMPLE: dict[str, Any] = {
    "config": {"entities": ["queue:orders", "topic:events"]},
    "serviceBus": {
        "primary": {"connectionString": PRIMARY_CS},
        "secondary": {"connectionString": SECONDARY_CS},
    },
    "auth": {"rules": "[[rules]]\n"},
}
# The optional alerts, dashboard and Ingress turned on with their default settings.
OBSERVABILITY: dict[str, Any] = {
    "config": {"publicHosts": ["sbgate.contoso.com"]},
    "ingress": {"enabled": True},
    "metrics": {"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def coalesce(base: Any, override: Any) -> Any:
    """Helm's merge of user values over chart values: maps merge, null deletes, else replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = coalesce(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    return copy.deepcopy(override)


def with_sample(*overrides: dict[str, Any]) -> dict[str, Any]:
    """The sample values with `overrides` merged over them, in order."""
    values: dict[str, Any] = SAMPLE
    for o in overrides:
        values = coalesce(values, o)
    return values


CHART_VALUES: dict[str, Any] = load_yaml(CHART / "values.yaml")
PRODUCTION: dict[str, Any] = load_yaml(PRODUCTION_FILE)
# The value sets every chart rule holds for: given values, rendered once per test module.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "sample": SAMPLE,
    "separate syphon": with_sample({"syphon": {"enabled": True}}),
    "alerts, dashboard, ingress": with_sample(OBSERVABILITY),
    "production": PRODUCTION,
}


def tool(command: str, payload: Any, *args: str) -> Any:
    """scripts/helm_render.py `command` in the tools' Python, JSON in and out. Each answer is
    computed once per session (the same values render the same), and each caller gets a copy."""
    return copy.deepcopy(_tool(command, json.dumps(payload, sort_keys=True), *args))


@functools.cache
def _tool(command: str, payload: str, *args: str) -> Any:
    proc = subprocess.run(
        [str(TOOLS_PYTHON), str(ROOT / "scripts" / "helm_render.py"), command, *args],
        input=payload,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise AssertionError(f"helm_render.py {command} failed to run: exit {proc.returncode}")
    return json.loads(proc.stdout)


def render(values: dict[str, Any] | None = None, kube_version: str | None = None) -> dict[str, Any]:
    """{"manifests": [...], "notes": str} or {"error": str}, as `helm install` would render
    `values` (None: the chart's defaults alone)."""
    args = ("--kube-version", kube_version) if kube_version else ()
    result: dict[str, Any] = tool("render", values, *args)
    return result


def lint(values: dict[str, Any] | None) -> dict[str, list[str]]:
    """Helm lint with `values` coalesced over the chart's (None: the chart as shipped)."""
    replaced = None if values is None else coalesce(CHART_VALUES, values)
    result: dict[str, list[str]] = tool("lint", replaced)
    return result


def validate(manifests: list[dict[str, Any]], kube_version: str) -> dict[str, list[str]]:
    """Kubernetes `kube_version`'s schema errors, and the kinds it has no schema for."""
    result: dict[str, list[str]] = tool("validate", manifests, "--kube-version", kube_version)
    return result


def metric_names(queries: dict[str, str]) -> dict[str, Any]:
    """The metric names each PromQL query selects, or {"error": ...} where it does not parse."""
    result: dict[str, Any] = tool("promql", queries)
    return result


def manifests(result: dict[str, Any]) -> list[dict[str, Any]]:
    assert "error" not in result, result.get("error")
    docs: list[dict[str, Any]] = result["manifests"]
    return docs


def objects(result: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests(result) if d["kind"] == kind}


def pod_spec(result: dict[str, Any], deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = objects(result, "Deployment")[deployment]["spec"]["template"]["spec"]
    return spec


def container(result: dict[str, Any], deployment: str) -> dict[str, Any]:
    c: dict[str, Any] = pod_spec(result, deployment)["containers"][0]
    return c


def environment(result: dict[str, Any], deployment: str) -> dict[str, str]:
    """The container's environment as the kubelet would build it (ConfigMap envFrom, then env),
    secrets and the pod name filled with samples."""
    c = container(result, deployment)
    cms = objects(result, "ConfigMap")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]]["data"])
    samples = {
        "SBGATE_PRIMARY_CONNECTION_STRING": PRIMARY_CS,
        "SBGATE_SECONDARY_CONNECTION_STRING": SECONDARY_CS,
        "SBGATE_REDIS_URL": "rediss://:secret@redis.example:6380/0",
        "SBGATE_REPLICA_ID": f"{deployment}-7d9f8-abcde",
    }
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else samples[e["name"]]
    return env


def settings_of(result: dict[str, Any], deployment: str) -> Any:
    env = environment(result, deployment)
    # The mounted files do not exist here; the loader only records these paths.
    env.pop("SBGATE_CONFIG", None)
    return load_settings(env)
