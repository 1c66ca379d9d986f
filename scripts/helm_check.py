"""Lint and render the Helm chart with Helm's own Go library (helm-sdkpy), no cluster needed.

Run by scripts/lint-packaging.sh inside .venv-tools (helm-sdkpy, PyYAML, jsonschema,
kubernetes-validate, promql-parser):

    python scripts/helm_check.py check            # every check below; exit 1 on any finding
    python scripts/helm_check.py render -f F.yaml  # rendered manifests as JSON (for tests)
    python scripts/helm_check.py readme            # regenerate helm/sbgate/README.md's tables
    python scripts/helm_check.py queries -f F.yaml # metric names each alert and dashboard reads

What `check` does, for the default values, for ci/production-values.yaml, and for the defaults
with the alerts, the dashboard and the Ingress turned on:
- Helm lint (the library's lint action) on the chart with those values; any warning or error
  fails. helm-sdkpy's lint takes no values file, so the chart is copied and its values.yaml
  replaced by the coalesced values.
- Render with Helm's install action against a throw-away Kubernetes API stub on 127.0.0.1
  (helm-sdkpy has no dry-run; HELM_DRIVER=memory keeps the release out of the stub). This
  applies values.schema.json, runs every template, and returns the manifest, which is parsed
  with PyYAML and checked: security settings, probes, grace-period arithmetic, flags.
- values.yaml: every value documented by a `## @param` line, every @param naming a value,
  every value and every template `.Values.x.y` reference present in values.schema.json and
  values.yaml (Helm's non-strict rendering would print a missing key as empty).
- Kubernetes versions: the chart's `kubeVersion` must admit the oldest and newest versions in
  KUBE_VERSIONS and refuse the ones just outside; every manifest rendered (for both value sets)
  must validate, strictly (no unknown fields), against those versions' own schemas as bundled
  by kubernetes-validate (offline). Custom resources (ServiceMonitor, PrometheusRule) have no
  bundled schema and are reported as skipped there.
- The alerts, the dashboard and the Ingress, rendered a third time on top of the defaults: the
  PrometheusRule's spec against the CRD's schema (PROMETHEUS_RULE_SPEC), every alert with a
  severity, summary, description and runbook, every expression parsed by promql-parser; the
  dashboard ConfigMap equal to dashboards/sbgate.json, its data source variable used by every
  panel, every query parsed; every Ingress path to a port of the gateway Service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "sbgate"
PRODUCTION = CHART / "ci" / "production-values.yaml"
RELEASE = "sbgate"
NAMESPACE = "messaging"

# The least that makes the default values installable (see values.yaml's header).
MINIMAL: dict[str, Any] = {
    "config": {"entities": ["queue:orders"]},
    "serviceBus": {
        "primary": {
            "connectionString": "Endpoint=sb://contoso.servicebus.windows.net/;"
            "SharedAccessKeyName=send;SharedAccessKey=cHJpbWFyeQ=="
        },
        "secondary": {
            "connectionString": "Endpoint=sb://contoso-dr.servicebus.windows.net/;"
            "SharedAccessKeyName=manage;SharedAccessKey=c2Vjb25kYXJ5"
        },
    },
    "auth": {"rules": "# SAS rules (test)\n"},
}

# The optional alerts, dashboard and Ingress turned on with their default settings.
OBSERVABILITY: dict[str, Any] = {
    "config": {"publicHosts": ["sbgate.contoso.com"]},
    "ingress": {"enabled": True},
    "metrics": {"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
}

# Lint severities (helm.sh/helm/v4/pkg/chart/v2/lint/support).
SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


# --- Helm values semantics ---------------------------------------------------------------------


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


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# --- a Kubernetes API stub for helm install ------------------------------------------------------

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
# The supported range (Chart.yaml's kubeVersion): the oldest and newest Kubernetes versions whose
# schemas the rendered manifests are validated against (kubernetes-validate bundles them).
KUBE_VERSIONS = ("1.25.0", "1.37.0")
# Just outside the range: the chart must refuse to install there.
KUBE_VERSIONS_REFUSED = ("1.24.0", "1.38.0")
_KUBE_VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"}


def _version_doc(version: str) -> dict[str, str]:
    major, minor, _patch = version.split(".")
    return {"major": major, "minor": minor, "gitVersion": f"v{version}", "platform": "linux/amd64"}


def _discovery() -> dict[str, Any]:
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
    docs: dict[str, Any] = {
        "/version": _KUBE_VERSION,
        "/api": {"kind": "APIVersions", "versions": ["v1"]},
        "/apis": {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                    "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                }
                for (g, v) in by_gv
                if g
            ],
        },
    }
    for (g, v), resources in by_gv.items():
        path = f"/apis/{g}/{v}" if g else "/api/v1"
        docs[path] = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{g}/{v}" if g else v,
            "resources": resources,
        }
    return docs


class _ApiStub(BaseHTTPRequestHandler):
    """Answers discovery, says every object is new, and accepts every create."""

    docs = _discovery()

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
def api_stub(kube_version: str | None = None) -> Iterator[str]:
    """A loopback Kubernetes API stub (reporting `kube_version`); yields a kubeconfig."""
    handler: type[_ApiStub] = _ApiStub
    if kube_version is not None:
        docs = {**_ApiStub.docs, "/version": _version_doc(kube_version)}
        handler = type("_VersionedApiStub", (_ApiStub,), {"docs": docs})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stub", "cluster": {"server": f"http://{host}:{port}"}}],
                "users": [{"name": "stub", "user": {"token": "stub"}}],
                "contexts": [
                    {
                        "name": "stub",
                        "context": {"cluster": "stub", "user": "stub", "namespace": NAMESPACE},
                    }
                ],
                "current-context": "stub",
            }
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# --- Helm through helm-sdkpy -------------------------------------------------------------------


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


class RenderError(Exception):
    """Helm refused to render (schema violation, template error or a `fail`)."""


def render(
    values: dict[str, Any] | None, chart: Path = CHART, kube_version: str | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Render the chart like `helm install` would (on a cluster of `kube_version`); return
    (manifests, notes)."""
    os.environ["HELM_DRIVER"] = "memory"
    import helm_sdkpy

    with api_stub(kube_version) as kubeconfig, captured_stderr():
        config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)
        try:
            release = asyncio.run(
                helm_sdkpy.Install(config).run(RELEASE, str(chart), values=values, wait=False)
            )
        except helm_sdkpy.HelmError as exc:
            raise RenderError(str(exc)) from None
    docs = [d for d in yaml.safe_load_all(release.get("manifest", "")) if d]
    return docs, release.get("info", {}).get("notes", "")


def lint(values: dict[str, Any] | None, chart: Path = CHART) -> tuple[list[str], list[str]]:
    """Helm lint with `values` coalesced over the chart's; return (findings, log lines)."""
    import helm_sdkpy

    with tempfile.TemporaryDirectory() as tmp:
        copy_dir = Path(tmp) / chart.name
        shutil.copytree(chart, copy_dir)
        if values:
            merged = coalesce(load_yaml(chart / "values.yaml"), values)
            (copy_dir / "values.yaml").write_text(yaml.safe_dump(merged), encoding="utf-8")
        with captured_stderr() as log:
            config = helm_sdkpy.Configuration(namespace=NAMESPACE)
            result = asyncio.run(helm_sdkpy.Lint(config).run(str(copy_dir)))
    findings = []
    for m in result.get("Messages") or []:
        sev = SEVERITY.get(m.get("Severity", 0), "UNKNOWN")
        # The library serializes Go errors as {}: only the file and severity come through.
        err = m.get("Err") or ""
        findings.append(f"{sev} {m.get('Path')}" + (f": {err}" if err else ""))
    # Go errors reach Python as {}: say so, the render step shows Helm's own message.
    findings.extend(
        f"ERROR {e}" if e else "ERROR (message not exposed; see the render step)"
        for e in result.get("Errors") or []
    )
    return findings, log


# --- checks on rendered manifests --------------------------------------------------------------


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def env_of(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The container's environment: ConfigMap envFrom, then env (later wins, as in Kubernetes)."""
    cms = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, Any] = {}
    for src in container.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def check_manifests(docs: list[dict[str, Any]], values: dict[str, Any]) -> list[str]:
    """Findings about what the chart promises: security, probes, shutdown arithmetic, flags."""
    errors: list[str] = []
    kinds = by_kind(docs)

    def expect(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    for d in docs:
        expect(bool(d.get("apiVersion") and d.get("metadata", {}).get("name")), f"incomplete: {d}")
    deployments = {
        d["spec"]["template"]["spec"]["containers"][0]["name"]: d
        for d in kinds.get("Deployment", [])
    }
    expect("gateway" in deployments, "no gateway Deployment")
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        where = f"Deployment {dep['metadata']['name']}"
        psc = pod.get("securityContext", {})
        expect(psc.get("runAsNonRoot") is True, f"{where}: pod runAsNonRoot")
        expect(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp")
        expect(pod.get("enableServiceLinks") is False, f"{where}: enableServiceLinks must be false")
        expect(pod.get("automountServiceAccountToken") is False, f"{where}: token automount")
        (c,) = pod["containers"]
        sc = c.get("securityContext", {})
        expect(sc.get("runAsNonRoot") is True, f"{where}: container runAsNonRoot")
        expect(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem")
        expect(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation")
        expect("ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: drop ALL")
        expect(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        expect("emptyDir" in vols.get(mounts.get(TMP_MOUNT, ""), {}), f"{where}: /tmp emptyDir")
        expect(c["ports"][0]["containerPort"] == 8080, f"{where}: port 8080")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            got = c.get(probe, {}).get("httpGet", {}).get("path")
            expect(got == path, f"{where}: {probe} must ask {path}, asks {got}")
        env = env_of(c, docs)
        known = known_env()
        unknown = [k for k in env if k.startswith("SBGATE_") and k not in known]
        expect(not unknown, f"{where}: unknown SBGATE_ variables {unknown}")
        expect(env.get("SBGATE_LISTEN_HOST") == "0.0.0.0", f"{where}: listen on 0.0.0.0")  # noqa: S104
        expect(
            env.get("SBGATE_REPLICA_ID") == {"fieldRef": {"fieldPath": "metadata.name"}},
            f"{where}: replica id from the pod name",
        )
        for k, v in env.items():
            if isinstance(v, str) and re.fullmatch(r"-?\d+(\.\d+)?e[+-]\d+", v):
                errors.append(f"{where}: {k}={v} is in exponent notation")
        if name == "gateway":
            argv = c["command"] + c["args"]
            expect(argv == ["gateway", "serve"], f"{where}: runs {argv}, not gateway serve")
            pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            expect(len(pre) == 2 and pre[0] == "sleep", f"{where}: preStop sleep")
            pre_s = float(pre[1]) if len(pre) == 2 else 0.0
            drain = float(env["SBGATE_DRAIN_DELAY"])
            shutdown = float(env["SBGATE_SHUTDOWN_TIMEOUT"])
            grace = pod["terminationGracePeriodSeconds"]
            expect(
                shutdown < grace - drain - pre_s,
                f"{where}: shutdown_timeout {shutdown} must be < grace {grace} - drain {drain}"
                f" - preStop {pre_s}",
            )
            separate = bool(values.get("syphon", {}).get("enabled"))
            expect(
                env["SBGATE_ENABLE_SYPHON"] == ("false" if separate else "true"),
                f"{where}: SBGATE_ENABLE_SYPHON with syphon.enabled={separate}",
            )
            anti = pod.get("affinity", {}).get("podAntiAffinity", {})
            expect(bool(anti), f"{where}: pod anti-affinity preset")
        else:
            argv = c["command"] + c["args"]
            expect(argv == ["gateway", "syphon"], f"{where}: runs {argv}, not gateway syphon")
            expect(env["SBGATE_ENABLE_SYPHON"] == "true", f"{where}: syphon enabled")
        wi = bool(values.get("workloadIdentity", {}).get("enabled"))
        credential = values.get("serviceBus", {}).get("credential") or ("workload" if wi else None)
        expect(
            env.get("SBGATE_AZURE_CREDENTIAL") == credential,
            f"{where}: SBGATE_AZURE_CREDENTIAL={env.get('SBGATE_AZURE_CREDENTIAL')!r} with "
            f"workloadIdentity.enabled={wi}, expected {credential!r}",
        )
    for job in kinds.get("CronJob", []):
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        where = f"CronJob {job['metadata']['name']}"
        expect(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{where}: nonroot")
        expect(pod.get("restartPolicy") == "Never", f"{where}: restartPolicy Never")
        (c,) = pod["containers"]
        sc = c.get("securityContext", {})
        expect(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem")
        expect(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation")
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        expect({TMP_MOUNT, "/audit"} <= mounts, f"{where}: /tmp and /audit must be writable")
        expect(bool(c.get("args")), f"{where}: no arguments for gateway audit")
        expect("command" not in c, f"{where}: the image's entry point (gateway audit) is kept")
    errors += check_observability(docs)
    return errors


TMP_MOUNT = "/tmp"  # noqa: S108 - a mount path inside the pod, not a file we create


def known_env() -> set[str]:
    """Every SBGATE_* name the gateway accepts (gateway/config.py derives them from its
    declarations; it imports only the standard library, so this venv can load it)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from gateway.config import env_names

    return env_names()


def validate_manifests(docs: list[dict[str, Any]], version: str) -> tuple[list[str], list[str]]:
    """Validate each manifest against Kubernetes `version`'s schemas, strictly (unknown fields
    are errors), offline. Returns (errors, kinds without a bundled schema)."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    errors: list[str] = []
    skipped: list[str] = []
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError:
            skipped.append(doc["kind"])
        except ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{where}: {path}: {exc.message}")
    return errors, sorted(set(skipped))


def expect_kinds(docs: list[dict[str, Any]], expected: dict[str, int]) -> list[str]:
    got = {k: len(v) for k, v in by_kind(docs).items()}
    return [] if got == expected else [f"objects: expected {expected}, got {got}"]


# --- the alerts, the dashboard and the Ingress -------------------------------------------------

DASHBOARD = CHART / "dashboards" / "sbgate.json"
_DURATION = (
    "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
# The PrometheusRule's spec as the Prometheus Operator's CRD (monitoring.coreos.com/v1) defines
# it, strictly: kubernetes-validate bundles no schema for custom resources.
PROMETHEUS_RULE_SPEC: dict[str, Any] = {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": _DURATION},
                    "query_offset": {"type": "string", "pattern": _DURATION},
                    "limit": {"type": "integer"},
                    "labels": _STRINGS,
                    "partial_response_strategy": {"type": "string"},
                    "rules": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["expr"],
                            "additionalProperties": False,
                            "properties": {
                                "alert": {"type": "string"},
                                "record": {"type": "string"},
                                "expr": {"type": ["string", "integer"]},
                                "for": {"type": "string", "pattern": _DURATION},
                                "keep_firing_for": {"type": "string", "pattern": _DURATION},
                                "labels": _STRINGS,
                                "annotations": _STRINGS,
                            },
                        },
                    },
                },
            },
        }
    },
}
# What every alert says, for whoever it wakes up.
ALERT_ANNOTATIONS = ("summary", "description", "runbook")


def grafana_to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by values PromQL parses."""
    expr = re.sub(r"\$\{?(__rate_interval|__interval|__range)\}?", "5m", expr)
    return re.sub(r"\$\{?[A-Za-z_]\w*(:\w+)?\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects; ValueError if it does not parse."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            by_matcher = [m.value for m in node.matchers.matchers if m.name == "__name__"]
            names.update([node.name] if node.name else by_matcher)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def rule_queries(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Every PrometheusRule expression, by `<rule object>/<alert or record>`."""
    return {
        f"{d['metadata']['name']}/{r.get('alert') or r.get('record')}": str(r["expr"])
        for d in by_kind(docs).get("PrometheusRule", [])
        for g in d["spec"]["groups"]
        for r in g["rules"]
    }


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every PromQL query of a Grafana dashboard (panels, rows' panels, query variables), with
    Grafana's variables replaced, by `panel <title> <refId>` or `variable <name>`."""
    out: dict[str, str] = {}
    panels = list(dashboard.get("panels", []))
    for p in panels:
        panels.extend(p.get("panels", []))  # a collapsed row holds its panels
        for t in p.get("targets", []):
            out[f"panel {p.get('title')!r} {t.get('refId')}"] = grafana_to_promql(t["expr"])
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        query = v["query"] if isinstance(v["query"], str) else v["query"]["query"]
        m = re.fullmatch(r"\s*(?:label_values\((.+),\s*\w+\)|query_result\((.+)\))\s*", query)
        if m:
            out[f"variable {v['name']}"] = grafana_to_promql(m.group(1) or m.group(2))
    return out


def check_dashboard(dashboard: dict[str, Any], where: str) -> list[str]:
    """A dashboard anyone can import: a Prometheus data source variable that every panel and
    query uses, unique panel ids, queries that parse."""
    errors: list[str] = []
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append(f"{where}: no Prometheus data source variable `datasource`")
    panels = list(dashboard.get("panels", []))
    for p in panels:
        panels.extend(p.get("panels", []))
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        errors.append(f"{where}: panel ids repeat: {ids}")
    for p in panels:
        if p.get("type") == "row":
            continue
        for node in (p, *p.get("targets", [])):
            if node.get("datasource", {}).get("uid") != "${datasource}":
                errors.append(f"{where}: panel {p.get('title')!r} does not use ${{datasource}}")
        if not p.get("targets"):
            errors.append(f"{where}: panel {p.get('title')!r} has no query")
    for name, expr in dashboard_queries(dashboard).items():
        try:
            metric_names(expr)
        except ValueError as exc:
            errors.append(f"{where}: {name}: {exc}: {expr}")
    return errors


def check_observability(docs: list[dict[str, Any]]) -> list[str]:
    """The PrometheusRule (CRD schema, PromQL that parses, every alert annotated), the dashboard
    ConfigMap (the chart's file, a sound dashboard) and the Ingress (to the gateway Service's
    port, not to the operational endpoints unless asked)."""
    errors: list[str] = []
    kinds = by_kind(docs)
    for d in kinds.get("PrometheusRule", []):
        where = f"PrometheusRule {d['metadata']['name']}"
        try:
            jsonschema.validate(d["spec"], PROMETHEUS_RULE_SPEC)
        except jsonschema.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(str(p) for p in exc.path)}: {exc.message}")
            continue
        for rule in (r for g in d["spec"]["groups"] for r in g["rules"]):
            alert = rule.get("alert", "?")
            missing = [a for a in ALERT_ANNOTATIONS if not rule.get("annotations", {}).get(a)]
            if missing:
                errors.append(f"{where}: {alert} has no {', '.join(missing)}")
            if not rule.get("labels", {}).get("severity"):
                errors.append(f"{where}: {alert} has no severity")
        for name, expr in rule_queries([d]).items():
            try:
                metric_names(expr)
            except ValueError as exc:
                errors.append(f"{where}: {name}: {exc}: {expr}")
    shipped = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for cm in kinds.get("ConfigMap", []):
        for key, text in cm.get("data", {}).items():
            if not key.endswith(".json"):
                continue
            where = f"ConfigMap {cm['metadata']['name']} {key}"
            dashboard = json.loads(text)
            if dashboard != shipped:
                errors.append(f"{where}: differs from {DASHBOARD.relative_to(ROOT)}")
            errors += check_dashboard(dashboard, where)
    services = {
        s["metadata"]["name"]: {p["name"] for p in s["spec"]["ports"]}
        for s in kinds.get("Service", [])
    }
    for ing in kinds.get("Ingress", []):
        where = f"Ingress {ing['metadata']['name']}"
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                svc = path["backend"]["service"]
                if svc["port"].get("name") not in services.get(svc["name"], set()):
                    errors.append(f"{where}: {path['path']} goes to no Service port: {svc}")
    return errors


# --- values.yaml documentation and schema ------------------------------------------------------

_PARAM = re.compile(r"^\s*## @(param|skip) ([A-Za-z0-9_.]+)(?:\s+\[[^\]]*\])?(?:\s+(.*))?$")


def leaf_paths(value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves; an empty map or a list is a leaf."""
    if isinstance(value, dict) and value:
        out: list[str] = []
        for k, v in value.items():
            out.extend(leaf_paths(v, f"{prefix}.{k}" if prefix else k))
        return out
    return [prefix]


def has_path(value: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def schema_at(schema: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in dotted.split("."):
        props = (node or {}).get("properties", {})
        node = props.get(part)
        if node is None:
            return None
    return node


def check_values_docs(chart: Path = CHART) -> list[str]:
    errors: list[str] = []
    text = (chart / "values.yaml").read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    schema = json.loads((chart / "values.schema.json").read_text(encoding="utf-8"))
    params: dict[str, str] = {}
    for line in text.splitlines():
        m = _PARAM.match(line)
        if m:
            params[m.group(2)] = m.group(3) or ""
            if m.group(1) == "param" and not m.group(3):
                errors.append(f"values.yaml: @param {m.group(2)} has no description")
    for p in params:
        if not has_path(values, p):
            errors.append(f"values.yaml: @param {p} names no value")
    for leaf in leaf_paths(values):
        parts = leaf.split(".")
        if not any(".".join(parts[:i]) in params for i in range(1, len(parts) + 1)):
            errors.append(f"values.yaml: {leaf} has no ## @param line")
        if schema_at(schema, leaf) is None:
            errors.append(f"values.schema.json: no schema for {leaf}")
    try:
        jsonschema.validate(values, schema)
    except jsonschema.ValidationError as exc:
        errors.append(f"values.yaml does not match values.schema.json: {exc.message}")
    # Every .Values reference in the templates exists in values.yaml (no silent typos).
    for tpl in sorted((chart / "templates").glob("*")):
        for ref in re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", tpl.read_text("utf-8")):
            path = ref.lstrip(".")
            if not has_path(values, path):
                errors.append(f"{tpl.name}: .Values.{path} is not in values.yaml")
    return errors


# --- the chart README's parameter tables ------------------------------------------------------

README_BEGIN = "<!-- parameters: generated by `python scripts/helm_check.py readme` -->"
README_END = "<!-- end of parameters -->"
_SECTION = re.compile(r"^## @section (.+)$")


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def parameter_tables(chart: Path = CHART) -> str:
    """Markdown tables of every @param, by @section, with its default (bitnami style)."""
    text = (chart / "values.yaml").read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    out: list[str] = []
    for line in text.splitlines():
        sec = _SECTION.match(line.strip())
        if sec:
            out += [
                "",
                f"### {sec.group(1)}",
                "",
                "| Name | Description | Value |",
                "| --- | --- | --- |",
            ]
            continue
        m = _PARAM.match(line)
        if m and m.group(1) == "param":
            value: Any = values
            for part in m.group(2).split("."):
                value = value[part]
            desc = (m.group(3) or "").replace("|", "\\|")
            out.append(f"| `{m.group(2)}` | {desc} | {_shown(value)} |")
    return "\n".join([README_BEGIN, *out, "", README_END])


def readme_with_tables(chart: Path = CHART) -> tuple[str, str]:
    """(current README, README with regenerated tables)."""
    current = (chart / "README.md").read_text(encoding="utf-8")
    start, end = current.index(README_BEGIN), current.index(README_END) + len(README_END)
    return current, current[:start] + parameter_tables(chart) + current[end:]


# --- command line ------------------------------------------------------------------------------


def run_checks() -> int:
    failures: list[str] = []
    default_values = load_yaml(CHART / "values.yaml")
    production = load_yaml(PRODUCTION)
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))

    failures += check_values_docs()
    current, expected = readme_with_tables()
    if current != expected:
        failures.append("helm/sbgate/README.md: parameters are stale; run helm_check.py readme")

    cases: list[tuple[str, dict[str, Any] | None, dict[str, Any], dict[str, int]]] = [
        (
            "defaults",
            MINIMAL,
            coalesce(default_values, MINIMAL),
            {
                "ConfigMap": 1,
                "Secret": 1,
                "Service": 1,
                "ServiceAccount": 1,
                "Deployment": 1,
                "PodDisruptionBudget": 1,
            },
        ),
        (
            "production",
            production,
            coalesce(default_values, production),
            {
                "ConfigMap": 2,
                "Service": 2,
                "ServiceAccount": 1,
                "Deployment": 2,
                "PodDisruptionBudget": 1,
                "HorizontalPodAutoscaler": 1,
                "ServiceMonitor": 1,
                "PrometheusRule": 1,
                "Ingress": 1,
                "NetworkPolicy": 1,
                "CronJob": 1,
            },
        ),
        (
            "defaults + alerts, dashboard, ingress",
            coalesce(MINIMAL, OBSERVABILITY),
            coalesce(default_values, coalesce(MINIMAL, OBSERVABILITY)),
            {
                "ConfigMap": 2,
                "Secret": 1,
                "Service": 1,
                "ServiceAccount": 1,
                "Deployment": 1,
                "PodDisruptionBudget": 1,
                "PrometheusRule": 1,
                "Ingress": 1,
            },
        ),
    ]

    # Lint: the defaults as shipped (which deliberately do not install: their validation
    # messages are only logged in lint mode) and the production values.
    for label, lint_values in (("defaults", None), ("production", production)):
        findings, log = lint(lint_values)
        bad = [f for f in findings if not f.startswith("INFO")]
        failures += [f"helm lint ({label}): {f}" for f in bad]
        fails = [line for line in log if "funcMap fail" in line]
        if label == "production" and fails:
            failures += [f"helm lint ({label}): {line}" for line in fails]
        print(f"helm lint ({label}): {len(bad)} finding(s); {len(findings) - len(bad)} info")
        for f in findings:
            print(f"  {f}")

    for label, given, merged, kinds in cases:
        try:
            jsonschema.validate(merged, schema)
        except jsonschema.ValidationError as exc:
            failures.append(f"schema ({label}): {exc.message}")
        try:
            docs, _notes = render(given)
        except RenderError as exc:
            failures.append(f"render ({label}): {exc}")
            continue
        failures += [f"render ({label}): {e}" for e in expect_kinds(docs, kinds)]
        failures += [f"render ({label}): {e}" for e in check_manifests(docs, merged)]
        print(f"render ({label}): {len(docs)} objects")
        for version in KUBE_VERSIONS:
            try:
                versioned, _ = render(given, kube_version=version)
            except RenderError as exc:
                failures.append(f"render ({label}, Kubernetes {version}): {exc}")
                continue
            found, skipped = validate_manifests(versioned, version)
            failures += [f"kubernetes {version} ({label}): {e}" for e in found]
            print(
                f"kubernetes {version} schemas ({label}): {len(versioned) - len(skipped)} "
                f"valid" + (f"; no bundled schema for {', '.join(skipped)}" if skipped else "")
            )

    # kubeVersion refuses the versions just outside the supported range.
    for version in KUBE_VERSIONS_REFUSED:
        try:
            render(MINIMAL, kube_version=version)
            failures.append(f"kubeVersion: Kubernetes {version} should be refused")
        except RenderError as exc:
            if "kubeVersion" not in str(exc) and "Kubernetes version" not in str(exc):
                failures.append(f"kubeVersion: {version} refused for another reason: {exc}")

    # The defaults alone must be refused with a message that says what to set.
    try:
        render(None)
        failures.append("render (bare defaults): expected the chart to refuse them")
    except RenderError as exc:
        if "config.entities" not in str(exc):
            failures.append(f"render (bare defaults): unexpected error {exc}")

    for f in failures:
        print(f"FAIL {f}")
    print(f"helm chart: {'FAILED' if failures else 'ok'} ({len(failures)} finding(s))")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="lint and render checks (exit 1 on any finding)")
    sub.add_parser("readme", help="regenerate the parameter tables in helm/sbgate/README.md")
    r = sub.add_parser("render", help="print the rendered manifests as JSON")
    q = sub.add_parser(
        "queries", help="the metric names each alert (as rendered) and dashboard query reads"
    )
    for p in (r, q):
        p.add_argument("-f", "--values", action="append", default=[], type=Path)
        p.add_argument("--set-json", action="append", default=[], help="a JSON object of values")
    args = parser.parse_args(argv)
    if args.cmd == "check":
        return run_checks()
    if args.cmd == "readme":
        _, updated = readme_with_tables()
        (CHART / "README.md").write_text(updated, encoding="utf-8")
        return 0
    values: dict[str, Any] = {}
    for f in args.values:
        values = coalesce(values, load_yaml(f) or {})
    for s in args.set_json:
        values = coalesce(values, json.loads(s))
    try:
        docs, notes = render(values or None)
    except RenderError as exc:
        json.dump({"error": str(exc)}, sys.stdout)
        return 2
    if args.cmd == "queries":
        dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
        queries = {
            **{f"alert {k}": v for k, v in rule_queries(docs).items()},
            **{f"dashboard {k}": v for k, v in dashboard_queries(dashboard).items()},
        }
        json.dump({k: sorted(metric_names(v)) for k, v in queries.items()}, sys.stdout)
        return 0
    json.dump({"manifests": docs, "notes": notes}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
