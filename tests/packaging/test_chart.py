"""The Helm chart, rendered by Helm's own library, against the gateway's own config loader.

Rendering runs `scripts/helm_check.py render` in .venv-tools (helm-sdkpy needs its own venv;
`scripts/lint-packaging.sh` creates it). The rendered environment of each container is then
handed to `gateway.config.load_settings`, so a chart value the gateway would refuse at start-up
fails here instead of in a cluster.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config import load_settings
from tests.conftest import GatewayFactory

ROOT = Path(__file__).resolve().parents[2]
TOOLS_PYTHON = ROOT / ".venv-tools" / "bin" / "python"
PRODUCTION = ROOT / "helm" / "sbgate" / "ci" / "production-values.yaml"
DASHBOARD = ROOT / "helm" / "sbgate" / "dashboards" / "sbgate.json"

pytestmark = [
    pytest.mark.integration,  # each test renders the chart in a subprocess (the tools' Python)
    pytest.mark.slow,  # about a second each; `make packaging` lints the chart too
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
MINIMAL: dict[str, Any] = {
    "config": {"entities": ["queue:orders", "topic:events"]},
    "serviceBus": {
        "primary": {"connectionString": PRIMARY_CS},
        "secondary": {"connectionString": SECONDARY_CS},
    },
    "auth": {"rules": "[[rules]]\n"},
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(values: dict[str, Any] | None = None, *files: Path) -> dict[str, Any]:
    """{"manifests": [...], "notes": str} or {"error": str}, as `helm install` would render."""
    argv = [str(TOOLS_PYTHON), str(ROOT / "scripts" / "helm_check.py"), "render"]
    for f in files:
        argv += ["-f", str(f)]
    if values:
        argv += ["--set-json", json.dumps(values)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode not in (0, 2):
        sys.stderr.write(proc.stderr)
        raise AssertionError(f"render failed to run: exit {proc.returncode}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def objects(result: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    assert "error" not in result, result.get("error")
    return {d["metadata"]["name"]: d for d in result["manifests"] if d["kind"] == kind}


def container(result: dict[str, Any], deployment: str) -> dict[str, Any]:
    c: dict[str, Any] = objects(result, "Deployment")[deployment]["spec"]["template"]["spec"][
        "containers"
    ][0]
    return c


def pod_spec(result: dict[str, Any], deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = objects(result, "Deployment")[deployment]["spec"]["template"]["spec"]
    return spec


def environment(result: dict[str, Any], deployment: str) -> dict[str, str]:
    """The container's environment as the kubelet would build it, secrets filled with samples."""
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


@pytest.fixture(scope="module")
def production() -> dict[str, Any]:
    return render(None, PRODUCTION)


@pytest.fixture(scope="module")
def minimal() -> dict[str, Any]:
    return render(MINIMAL)


def test_production_environment_is_accepted_by_the_gateway(production: dict[str, Any]) -> None:
    gw = settings_of(production, "sbgate")
    assert gw.listen_host == "0.0.0.0"
    assert gw.listen_port == 8080
    assert gw.replica_id.startswith("sbgate-")
    assert [(e.kind, e.path) for e in gw.entities] == [("queue", "orders"), ("topic", "events")]
    (pair,) = gw.pairs
    assert pair.primary.fully_qualified_namespace == "contoso.servicebus.windows.net"
    assert pair.secondary is not None
    assert pair.secondary.fully_qualified_namespace == "contoso-dr.servicebus.windows.net"
    assert pair.primary.connection_string is None
    assert gw.redis_url is not None
    assert gw.failover.create_backlog_queues is False
    assert gw.syphon.enabled is False  # the separate syphon Deployment runs it
    assert gw.auth_rules_file == "/etc/sbgate/auth-rules"
    assert gw.allow_open is False
    assert gw.azure_credential == "workload"  # workload identity on: a deterministic credential

    syphon = settings_of(production, "sbgate-syphon")
    assert syphon.syphon.enabled is True
    assert syphon.shutdown.drain_delay == 0
    assert container(production, "sbgate-syphon")["args"] == ["syphon"]


def test_production_objects(production: dict[str, Any]) -> None:
    assert "Secret" not in {d["kind"] for d in production["manifests"]}  # all existing Secrets
    sa = objects(production, "ServiceAccount")["sbgate"]
    assert sa["metadata"]["annotations"]["azure.workload.identity/client-id"]
    for name in ("sbgate", "sbgate-syphon"):
        labels = objects(production, "Deployment")[name]["spec"]["template"]["metadata"]["labels"]
        assert labels["azure.workload.identity/use"] == "true"
        assert pod_spec(production, name)["serviceAccountName"] == "sbgate"
    assert "replicas" not in objects(production, "Deployment")["sbgate"]["spec"]  # HPA owns it
    assert objects(production, "HorizontalPodAutoscaler")["sbgate"]["spec"]["minReplicas"] == 3
    assert objects(production, "PodDisruptionBudget")["sbgate"]["spec"]["minAvailable"] == 2
    sm = objects(production, "ServiceMonitor")["sbgate"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    np = objects(production, "NetworkPolicy")["sbgate"]
    egress_ports = {p["port"] for rule in np["spec"]["egress"] for p in rule.get("ports", [])}
    assert {53, 6379, 6380, 5671, 443} <= egress_ports


def test_minimal_environment_is_accepted_by_the_gateway(minimal: dict[str, Any]) -> None:
    gw = settings_of(minimal, "sbgate")
    (pair,) = gw.pairs
    assert pair.primary.endpoint_host == "contoso.servicebus.windows.net"
    assert pair.secondary is not None
    assert pair.secondary.endpoint_host == "contoso-dr.servicebus.windows.net"
    assert gw.syphon.enabled is True
    assert gw.shutdown.drain_delay == 5
    assert gw.shutdown.shutdown_timeout == 20
    assert gw.redis_url is None
    secret = objects(minimal, "Secret")["sbgate"]
    assert set(secret["data"]) == {
        "primary-connection-string",
        "secondary-connection-string",
        "auth-rules",
    }
    assert objects(minimal, "PodDisruptionBudget")  # two replicas by default


@pytest.mark.parametrize("deployment", ["sbgate", "sbgate-syphon"])
def test_pods_are_locked_down(deployment: str) -> None:
    result = render(merge(MINIMAL, {"syphon": {"enabled": True}}))
    pod = pod_spec(result, deployment)
    c = container(result, deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["enableServiceLinks"] is False  # SBGATE_SERVICE_* would be unknown settings
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])


def test_probes_prestop_and_grace_period(minimal: dict[str, Any]) -> None:
    c = container(minimal, "sbgate")
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    # preStop 5 + drain 5 + shutdown 20 + margin 10
    assert pod_spec(minimal, "sbgate")["terminationGracePeriodSeconds"] == 40


def test_grace_period_follows_the_settings() -> None:
    result = render(
        merge(MINIMAL, {"config": {"drainDelay": 2.5, "shutdownTimeout": 45}, "preStop": {}})
    )
    assert pod_spec(result, "sbgate")["terminationGracePeriodSeconds"] == 63  # ceil(62.5)


def test_too_short_grace_period_is_refused() -> None:
    result = render(merge(MINIMAL, {"terminationGracePeriodSeconds": 30}))
    assert "terminationGracePeriodSeconds=30 is shorter than" in result["error"]
    assert "= 40" in result["error"]


def test_bare_defaults_say_what_to_set() -> None:
    error = render()["error"]
    for name in ("config.entities", "serviceBus.primary.connectionString", "auth.rules"):
        assert name in error


def test_probes_are_overridable() -> None:
    custom = {"tcpSocket": {"port": "http"}, "periodSeconds": 7}
    result = render(
        merge(MINIMAL, {"customLivenessProbe": custom, "readinessProbe": {"enabled": False}})
    )
    c = container(result, "sbgate")
    assert c["livenessProbe"] == custom
    assert "readinessProbe" not in c


def test_large_numbers_are_not_written_in_exponent_notation() -> None:
    # Premium-sized messages; the batch limit must follow (config.extraEnv carries it).
    premium = {"maxMessageBytes": 1048576, "extraEnv": {"SBGATE_MAX_BATCH_BYTES": 1048576}}
    result = render(merge(MINIMAL, {"config": premium}))
    env = environment(result, "sbgate")
    assert env["SBGATE_MAX_MESSAGE_BYTES"] == "1048576"
    assert env["SBGATE_MAX_BATCH_BYTES"] == "1048576"
    assert settings_of(result, "sbgate").limits.max_message_bytes == 1048576


def test_max_token_lifetime_reaches_the_gateway(minimal: dict[str, Any]) -> None:
    assert "SBGATE_AUTH_MAX_TOKEN_LIFETIME" not in environment(minimal, "sbgate")
    result = render(merge(MINIMAL, {"auth": {"maxTokenLifetime": 3600}}))
    assert environment(result, "sbgate")["SBGATE_AUTH_MAX_TOKEN_LIFETIME"] == "3600"
    assert settings_of(result, "sbgate").auth_max_token_lifetime == 3600


def test_token_cache_size_reaches_the_gateway(minimal: dict[str, Any]) -> None:
    assert "SBGATE_AUTH_TOKEN_CACHE_SIZE" not in environment(minimal, "sbgate")
    result = render(merge(MINIMAL, {"auth": {"tokenCacheSize": 0}}))
    assert environment(result, "sbgate")["SBGATE_AUTH_TOKEN_CACHE_SIZE"] == "0"
    assert settings_of(result, "sbgate").auth_token_cache_size == 0


def test_existing_secrets_and_single_replica() -> None:
    values = {
        "replicaCount": 1,
        "config": {"entities": ["queue:orders"]},
        "serviceBus": {"existingSecret": "sb"},
        "redis": {"existingSecret": "redis", "existingSecretKey": "url"},
        "auth": {"allowOpen": True},
    }
    result = render(values)
    kinds = {d["kind"] for d in result["manifests"]}
    assert "Secret" not in kinds
    assert "PodDisruptionBudget" not in kinds  # one replica: a PDB would block node drains
    env = {e["name"]: e for e in container(result, "sbgate")["env"]}
    primary = env["SBGATE_PRIMARY_CONNECTION_STRING"]["valueFrom"]["secretKeyRef"]
    secondary = env["SBGATE_SECONDARY_CONNECTION_STRING"]["valueFrom"]["secretKeyRef"]
    assert primary == {"name": "sb", "key": "primary-connection-string"}
    assert secondary == {"name": "sb", "key": "secondary-connection-string", "optional": True}
    assert env["SBGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "url"}
    assert settings_of(result, "sbgate").allow_open is True


def test_config_file_is_mounted() -> None:
    toml = "[failover]\nfailover_interval = 30.0\n"
    result = render(merge(MINIMAL, {"config": {"file": toml}}))
    assert objects(result, "ConfigMap")["sbgate-file"]["data"]["config.toml"] == toml
    assert environment(result, "sbgate")["SBGATE_CONFIG"] == "/etc/sbgate/config.toml"
    etc = next(v for v in pod_spec(result, "sbgate")["volumes"] if v["name"] == "etc-sbgate")
    sources = etc["projected"]["sources"]
    assert sources[0]["configMap"]["items"] == [{"key": "config.toml", "path": "config.toml"}]
    assert sources[1]["secret"]["items"] == [{"key": "auth-rules", "path": "auth-rules"}]


def test_schema_rejects_unknown_values() -> None:
    assert "additional properties" in render(merge(MINIMAL, {"replicas": 3}))["error"]
    assert "logFormat" in render(merge(MINIMAL, {"config": {"logFormat": "xml"}}))["error"]


def test_credential_follows_workload_identity_or_the_value(minimal: dict[str, Any]) -> None:
    assert "SBGATE_AZURE_CREDENTIAL" not in environment(minimal, "sbgate")
    by_name = {
        "serviceBus": {
            "primary": {"connectionString": "", "namespace": "contoso.servicebus.windows.net"},
            "secondary": {"connectionString": ""},
            "credential": "managed",
            "managedIdentityClientId": "11111111-2222-3333-4444-555555555555",
        }
    }
    result = render(merge(MINIMAL, by_name))
    settings = settings_of(result, "sbgate")
    assert settings.azure_credential == "managed"
    assert settings.azure_client_id == "11111111-2222-3333-4444-555555555555"
    bad = render(merge(MINIMAL, {"serviceBus": {"credential": "cli"}}))
    assert "credential" in bad["error"]


def test_audit_cronjob(production: dict[str, Any]) -> None:
    (job,) = objects(production, "CronJob").values()
    assert job["spec"]["schedule"] == "30 3 * * *"
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "myregistry.azurecr.io/sbgate-audit:0.1.0"
    assert "command" not in c  # the audit image's entry point: gateway audit
    assert c["args"][:2] == ["--ledger", "/data/ledger"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/audit", "/data"}
    labels = job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    assert labels["azure.workload.identity/use"] == "true"
    assert "CronJob" not in {d["kind"] for d in render(MINIMAL)["manifests"]}  # off by default
    assert "audit.args" in render(merge(MINIMAL, {"audit": {"enabled": True}}))["error"]


# --- the alerts, the dashboard and the Ingress -------------------------------------------------

ALERTS = {
    "SbgateEntityFailedOver",
    "SbgateBacklogGrowing",
    "SbgateBacklogMessageTooOld",
    "SbgateLedgerEventsDropped",
    "SbgateRedisDisconnected",
    "SbgateHighErrorRatio",
    "SbgateAdmissionSaturated",
    "SbgateTaskRestarting",
}
# The series names a metric family exposes, by type (prometheus_client's text format).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def rules(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (rule,) = objects(result, "PrometheusRule").values()
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def message_paths(entity: str, kind: str) -> list[str]:
    return [f"/{entity}/messages", f"/{entity}/Messages", f"/{kind}s/{entity}/messages"]


def test_alerts_dashboard_and_ingress_are_off_by_default(minimal: dict[str, Any]) -> None:
    kinds = {d["kind"] for d in minimal["manifests"]}
    assert not kinds & {"PrometheusRule", "Ingress"}
    assert set(objects(minimal, "ConfigMap")) == {"sbgate"}  # no dashboard


def test_alerts_dashboard_and_ingress_turned_on_with_their_defaults() -> None:
    values = {
        "config": {"publicHosts": ["sbgate.contoso.com"]},
        "ingress": {"enabled": True},
        "metrics": {"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
    }
    result = render(merge(MINIMAL, values))
    alerts = rules(result)
    assert set(alerts) == ALERTS
    assert alerts["SbgateBacklogMessageTooOld"]["expr"].endswith("> 1800")  # 30 minutes
    assert alerts["SbgateBacklogGrowing"]["expr"].endswith("> 0.01")
    assert alerts["SbgateLedgerEventsDropped"]["for"] == "0m"
    assert all(set(r["labels"]) == {"severity"} for r in alerts.values())
    cm = objects(result, "ConfigMap")["sbgate-dashboard"]
    assert "annotations" not in cm["metadata"]  # no folder
    (rule,) = objects(result, "Ingress")["sbgate"]["spec"]["rules"]
    assert rule["host"] == "sbgate.contoso.com"
    paths = [p["path"] for p in rule["http"]["paths"]]
    assert paths == message_paths("orders", "queue") + message_paths("events", "topic")
    assert "tls" not in objects(result, "Ingress")["sbgate"]["spec"]


def test_production_alerts(production: dict[str, Any]) -> None:
    alerts = rules(production)
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
        assert rule["labels"]["team"] == "messaging"  # metrics.prometheusRule.alertLabels
        # This release's series only: the namespace and Services its ServiceMonitor scrapes.
        assert 'namespace="messaging", service=~"sbgate|sbgate-syphon"' in rule["expr"], name
    assert alerts["SbgateEntityFailedOver"]["for"] == "10m"
    assert 'sbgate_failover_status="failed_over"' in alerts["SbgateEntityFailedOver"]["expr"]
    # ci/production-values.yaml: 20 minutes instead of 30.
    assert alerts["SbgateBacklogMessageTooOld"]["expr"].endswith("> 1200")
    assert alerts["SbgateHighErrorRatio"]["expr"].endswith("> 0.05")
    assert alerts["SbgateHighErrorRatio"]["labels"]["severity"] == "critical"
    assert "runbook_url" not in alerts["SbgateHighErrorRatio"]["annotations"]
    rule = next(iter(objects(production, "PrometheusRule").values()))
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_alerts_are_tuned_and_turned_off_one_by_one() -> None:
    alerts = {
        "entityFailedOver": {"enabled": False},
        "errorRatio": {"threshold": 0.1, "for": "10m", "severity": "page"},
        "admissionSaturation": {"threshold": 2.5},
    }
    values = {
        "prometheusRule": {
            "enabled": True,
            "selector": 'job="sbgate"',
            "runbookUrl": "https://wiki.contoso.com/sbgate",
            "interval": "1m",
            "alerts": alerts,
        }
    }
    result = render(merge(MINIMAL, {"metrics": values}))
    got = rules(result)
    assert set(got) == ALERTS - {"SbgateEntityFailedOver"}
    ratio = got["SbgateHighErrorRatio"]
    assert ratio["expr"].endswith("> 0.1")
    assert (ratio["for"], ratio["labels"]["severity"]) == ("10m", "page")
    assert "10%" in ratio["annotations"]["summary"]
    assert ratio["annotations"]["runbook_url"] == (
        "https://wiki.contoso.com/sbgate#sbgatehigherrorratio"
    )
    assert got["SbgateAdmissionSaturated"]["expr"].endswith("> 2.5")
    assert all('{job="sbgate"' in r["expr"] for r in got.values())
    assert all("namespace=" not in r["expr"] for r in got.values())
    (rule,) = objects(result, "PrometheusRule").values()
    assert rule["spec"]["groups"][0]["interval"] == "1m"
    every_one_off = {k: {"enabled": False} for k in _alert_keys()}
    empty = render(
        merge(MINIMAL, {"metrics": {"prometheusRule": {"enabled": True, "alerts": every_one_off}}})
    )
    (rule,) = objects(empty, "PrometheusRule").values()
    assert rule["spec"]["groups"][0]["rules"] == []


def _alert_keys() -> list[str]:
    import yaml

    values = yaml.safe_load((ROOT / "helm" / "sbgate" / "values.yaml").read_text("utf-8"))
    return list(values["metrics"]["prometheusRule"]["alerts"])


def test_production_dashboard(production: dict[str, Any]) -> None:
    cm = objects(production, "ConfigMap")["sbgate-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert cm["metadata"]["annotations"]["k8s-sidecar-target-directory"] == "Messaging"
    # The file in the chart, as it is: importable by hand too.
    assert json.loads(cm["data"]["sbgate.json"]) == json.loads(DASHBOARD.read_text("utf-8"))


def test_dashboard_label_and_folder_are_configurable() -> None:
    values = {
        "grafanaDashboard": {
            "enabled": True,
            "sidecarLabel": "dashboards",
            "sidecarLabelValue": "sbgate",
            "folder": "Platform",
            "folderAnnotation": "grafana_folder",
            "namespace": "monitoring",
        }
    }
    cm = objects(render(merge(MINIMAL, {"metrics": values})), "ConfigMap")["sbgate-dashboard"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["dashboards"] == "sbgate"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Platform"}


def test_production_ingress(production: dict[str, Any]) -> None:
    ing = objects(production, "Ingress")["sbgate"]
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"secretName": "sbgate-tls", "hosts": ["sbgate.contoso.com"]}]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "sbgate.contoso.com"  # config.publicHosts: what clients sign
    paths = [p["path"] for p in rule["http"]["paths"]]
    assert paths == message_paths("orders", "queue") + message_paths("events", "topic")
    for p in rule["http"]["paths"]:
        assert p["pathType"] == "Prefix"
        assert p["backend"]["service"] == {"name": "sbgate", "port": {"name": "http"}}
    # The operational endpoints stay inside the cluster.
    for endpoint in ("/metrics", "/admin/entities", "/openapi.json", "/healthz", "/readyz"):
        assert not any(endpoint.startswith(p) for p in paths), endpoint
    annotations = ing["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span"] == "true"
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "1048576"


def test_ingress_follows_its_values() -> None:
    values = {
        "config": {"extraEnv": {"SBGATE_MAX_BODY_BYTES": "4194304"}},
        "ingress": {
            "enabled": True,
            "hosts": ["gw.contoso.com"],
            "paths": [{"path": "/", "pathType": "Prefix"}],
            "extraPaths": [{"path": "/admin", "pathType": "Prefix"}],
            "annotations": {
                "nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span": "false"
            },
        },
    }
    result = render(merge(MINIMAL, values))
    ing = objects(result, "Ingress")["sbgate"]
    assert "ingressClassName" not in ing["spec"]  # the cluster's default class
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "gw.contoso.com"
    assert [p["path"] for p in rule["http"]["paths"]] == ["/", "/admin"]
    annotations = ing["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span"] == "false"
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "4194304"
    assert settings_of(result, "sbgate").limits.max_body_bytes == 4194304
    plain = render(merge(MINIMAL, merge(values, {"ingress": {"nginxAnnotations": False}})))
    assert objects(plain, "Ingress")["sbgate"]["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span": "false"
    }


def test_ingress_needs_a_host() -> None:
    error = render(merge(MINIMAL, {"ingress": {"enabled": True}}))["error"]
    assert "ingress.hosts" in error


def test_a_low_keepalive_behind_the_ingress_is_warned_about() -> None:
    values = {"config": {"publicHosts": ["gw.contoso.com"]}, "ingress": {"enabled": True}}
    assert "KEEPALIVE" not in render(merge(MINIMAL, values))["notes"]
    low = merge(values, {"config": {"extraEnv": {"SBGATE_KEEPALIVE_TIMEOUT": "30"}}})
    assert "SBGATE_KEEPALIVE_TIMEOUT=30 is not above" in render(merge(MINIMAL, low))["notes"]


def observability_findings(*cases: list[dict[str, Any]]) -> list[list[str]]:
    """scripts/helm_check.py's findings on each list of manifests (in the tools' Python)."""
    script = (
        "import json, sys; sys.path.insert(0, 'scripts'); import helm_check; "
        "print(json.dumps([helm_check.check_observability(c) for c in json.load(sys.stdin)]))"
    )
    proc = subprocess.run(
        [str(TOOLS_PYTHON), "-c", script],
        input=json.dumps(cases),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    findings: list[list[str]] = json.loads(proc.stdout)
    return findings


def test_the_chart_check_catches_broken_alerts_dashboards_and_ingresses(
    production: dict[str, Any],
) -> None:
    def kind(docs: list[dict[str, Any]], k: str, name: str = "sbgate") -> dict[str, Any]:
        (d,) = (d for d in docs if d["kind"] == k and d["metadata"]["name"] == name)
        return d

    broken = copy.deepcopy(production["manifests"])
    alerts = kind(broken, "PrometheusRule")["spec"]["groups"][0]["rules"]
    alerts[0]["expr"] += ")"
    del alerts[1]["annotations"]["runbook"]
    cm = kind(broken, "ConfigMap", "sbgate-dashboard")
    dashboard = json.loads(cm["data"]["sbgate.json"])
    dashboard["panels"][1]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    cm["data"]["sbgate.json"] = json.dumps(dashboard)
    kind(broken, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"][
        "port"
    ] = {"name": "metrics"}
    unknown = copy.deepcopy(production["manifests"])
    kind(unknown, "PrometheusRule")["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"

    sound, found, schema = observability_findings(production["manifests"], broken, unknown)
    assert sound == []
    assert len(found) == 5, found
    assert any("SbgateEntityFailedOver: unexpected right parenthesis" in f for f in found)
    assert any("SbgateBacklogGrowing has no runbook" in f for f in found)
    assert any("differs from helm/sbgate/dashboards/sbgate.json" in f for f in found)
    assert any("does not use ${datasource}" in f for f in found)
    assert any("/orders/messages goes to no Service port" in f for f in found)
    assert len(schema) == 1 and "ten minutes" in schema[0]


def queried_series(*files: Path) -> dict[str, list[str]]:
    """Metric names read by each alert (as rendered with `files`) and each dashboard query."""
    argv = [str(TOOLS_PYTHON), str(ROOT / "scripts" / "helm_check.py"), "queries"]
    for f in files:
        argv += ["-f", str(f)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, list[str]] = json.loads(proc.stdout)
    return result


def exposed_series(exposition: str) -> set[str]:
    """Every series name /metrics can show: each family's own samples, and the names its
    type gives it even before a labelled child exists."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


async def test_every_series_the_alerts_and_the_dashboard_read_is_exposed(
    gateway: GatewayFactory,
) -> None:
    # A gateway that fails over and runs the syphon: every metric it can have is registered.
    env = {"SBGATE_ENABLE_FAILOVER": "true", "SBGATE_ENABLE_SYPHON": "true"}
    gw = await gateway(env)
    exposed = exposed_series(await (await gw.get("/metrics")).text())
    queried = queried_series(PRODUCTION)
    assert sum(k.startswith("alert ") for k in queried) == len(ALERTS)
    assert any(k.startswith("dashboard panel") for k in queried)
    assert any(k.startswith("dashboard variable") for k in queried)
    missing = {
        where: sorted(set(names) - exposed)
        for where, names in queried.items()
        if set(names) - exposed
    }
    assert not missing, f"queries read series /metrics does not have: {missing}"


# --- the alerts evaluated by Prometheus' own rule engine (promtool test rules) -----------------

PROMTOOL = shutil.which("promtool")
# The labels the chart's ServiceMonitor gives every series of the release (production values).
SCRAPED = 'namespace="messaging", service="sbgate"'


def series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{SCRAPED}{', ' if labels else ''}{labels}}}", "values": values}


def expect(at: str, alert: str, *fired: dict[str, str]) -> dict[str, Any]:
    """At `at`, `alert` fires once per `fired` label set (none: it does not fire)."""
    base = {"namespace": "messaging", "team": "messaging"}
    return {
        "eval_time": at,
        "alertname": alert,
        "exp_alerts": [{"exp_labels": {**base, **labels}} for labels in fired],
    }


# Each case: input series (one-minute samples; `a+bxN` is a, a+b, ... N more) and the alerts
# expected at given times. The production values: failed over 10m, oldest message 20 minutes.
ALERT_CASES: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {
    "failed over for 10 minutes, on one replica of two": (
        [
            series(
                "sbgate_failover_status",
                'pod="a", entity="orders", sbgate_failover_status="failed_over"',
                "0 0 1x20",
            ),
            series(
                "sbgate_failover_status",
                'pod="b", entity="orders", sbgate_failover_status="failed_over"',
                "0x22",
            ),
            # Another release's gateway, in another namespace: not this release's alert.
            {
                "series": 'sbgate_failover_status{namespace="other", service="sbgate", '
                'pod="c", entity="orders", sbgate_failover_status="failed_over"}',
                "values": "1x22",
            },
        ],
        [
            expect("11m", "SbgateEntityFailedOver"),
            expect(
                "13m",
                "SbgateEntityFailedOver",
                {"entity": "orders", "severity": "warning"},
            ),
        ],
    ),
    "messages enter the backlog and none leave (no moved series yet)": (
        [series("sbgate_messages_total", 'pod="a", entity="orders", route="backlog"', "0+10x30")],
        [
            expect("10m", "SbgateBacklogGrowing"),
            expect("25m", "SbgateBacklogGrowing", {"severity": "warning"}),
        ],
    ),
    "the syphon keeps up with the backlog": (
        [
            series("sbgate_messages_total", 'pod="a", entity="orders", route="backlog"', "0+10x30"),
            series("sbgate_syphon_moved_total", 'pod="b", entity="orders"', "0+8x30"),
            series("sbgate_syphon_dead_lettered_total", 'pod="b", reason="TTLExpired"', "0+2x30"),
        ],
        [expect("25m", "SbgateBacklogGrowing")],
    ),
    "a message accepted at 0 still waits at the head of a backlog queue": (
        [
            series(
                "sbgate_backlog_oldest_message_timestamp_seconds",
                'pod="a", queue="primary/x-servicebus-transfer/3"',
                "0x30",
            ),
        ],
        [
            expect("19m", "SbgateBacklogMessageTooOld"),
            expect(
                "25m",
                "SbgateBacklogMessageTooOld",
                {"queue": "primary/x-servicebus-transfer/3", "severity": "critical"},
            ),
        ],
    ),
    "an empty backlog queue has no oldest message": (
        [],
        [expect("25m", "SbgateBacklogMessageTooOld")],
    ),
    "a pod drops one ledger event": (
        [
            series("sbgate_ledger_events_dropped_total", 'pod="a"', "0 0 0 1x10"),
            series("sbgate_ledger_events_dropped_total", 'pod="b"', "0x13"),
        ],
        [
            expect("2m", "SbgateLedgerEventsDropped"),
            expect("4m", "SbgateLedgerEventsDropped", {"pod": "a", "severity": "warning"}),
        ],
    ),
    "one pod loses Redis": (
        [
            series("sbgate_redis_connected", 'pod="a"', "1 1 0x10"),
            series("sbgate_redis_connected", 'pod="b"', "1x12"),
        ],
        [
            expect("3m", "SbgateRedisDisconnected"),
            expect("6m", "SbgateRedisDisconnected", {"pod": "a", "severity": "warning"}),
        ],
    ),
    "one request in ten answered 503": (
        [
            series(
                "sbgate_http_requests_total",
                'entity="orders", status="201", route="primary"',
                "0+90x20",
            ),
            series(
                "sbgate_http_requests_total",
                'entity="orders", status="503", route="none"',
                "0+10x20",
            ),
        ],
        [expect("15m", "SbgateHighErrorRatio", {"severity": "critical"})],
    ),
    "one request in a hundred answered 503, and no traffic at all": (
        [
            series(
                "sbgate_http_requests_total",
                'entity="orders", status="201", route="primary"',
                "0+99x20",
            ),
            series(
                "sbgate_http_requests_total",
                'entity="orders", status="503", route="none"',
                "0+1x20",
            ),
            series("sbgate_admission_rejected_total", 'pod="a"', "0x20"),
        ],
        [expect("15m", "SbgateHighErrorRatio"), expect("15m", "SbgateAdmissionSaturated")],
    ),
    "requests refused for lack of room for ten minutes": (
        [series("sbgate_admission_rejected_total", 'pod="a"', "0+6x20")],
        [expect("15m", "SbgateAdmissionSaturated", {"severity": "warning"})],
    ),
    "a syphon queue loop raises once and is restarted": (
        [
            series("sbgate_task_restarts_total", 'pod="a", task="syphon_queue"', "0 0 0 1x10"),
            series("sbgate_task_restarts_total", 'pod="b", task="pinger"', "0x13"),
        ],
        [
            expect("2m", "SbgateTaskRestarting"),
            expect(
                "4m",
                "SbgateTaskRestarting",
                {"pod": "a", "task": "syphon_queue", "severity": "warning"},
            ),
            expect("10m", "SbgateTaskRestarting"),
        ],
    ),
}


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (make sysdeps installs prometheus)")
def test_the_alerts_fire_when_they_should_and_only_then(
    production: dict[str, Any], tmp_path: Path
) -> None:
    import yaml

    (rule,) = objects(production, "PrometheusRule").values()
    groups = copy.deepcopy(rule["spec"]["groups"])
    for r in (r for g in groups for r in g["rules"]):
        # Prometheus renders annotations at fire time; promtool would compare them in full.
        r.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    tests = [
        {"name": name, "interval": "1m", "input_series": given, "alert_rule_test": expected}
        for name, (given, expected) in ALERT_CASES.items()
    ]
    assert {e["alertname"] for _, cases in ALERT_CASES.values() for e in cases} == ALERTS
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the README's examples -----------------------------------------------------------------


def readme_examples() -> list[str]:
    """The YAML blocks of the README's "Deploy on Kubernetes" section (chart values)."""
    import re

    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Deploy on Kubernetes\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    return re.findall(r"^```yaml\n(.*?)^```", section, re.M | re.S)


def test_the_readme_has_chart_examples() -> None:
    assert readme_examples()


@pytest.mark.parametrize("index", range(len(readme_examples())))
def test_each_readme_chart_example_installs_and_its_audit_can_run(index: int) -> None:
    """As written: the chart renders, the gateway accepts its settings, and every local path
    the audit CronJob reads or writes is on a mounted volume (the root filesystem is
    read-only)."""
    import yaml

    values = yaml.safe_load(readme_examples()[index])
    result = render(values)
    deployments = objects(result, "Deployment")
    assert deployments, result
    for name in deployments:
        settings_of(result, name)
    for job in objects(result, "CronJob").values():
        (c,) = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = [m["mountPath"].rstrip("/") + "/" for m in c["volumeMounts"]]
        paths = [a for a in c["args"] if a.startswith("/") or a.startswith("file:///")]
        assert paths, c["args"]
        for path in paths:
            local = path.removeprefix("file://")
            assert any(local.startswith(m) for m in mounts), (path, mounts)


def test_redis_mode_credential_and_ca_reach_the_gateway(minimal: dict[str, Any]) -> None:
    env = environment(minimal, "sbgate")
    assert "SBGATE_REDIS_URL" not in env and "SBGATE_REDIS_MODE" not in env  # no Redis
    azure = {
        "redis": {
            "url": "rediss://contoso.westeurope.redis.azure.net:10000/0",
            "mode": "cluster",
            "credential": "workload",
            "ca": {"configMapName": "corp-ca", "key": "bundle.pem"},
        },
        "workloadIdentity": {"enabled": True, "clientId": "11111111-2222-3333-4444-5555"},
    }
    result = render(merge(MINIMAL, azure))
    for deployment in ("sbgate",):
        settings = settings_of(result, deployment)
        assert settings.redis_mode == "cluster" and settings.redis_credential == "workload"
        assert settings.redis_ca_file == "/etc/sbgate-redis-ca/bundle.pem"
        spec = pod_spec(result, deployment)
        ca = next(v for v in spec["volumes"] if v["name"] == "redis-ca")
        assert ca["configMap"]["name"] == "corp-ca"
        assert ca["configMap"]["items"] == [{"key": "bundle.pem", "path": "bundle.pem"}]
        mount = next(
            m for m in container(result, deployment)["volumeMounts"] if m["name"] == "redis-ca"
        )
        assert mount == {"name": "redis-ca", "mountPath": "/etc/sbgate-redis-ca", "readOnly": True}
    from_secret = render(
        merge(MINIMAL, {"redis": {"url": "rediss://r:6380/0", "ca": {"secretName": "s"}}})
    )
    ca = next(v for v in pod_spec(from_secret, "sbgate")["volumes"] if v["name"] == "redis-ca")
    assert ca["secret"]["secretName"] == "s"
    assert settings_of(from_secret, "sbgate").redis_mode == "standalone"
    assert "/redis/mode" in render(merge(MINIMAL, {"redis": {"mode": "ring"}}))["error"]
    no_identity = merge(MINIMAL, {"redis": {"url": "rediss://r:6380/0", "credential": "workload"}})
    assert "workloadIdentity.enabled" in render(no_identity)["error"]
    plain = merge(MINIMAL, {"redis": {"url": "redis://r:6379/0", "mode": "sentinel"}})
    assert "redis+sentinel://" in render(plain)["error"]
