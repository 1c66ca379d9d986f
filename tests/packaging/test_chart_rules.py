"""What the chart promises whatever its values: each value set of `chart.VALUE_SETS` renders the
objects it should, passes Helm's lint and Kubernetes' own schemas, runs locked-down pods with
probes, the gateway's own settings and a grace period that covers the shutdown."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.config import env_names
from tests.packaging.chart import (
    CHART_VALUES,
    PRODUCTION,
    RENDERS,
    SAMPLE,
    VALUE_SETS,
    coalesce,
    lint,
    manifests,
    render,
    validate,
)

pytestmark = RENDERS

# The supported range (Chart.yaml's kubeVersion): the oldest and newest Kubernetes versions whose
# schemas the rendered manifests are validated against (kubernetes-validate bundles them).
KUBE_VERSIONS = ("1.25.0", "1.37.0")
# Just outside the range: the chart must refuse to install there.
KUBE_VERSIONS_REFUSED = ("1.24.0", "1.38.0")
# Custom resources: kubernetes-validate has no schema for them (test_chart_observability.py
# checks the PrometheusRule against the CRD's).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
TMP = "/tmp"  # the pod's one writable place: an emptyDir

# The objects each value set deploys.
_SAMPLE_KINDS = {
    "ConfigMap": 1,
    "Secret": 1,
    "Service": 1,
    "ServiceAccount": 1,
    "Deployment": 1,
    "PodDisruptionBudget": 1,
}
KINDS: dict[str, dict[str, int]] = {
    "sample": _SAMPLE_KINDS,
    "separate syphon": {**_SAMPLE_KINDS, "Service": 2, "Deployment": 2},
    "alerts, dashboard, ingress": {
        **_SAMPLE_KINDS,
        "ConfigMap": 2,
        "PrometheusRule": 1,
        "Ingress": 1,
    },
    "production": {
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
}


@dataclass(frozen=True)
class Case:
    name: str
    given: dict[str, Any]
    values: dict[str, Any]  # the chart's values with `given` merged over them
    docs: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def case(request: pytest.FixtureRequest) -> Case:
    given = VALUE_SETS[request.param]
    docs = manifests(render(given))
    return Case(request.param, given, coalesce(CHART_VALUES, given), docs)


def workloads(case: Case) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every Deployment and CronJob."""
    out = [
        (f"Deployment {d['metadata']['name']}", d["spec"]["template"]["spec"])
        for d in case.of_kind("Deployment")
    ]
    out += [
        (f"CronJob {j['metadata']['name']}", j["spec"]["jobTemplate"]["spec"]["template"]["spec"])
        for j in case.of_kind("CronJob")
    ]
    return out


def env_of(case: Case, c: dict[str, Any]) -> dict[str, Any]:
    """The container's environment: ConfigMap envFrom, then env (later wins, as in Kubernetes);
    a value from elsewhere is its `valueFrom`."""
    cms = {d["metadata"]["name"]: d.get("data", {}) for d in case.of_kind("ConfigMap")}
    env: dict[str, Any] = {}
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def gateway_and_syphon(case: Case) -> dict[str, dict[str, Any]]:
    """The Deployments by their container's name: `gateway`, and `syphon` when it runs apart."""
    return {
        d["spec"]["template"]["spec"]["containers"][0]["name"]: d
        for d in case.of_kind("Deployment")
    }


def test_each_value_set_deploys_its_objects(case: Case) -> None:
    got: dict[str, int] = {}
    for d in case.docs:
        assert d.get("apiVersion") and d.get("metadata", {}).get("name"), d
        got[d["kind"]] = got.get(d["kind"], 0) + 1
    assert got == KINDS[case.name]


def test_every_pod_is_locked_down(case: Case) -> None:
    for where, pod in workloads(case):
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True, where
        assert psc["runAsUser"] == 10001, where
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", where
        (c,) = pod["containers"]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts[TMP]], where  # the only writable place
        if where.startswith("Deployment"):
            assert pod["enableServiceLinks"] is False, where  # SBGATE_SERVICE_* are unknown
            assert pod["automountServiceAccountToken"] is False, where


def test_the_audit_job_runs_once_with_somewhere_to_write(case: Case) -> None:
    for job in case.of_kind("CronJob"):
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        (c,) = pod["containers"]
        assert {TMP, "/audit"} <= {m["mountPath"] for m in c["volumeMounts"]}
        assert c["args"]
        assert "command" not in c  # the image's entry point: gateway audit


def test_gateway_and_syphon_run_with_settings_the_gateway_knows(case: Case) -> None:
    deployments = gateway_and_syphon(case)
    separate = bool(case.values["syphon"]["enabled"])
    assert set(deployments) == ({"gateway", "syphon"} if separate else {"gateway"})
    known = env_names()
    workload_identity = bool(case.values["workloadIdentity"]["enabled"])
    credential = case.values["serviceBus"]["credential"] or (
        "workload" if workload_identity else None
    )
    for name, dep in deployments.items():
        where = f"Deployment {dep['metadata']['name']}"
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] + c["args"] == ["gateway", "serve" if name == "gateway" else name]
        assert c["ports"][0]["containerPort"] == 8080, where
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", where
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", where
        env = env_of(case, c)
        assert [k for k in env if k.startswith("SBGATE_") and k not in known] == [], where
        assert env["SBGATE_LISTEN_HOST"] == "0.0.0.0", where
        assert env["SBGATE_REPLICA_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}, where
        exponent = {k: v for k, v in env.items() if re.fullmatch(r"-?\d+(\.\d+)?e[+-]\d+", str(v))}
        assert exponent == {}, where
        assert env.get("SBGATE_AZURE_CREDENTIAL") == credential, where
        # The gateway runs the syphon itself unless a Deployment of its own does.
        runs_syphon = name == "syphon" or not separate
        assert env["SBGATE_ENABLE_SYPHON"] == ("true" if runs_syphon else "false"), where
    assert deployments["gateway"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]


PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def test_the_probes_ask_on_the_port_overload_never_closes(case: Case) -> None:
    """Under overload the gateway stops listening on http (gateway.web.listener.ShedSite): a
    liveness probe refused there would restart a pod that is merely busy. The probes ask on
    the probe port (SBGATE_PROBE_PORT) instead; the Service still sends traffic to http."""
    probe = case.values["containerPorts"]["probe"]
    assert probe
    for dep in gateway_and_syphon(case).values():
        where = f"Deployment {dep['metadata']['name']}"
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "http": 8080,
            "probe": probe,
        }, where
        assert env_of(case, c)["SBGATE_PROBE_PORT"] == str(probe), where
        asked = {kind: c[kind]["httpGet"]["port"] for kind in PROBES if kind in c}
        assert asked and set(asked.values()) == {"probe"}, where
    for svc in case.of_kind("Service"):
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]


def test_without_a_probe_port_the_probes_ask_on_http() -> None:
    docs = manifests(render(coalesce(SAMPLE, {"containerPorts": {"probe": 0}})))
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in c["ports"]] == ["http"]
    assert "SBGATE_PROBE_PORT" not in {e["name"] for e in c["env"]}
    assert {c[kind]["httpGet"]["port"] for kind in PROBES} == {"http"}


def test_the_grace_period_covers_prestop_drain_and_shutdown(case: Case) -> None:
    pod = gateway_and_syphon(case)["gateway"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sleep, seconds = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    env = env_of(case, c)
    needed = (
        float(seconds) + float(env["SBGATE_DRAIN_DELAY"]) + float(env["SBGATE_SHUTDOWN_TIMEOUT"])
    )
    assert needed < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifests_are_valid_kubernetes_objects(case: Case, version: str) -> None:
    docs = manifests(render(case.given, kube_version=version))
    found = validate(docs, version)
    assert found["errors"] == []
    assert set(found["skipped"]) <= CUSTOM_KINDS


@pytest.mark.parametrize("version", KUBE_VERSIONS_REFUSED)
def test_kubernetes_outside_the_supported_range_is_refused(version: str) -> None:
    error = render(SAMPLE, kube_version=version)["error"]
    assert "kubeVersion" in error or "Kubernetes version" in error


def test_bare_defaults_say_what_to_set() -> None:
    error = render()["error"]
    for name in ("config.entities", "serviceBus.primary.connectionString", "auth.rules"):
        assert name in error


@pytest.mark.parametrize("given", [None, PRODUCTION], ids=["defaults as shipped", "production"])
def test_helm_lint(given: dict[str, Any] | None) -> None:
    result = lint(given)
    assert [f for f in result["findings"] if not f.startswith("INFO")] == []
    if given is not None:
        # The defaults alone deliberately do not install: lint only logs their `fail` messages.
        assert [line for line in result["log"] if "funcMap fail" in line] == []
