"""The optional alerts (a PrometheusRule), the Grafana dashboard and the Ingress: rendered from
their values, sound by the Prometheus Operator's CRD and Prometheus' own PromQL grammar,
reading only series the gateway exposes, and firing under promtool when they should."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import GatewayFactory
from tests.packaging.chart import (
    CHART_VALUES,
    DASHBOARD,
    RENDERS,
    ROOT,
    VALUE_SETS,
    coalesce,
    manifests,
    metric_names,
    objects,
    render,
    settings_of,
    with_sample,
)

pytestmark = RENDERS

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


def rule_queries(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Every PrometheusRule expression, by `<rule object>/<alert or record>`."""
    return {
        f"{d['metadata']['name']}/{r.get('alert') or r.get('record')}": str(r["expr"])
        for d in docs
        if d["kind"] == "PrometheusRule"
        for g in d["spec"]["groups"]
        for r in g["rules"]
    }


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those in a collapsed row included."""
    panels = list(dashboard.get("panels", []))
    for p in panels:
        panels.extend(p.get("panels", []))
    return panels


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every PromQL query of a Grafana dashboard (panels, rows' panels, query variables), with
    Grafana's variables replaced, by `panel <title> <refId>` or `variable <name>`."""
    out: dict[str, str] = {}
    for p in dashboard_panels(dashboard):
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


def dashboards(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The dashboards the ConfigMaps carry, by `ConfigMap <name> <key>`."""
    return {
        f"ConfigMap {cm['metadata']['name']} {key}": json.loads(text)
        for cm in docs
        if cm["kind"] == "ConfigMap"
        for key, text in cm.get("data", {}).items()
        if key.endswith(".json")
    }


def dashboard_findings(dashboard: dict[str, Any], where: str) -> list[str]:
    """A dashboard anyone can import: a Prometheus data source variable that every panel and
    query uses, unique panel ids, a query in every panel."""
    errors: list[str] = []
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append(f"{where}: no Prometheus data source variable `datasource`")
    panels = dashboard_panels(dashboard)
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
    return errors


def observability_findings(docs: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the PrometheusRule (CRD schema, PromQL that parses, every alert
    annotated), the dashboard ConfigMap (the chart's file, a sound dashboard) and the Ingress
    (to a port of a Service of the release)."""
    errors: list[str] = []
    queries: dict[str, str] = {}
    for d in (d for d in docs if d["kind"] == "PrometheusRule"):
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
        queries.update({f"{where}: {k}": v for k, v in rule_queries([d]).items()})
    shipped = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for where, dashboard in dashboards(docs).items():
        if dashboard != shipped:
            errors.append(f"{where}: differs from {DASHBOARD.relative_to(ROOT)}")
        errors += dashboard_findings(dashboard, where)
        queries.update({f"{where}: {k}": v for k, v in dashboard_queries(dashboard).items()})
    for name, names in metric_names(queries).items():
        if isinstance(names, dict):
            errors.append(f"{name}: {names['error']}: {queries[name]}")
    ports = {
        s["metadata"]["name"]: {p["name"] for p in s["spec"]["ports"]}
        for s in docs
        if s["kind"] == "Service"
    }
    for ing in (d for d in docs if d["kind"] == "Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                svc = path["backend"]["service"]
                if svc["port"].get("name") not in ports.get(svc["name"], set()):
                    where = f"Ingress {ing['metadata']['name']}"
                    errors.append(f"{where}: {path['path']} goes to no Service port: {svc}")
    return errors


def queried_series(production: dict[str, Any]) -> dict[str, list[str]]:
    """Metric names read by each alert (as rendered) and each dashboard query."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = {
        **{f"alert {k}": v for k, v in rule_queries(manifests(production)).items()},
        **{f"dashboard {k}": v for k, v in dashboard_queries(dashboard).items()},
    }
    names: dict[str, list[str]] = metric_names(queries)
    return names


@pytest.mark.parametrize("name", ["alerts, dashboard, ingress", "production"])
def test_alerts_dashboard_and_ingress_are_sound(name: str) -> None:
    docs = manifests(render(VALUE_SETS[name]))
    assert {"PrometheusRule", "Ingress"} <= {d["kind"] for d in docs}
    assert dashboards(docs)
    assert observability_findings(docs) == []


ALERTS = {
    "SbgateEntityFailedOver",
    "SbgateEntityMissing",
    "SbgateBacklogGrowing",
    "SbgateBacklogMessageTooOld",
    "SbgateLedgerEventsDropped",
    "SbgateRedisDisconnected",
    "SbgateRedisDataLost",
    "SbgateHighErrorRatio",
    "SbgateAdmissionSaturated",
    "SbgateShedding",
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


def test_alerts_dashboard_and_ingress_are_off_by_default(sample: dict[str, Any]) -> None:
    kinds = {d["kind"] for d in manifests(sample)}
    assert not kinds & {"PrometheusRule", "Ingress"}
    assert set(objects(sample, "ConfigMap")) == {"sbgate"}  # no dashboard


def test_alerts_dashboard_and_ingress_turned_on_with_their_defaults() -> None:
    values = {
        "config": {"publicHosts": ["sbgate.contoso.com"]},
        "ingress": {"enabled": True},
        "metrics": {"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
    }
    result = render(with_sample(values))
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
    result = render(with_sample({"metrics": values}))
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
        with_sample({"metrics": {"prometheusRule": {"enabled": True, "alerts": every_one_off}}})
    )
    (rule,) = objects(empty, "PrometheusRule").values()
    assert rule["spec"]["groups"][0]["rules"] == []


def _alert_keys() -> list[str]:
    return list(CHART_VALUES["metrics"]["prometheusRule"]["alerts"])


def test_production_dashboard(production: dict[str, Any]) -> None:
    cm = objects(production, "ConfigMap")["sbgate-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert cm["metadata"]["annotations"]["k8s-sidecar-target-directory"] == "Messaging"
    # The file in the chart, as it is: importable by hand too.
    assert json.loads(cm["data"]["sbgate.json"]) == json.loads(
        DASHBOARD.read_text(encoding="utf-8")
    )


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
    cm = objects(render(with_sample({"metrics": values})), "ConfigMap")["sbgate-dashboard"]
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
    result = render(with_sample(values))
    ing = objects(result, "Ingress")["sbgate"]
    assert "ingressClassName" not in ing["spec"]  # the cluster's default class
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "gw.contoso.com"
    assert [p["path"] for p in rule["http"]["paths"]] == ["/", "/admin"]
    annotations = ing["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span"] == "false"
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "4194304"
    assert settings_of(result, "sbgate").limits.max_body_bytes == 4194304
    plain = render(with_sample(values, {"ingress": {"nginxAnnotations": False}}))
    assert objects(plain, "Ingress")["sbgate"]["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span": "false"
    }


def test_ingress_needs_a_host() -> None:
    error = render(with_sample({"ingress": {"enabled": True}}))["error"]
    assert "ingress.hosts" in error


def test_a_low_keepalive_behind_the_ingress_is_warned_about() -> None:
    values = {"config": {"publicHosts": ["gw.contoso.com"]}, "ingress": {"enabled": True}}
    assert "KEEPALIVE" not in render(with_sample(values))["notes"]
    low = coalesce(values, {"config": {"extraEnv": {"SBGATE_KEEPALIVE_TIMEOUT": "30"}}})
    assert "SBGATE_KEEPALIVE_TIMEOUT=30 is not above" in render(with_sample(low))["notes"]


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

    sound, found, schema = (
        observability_findings(docs) for docs in (production["manifests"], broken, unknown)
    )
    assert sound == []
    assert len(found) == 5, found
    assert any("SbgateEntityFailedOver: unexpected right parenthesis" in f for f in found)
    assert any("SbgateBacklogGrowing has no runbook" in f for f in found)
    assert any("differs from helm/sbgate/dashboards/sbgate.json" in f for f in found)
    assert any("does not use ${datasource}" in f for f in found)
    assert any("/orders/messages goes to no Service port" in f for f in found)
    assert len(schema) == 1 and "ten minutes" in schema[0]


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
    gateway: GatewayFactory, production: dict[str, Any]
) -> None:
    # A gateway that fails over and runs the syphon: every metric it can have is registered.
    env = {"SBGATE_ENABLE_FAILOVER": "true", "SBGATE_ENABLE_SYPHON": "true"}
    gw = await gateway(env)
    exposed = exposed_series(await (await gw.get("/metrics")).text())
    queried = queried_series(production)
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
    "a configured entity missing at the primary for 5 minutes": (
        [
            series("sbgate_entity_missing", 'pod="a", entity="payments"', "1x20"),
            series("sbgate_entity_missing", 'pod="a", entity="orders"', "0x20"),
        ],
        [
            expect("3m", "SbgateEntityMissing"),
            expect("7m", "SbgateEntityMissing", {"entity": "payments", "severity": "warning"}),
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
    "Redis lost its data under one pod's connection once": (
        [
            series("sbgate_redis_data_lost_total", 'pod="a"', "0 0 0 1x10"),
            series("sbgate_redis_data_lost_total", 'pod="b"', "0x13"),
        ],
        [
            expect("2m", "SbgateRedisDataLost"),
            expect("4m", "SbgateRedisDataLost", {"pod": "a", "severity": "warning"}),
            expect("10m", "SbgateRedisDataLost"),
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
    "one pod's listener closed a tenth of the time, the other sheds nothing": (
        [
            series(
                "sbgate_http_listener_paused_seconds_total", 'pod="a", reason="loop_lag"', "0+6x20"
            ),
            series(
                "sbgate_http_listener_paused_seconds_total", 'pod="b", reason="loop_lag"', "0x20"
            ),
            series("sbgate_http_shed_total", 'pod="b", reason="head_wait"', "0x20"),
        ],
        [
            expect("5m", "SbgateShedding"),
            expect("15m", "SbgateShedding", {"pod": "a", "severity": "warning"}),
        ],
    ),
    "a pod answers 503 overloaded 2 times a second": (
        [series("sbgate_http_shed_total", 'pod="b", reason="in_progress"', "0+120x20")],
        [expect("15m", "SbgateShedding", {"pod": "b", "severity": "warning"})],
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
