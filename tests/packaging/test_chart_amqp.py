"""The chart's AMQP edge (docs/amqp.md): its own Service, the certificate Secret mounted, the
port open in the NetworkPolicy, the settings reaching the gateway; probes unaffected."""

from __future__ import annotations

from typing import Any

import pytest

from tests.packaging.chart import (
    RENDERS,
    container,
    manifests,
    objects,
    pod_spec,
    render,
    settings_of,
    validate,
    with_sample,
)

pytestmark = RENDERS

AMQP = {"amqp": {"enabled": True, "tls": {"existingSecret": "gw-tls"}}}


@pytest.fixture(scope="module")
def amqp() -> dict[str, Any]:
    return render(with_sample(AMQP, {"networkPolicy": {"enabled": True}}))


def test_the_gateway_serves_amqp_over_tls_with_the_mounted_certificate(
    amqp: dict[str, Any],
) -> None:
    gw = settings_of(amqp, "sbgate").amqp
    assert gw.port == 5671 and gw.plain_port == 0
    assert gw.tls_cert_file == "/etc/sbgate-amqp-tls/tls.crt"
    assert gw.tls_key_file == "/etc/sbgate-amqp-tls/tls.key"
    assert gw.max_connection_age == 900
    c = container(amqp, "sbgate")
    assert {"name": "amqp", "containerPort": 5671, "protocol": "TCP"} in c["ports"]
    assert {"name": "amqp-tls", "mountPath": "/etc/sbgate-amqp-tls", "readOnly": True} in c[
        "volumeMounts"
    ]
    volumes = {v["name"]: v for v in pod_spec(amqp, "sbgate")["volumes"]}
    assert volumes["amqp-tls"]["secret"]["secretName"] == "gw-tls"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probe"}


def test_the_syphon_does_not_serve_amqp() -> None:
    result = render(with_sample(AMQP, {"syphon": {"enabled": True}}))
    assert not settings_of(result, "sbgate-syphon").amqp.enabled
    assert "amqp-tls" not in {v["name"] for v in pod_spec(result, "sbgate-syphon")["volumes"]}


def test_its_own_service_and_network_policy_rule(amqp: dict[str, Any]) -> None:
    svc = objects(amqp, "Service")["sbgate-amqp"]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [
        {"name": "amqps", "port": 5671, "targetPort": "amqp", "protocol": "TCP"}
    ]
    np = objects(amqp, "NetworkPolicy")["sbgate"]
    rules = [r for r in np["spec"]["ingress"] if {"port": 5671, "protocol": "TCP"} in r["ports"]]
    assert rules and "from" not in rules[0]


def test_off_by_default() -> None:
    result = render(with_sample())
    assert "sbgate-amqp" not in objects(result, "Service")
    assert not settings_of(result, "sbgate").amqp.enabled


def test_enabled_without_a_certificate_is_refused() -> None:
    error = render(with_sample({"amqp": {"enabled": True}}))["error"]
    assert "amqp.tls.existingSecret" in error


@pytest.mark.parametrize("version", ["1.25.0", "1.37.0"])
def test_the_manifests_are_valid_kubernetes_objects(amqp: dict[str, Any], version: str) -> None:
    found = validate(manifests(render(with_sample(AMQP), kube_version=version)), version)
    assert found["errors"] == []
