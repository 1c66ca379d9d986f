"""Render and lint the Helm chart with Helm's own Go library (helm-sdkpy), no cluster needed.

The chart's rules are tests (tests/packaging/chart.py calls this). It runs in .venv-tools,
where scripts/lint-packaging.sh installs helm-sdkpy (which declares Python >= 3.12),
kubernetes-validate and promql-parser apart from the project's .venv. Each command reads JSON
on stdin and writes JSON on stdout:

    render [--kube-version V]  values (null: the chart's) -> {"manifests", "notes"} or {"error"}
    lint                       values.yaml's replacement (null: as shipped) -> {"findings", "log"}
    validate --kube-version V  manifests -> {"errors", "skipped"} (Kubernetes V's own schemas)
    promql                     {name: PromQL} -> {name: metric names, or {"error": message}}
    template [--values FILE]   no stdin: the manifests as YAML on stdout, as `helm template`
                               would print them (`make chart-render VALUES=FILE`)

`render` is `helm install` against a throw-away Kubernetes API stub on 127.0.0.1 (helm-sdkpy has
no dry-run; HELM_DRIVER=memory keeps the release out of the stub): values.schema.json applies,
every template runs and the manifest comes back. `lint` is the library's lint action on a copy
of the chart whose values.yaml is replaced, since it takes no values file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent / "helm" / "sbgate"
RELEASE = "sbgate"
NAMESPACE = "messaging"
DEFAULT_KUBE_VERSION = "1.31.0"
# Lint severities (helm.sh/helm/v4/pkg/chart/v2/lint/support).
SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}

# (group, version, kind, plural, namespaced): what the chart may create, nothing else.
_RESOURCES = [
    ("", "v1", "ConfigMap", "configmaps", True),
    ("", "v1", "Secret", "secrets", True),
    ("", "v1", "Service", "services", True),
    ("", "v1", "ServiceAccount", "serviceaccounts", True),
    ("", "v1", "Namespace", "namespaces", False),
    ("apps", "v1", "Deployment", "deployments", True),
    ("autoscaling", "v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", True),
    ("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets", True),
    ("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies", True),
    ("batch", "v1", "CronJob", "cronjobs", True),
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors", True),
    ("monitoring.coreos.com", "v1", "PrometheusRule", "prometheusrules", True),
    ("networking.k8s.io", "v1", "Ingress", "ingresses", True),
]


def _discovery(kube_version: str) -> dict[str, Any]:
    major, minor, _patch = kube_version.split(".")
    by_gv: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for group, version, kind, plural, namespaced in _RESOURCES:
        by_gv.setdefault((group, version), []).append(
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            }
        )
    groups = [
        {
            "name": g,
            "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
            "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
        }
        for (g, v) in by_gv
        if g
    ]
    docs: dict[str, Any] = {
        "/version": {
            "major": major,
            "minor": minor,
            "gitVersion": f"v{kube_version}",
            "platform": "linux/amd64",
        },
        "/api": {"kind": "APIVersions", "versions": ["v1"]},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups},
    }
    for (g, v), resources in by_gv.items():
        docs[f"/apis/{g}/{v}" if g else "/api/v1"] = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{g}/{v}" if g else v,
            "resources": resources,
        }
    return docs


class _ApiStub(BaseHTTPRequestHandler):
    """Answers discovery, says every object is new, and accepts every create."""

    docs: dict[str, Any] = {}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in self.docs:
            self._reply(200, json.dumps(self.docs[path]).encode())
            return
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
        self._reply(404, json.dumps({**status, "reason": "NotFound", "code": 404}).encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._reply(201, body, self.headers.get("Content-Type") or "application/json")

    do_PUT = do_PATCH = do_POST


@contextlib.contextmanager
def api_stub(kube_version: str) -> Iterator[str]:
    """A loopback Kubernetes API stub reporting `kube_version`; yields a kubeconfig."""
    handler = type("_Stub", (_ApiStub,), {"docs": _discovery(kube_version)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        context = {"cluster": "stub", "user": "stub", "namespace": NAMESPACE}
        yield yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "stub", "user": {"token": "stub"}}],
                "contexts": [{"name": "stub", "context": context}],
                "current-context": "stub",
            }
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Capture file descriptor 2 (the Go library logs there) into a list of lines."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode("utf-8", "replace").splitlines())


def render(values: dict[str, Any] | None, kube_version: str) -> dict[str, Any]:
    """The chart as `helm install` renders it on a cluster of `kube_version`."""
    os.environ["HELM_DRIVER"] = "memory"
    import helm_sdkpy

    with api_stub(kube_version) as kubeconfig, captured_stderr():
        config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)
        try:
            release = asyncio.run(
                helm_sdkpy.Install(config).run(RELEASE, str(CHART), values=values, wait=False)
            )
        except helm_sdkpy.HelmError as exc:  # a schema violation, a template error or a `fail`
            return {"error": str(exc)}
    docs = [d for d in yaml.safe_load_all(release.get("manifest", "")) if d]
    return {"manifests": docs, "notes": release.get("info", {}).get("notes", "")}


def lint(values: dict[str, Any] | None) -> dict[str, list[str]]:
    """Helm lint of the chart with `values` as its values.yaml: findings and the library's log."""
    import helm_sdkpy

    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / CHART.name
        shutil.copytree(CHART, chart)
        if values is not None:
            (chart / "values.yaml").write_text(yaml.safe_dump(values), encoding="utf-8")
        with captured_stderr() as log:
            config = helm_sdkpy.Configuration(namespace=NAMESPACE)
            result = asyncio.run(helm_sdkpy.Lint(config).run(str(chart)))
    findings = []
    for m in result.get("Messages") or []:
        # The library serializes Go errors as {}: only the file and severity come through.
        err = m.get("Err") or ""
        sev = SEVERITY.get(m.get("Severity", 0), "UNKNOWN")
        findings.append(f"{sev} {m.get('Path')}" + (f": {err}" if err else ""))
    findings.extend(
        f"ERROR {e}" if e else "ERROR (message not exposed; render the values to see it)"
        for e in result.get("Errors") or []
    )
    return {"findings": findings, "log": log}


def validate(docs: list[dict[str, Any]], kube_version: str) -> dict[str, list[str]]:
    """Each manifest against Kubernetes `kube_version`'s schemas as kubernetes-validate bundles
    them (offline), strictly: an unknown field is an error. Custom resources have no bundled
    schema and are listed as skipped."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    errors: list[str] = []
    skipped: set[str] = set()
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except SchemaNotFoundError:
            skipped.add(doc["kind"])
        except ValidationError as exc:
            where = f"{doc['kind']} {doc['metadata']['name']}"
            errors.append(f"{where}: {'.'.join(str(p) for p in exc.path)}: {exc.message}")
    return {"errors": errors, "skipped": sorted(skipped)}


def metric_names(expr: str) -> list[str]:
    """The metric names a PromQL expression selects (Prometheus' grammar, in promql-parser)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            by_matcher = [m.value for m in node.matchers.matchers if m.name == "__name__"]
            names.update([node.name] if node.name else by_matcher)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return sorted(names)


def promql(queries: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, expr in queries.items():
        try:
            out[name] = metric_names(expr)
        except ValueError as exc:
            out[name] = {"error": str(exc)}
    return out


def template(values_file: str | None, kube_version: str) -> int:
    """Print the manifests `values_file` renders (YAML documents), for a person to read: the
    chart seen without a cluster. An error (the values schema, a template's `fail`) is one
    message on stderr and exit code 1."""
    values = None
    if values_file:
        try:
            with open(values_file, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            print(f"chart-render: cannot read {values_file}: {exc}", file=sys.stderr)
            return 1
    out = render(values, kube_version)
    if "error" in out:
        print(f"chart-render: {out['error']}", file=sys.stderr)
        return 1
    for doc in out["manifests"]:
        sys.stdout.write("---\n" + yaml.safe_dump(doc, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["render", "lint", "validate", "promql", "template"])
    parser.add_argument("--kube-version", default=DEFAULT_KUBE_VERSION)
    parser.add_argument("--values", help="template: a values file (default: the chart's)")
    args = parser.parse_args(argv)
    if args.command == "template":
        return template(args.values, args.kube_version)
    given = json.load(sys.stdin)
    if args.command == "render":
        out: Any = render(given, args.kube_version)
    elif args.command == "lint":
        out = lint(given)
    elif args.command == "validate":
        out = validate(given, args.kube_version)
    else:
        out = promql(given)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
