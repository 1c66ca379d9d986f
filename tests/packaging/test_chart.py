"""The Helm chart's values reach the gateway: each test renders values through Helm's own
library (tests/packaging/chart.py) and hands the rendered environment to the gateway's own
config loader. The rules every value set keeps are in test_chart_rules.py; the alerts, the
dashboard and the Ingress in test_chart_observability.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.packaging.chart import (
    RENDERS,
    ROOT,
    SAMPLE,
    container,
    environment,
    objects,
    pod_spec,
    render,
    settings_of,
    with_sample,
)

pytestmark = RENDERS


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


def test_minimal_environment_is_accepted_by_the_gateway(sample: dict[str, Any]) -> None:
    gw = settings_of(sample, "sbgate")
    (pair,) = gw.pairs
    assert pair.primary.endpoint_host == "contoso.servicebus.windows.net"
    assert pair.secondary is not None
    assert pair.secondary.endpoint_host == "contoso-dr.servicebus.windows.net"
    assert gw.syphon.enabled is True
    assert gw.shutdown.drain_delay == 5
    assert gw.shutdown.shutdown_timeout == 20
    assert gw.redis_url is None
    secret = objects(sample, "Secret")["sbgate"]
    assert set(secret["data"]) == {
        "primary-connection-string",
        "secondary-connection-string",
        "auth-rules",
    }
    assert objects(sample, "PodDisruptionBudget")  # two replicas by default


def test_probes_prestop_and_grace_period(sample: dict[str, Any]) -> None:
    c = container(sample, "sbgate")
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probe"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probe"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    # preStop 5 + drain 5 + shutdown 20 + margin 10
    assert pod_spec(sample, "sbgate")["terminationGracePeriodSeconds"] == 40


def test_grace_period_follows_the_settings() -> None:
    result = render(
        with_sample({"config": {"drainDelay": 2.5, "shutdownTimeout": 45}, "preStop": {}})
    )
    assert pod_spec(result, "sbgate")["terminationGracePeriodSeconds"] == 63  # ceil(62.5)


def test_too_short_grace_period_is_refused() -> None:
    result = render(with_sample({"terminationGracePeriodSeconds": 30}))
    assert "terminationGracePeriodSeconds=30 is shorter than" in result["error"]
    assert "= 40" in result["error"]


def test_probes_are_overridable() -> None:
    custom = {"tcpSocket": {"port": "http"}, "periodSeconds": 7}
    result = render(
        with_sample({"customLivenessProbe": custom, "readinessProbe": {"enabled": False}})
    )
    c = container(result, "sbgate")
    assert c["livenessProbe"] == custom
    assert "readinessProbe" not in c


def test_large_numbers_are_not_written_in_exponent_notation() -> None:
    # Premium-sized messages; the batch limit must follow (config.extraEnv carries it).
    premium = {"maxMessageBytes": 1048576, "extraEnv": {"SBGATE_MAX_BATCH_BYTES": 1048576}}
    result = render(with_sample({"config": premium}))
    env = environment(result, "sbgate")
    assert env["SBGATE_MAX_MESSAGE_BYTES"] == "1048576"
    assert env["SBGATE_MAX_BATCH_BYTES"] == "1048576"
    assert settings_of(result, "sbgate").limits.max_message_bytes == 1048576


def test_max_token_lifetime_reaches_the_gateway(sample: dict[str, Any]) -> None:
    assert "SBGATE_AUTH_MAX_TOKEN_LIFETIME" not in environment(sample, "sbgate")
    result = render(with_sample({"auth": {"maxTokenLifetime": 3600}}))
    assert environment(result, "sbgate")["SBGATE_AUTH_MAX_TOKEN_LIFETIME"] == "3600"
    assert settings_of(result, "sbgate").auth_max_token_lifetime == 3600


def test_token_cache_size_reaches_the_gateway(sample: dict[str, Any]) -> None:
    assert "SBGATE_AUTH_TOKEN_CACHE_SIZE" not in environment(sample, "sbgate")
    result = render(with_sample({"auth": {"tokenCacheSize": 0}}))
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
    result = render(with_sample({"config": {"file": toml}}))
    assert objects(result, "ConfigMap")["sbgate-file"]["data"]["config.toml"] == toml
    assert environment(result, "sbgate")["SBGATE_CONFIG"] == "/etc/sbgate/config.toml"
    etc = next(v for v in pod_spec(result, "sbgate")["volumes"] if v["name"] == "etc-sbgate")
    sources = etc["projected"]["sources"]
    assert sources[0]["configMap"]["items"] == [{"key": "config.toml", "path": "config.toml"}]
    assert sources[1]["secret"]["items"] == [{"key": "auth-rules", "path": "auth-rules"}]


def test_schema_rejects_unknown_values() -> None:
    assert "additional properties" in render(with_sample({"replicas": 3}))["error"]
    assert "logFormat" in render(with_sample({"config": {"logFormat": "xml"}}))["error"]


def test_credential_follows_workload_identity_or_the_value(sample: dict[str, Any]) -> None:
    assert "SBGATE_AZURE_CREDENTIAL" not in environment(sample, "sbgate")
    by_name = {
        "serviceBus": {
            "primary": {"connectionString": "", "namespace": "contoso.servicebus.windows.net"},
            "secondary": {"connectionString": ""},
            "credential": "managed",
            "managedIdentityClientId": "11111111-2222-3333-4444-555555555555",
        }
    }
    result = render(with_sample(by_name))
    settings = settings_of(result, "sbgate")
    assert settings.azure_credential == "managed"
    assert settings.azure_client_id == "11111111-2222-3333-4444-555555555555"
    bad = render(with_sample({"serviceBus": {"credential": "cli"}}))
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
    assert "CronJob" not in {d["kind"] for d in render(SAMPLE)["manifests"]}  # off by default
    assert "audit.args" in render(with_sample({"audit": {"enabled": True}}))["error"]


# --- the README's examples -----------------------------------------------------------------


def readme_examples() -> list[str]:
    """The YAML blocks of the README's "Deploy on Kubernetes" section (chart values)."""
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


def test_redis_mode_credential_and_ca_reach_the_gateway(sample: dict[str, Any]) -> None:
    env = environment(sample, "sbgate")
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
    result = render(with_sample(azure))
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
        with_sample({"redis": {"url": "rediss://r:6380/0", "ca": {"secretName": "s"}}})
    )
    ca = next(v for v in pod_spec(from_secret, "sbgate")["volumes"] if v["name"] == "redis-ca")
    assert ca["secret"]["secretName"] == "s"
    assert settings_of(from_secret, "sbgate").redis_mode == "standalone"
    assert "/redis/mode" in render(with_sample({"redis": {"mode": "ring"}}))["error"]
    no_identity = with_sample({"redis": {"url": "rediss://r:6380/0", "credential": "workload"}})
    assert "workloadIdentity.enabled" in render(no_identity)["error"]
    plain = with_sample({"redis": {"url": "redis://r:6379/0", "mode": "sentinel"}})
    assert "redis+sentinel://" in render(plain)["error"]
