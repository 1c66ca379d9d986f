"""The Grafana dashboard shipped in the chart (helm/sbgate/dashboards/sbgate.json) loads and
shows what an operator looks for first. That each query parses and reads series the gateway
exposes is checked in tests/packaging/test_chart_observability.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "sbgate" / "dashboards" / "sbgate.json"


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = list(dashboard["panels"])
    for p in dashboard["panels"]:
        out.extend(p.get("panels", []))
    return [p for p in out if p["type"] != "row"]


def queries(panel: dict[str, Any]) -> str:
    return "\n".join(t["expr"] for t in panel["targets"])


def test_the_dashboard_loads_and_can_be_imported_anywhere() -> None:
    dashboard = load()
    assert dashboard["uid"] == "sbgate-overview"
    assert "id" not in dashboard  # Grafana assigns it; a fixed one collides on import
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job", "entity"} <= set(variables)
    for p in panels(dashboard):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # Scoped by the variables, so one Grafana can show several releases apart.
            assert 'namespace=~"$namespace"' in t["expr"], (p["title"], t["expr"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_panels_the_operators_asked_for() -> None:
    by_title = {p["title"]: p for p in panels(load())}
    outcome = queries(by_title["Requests by outcome"])
    for status in ('status="201"', 'status="202"', 'status=~"4.."', 'status=~"5.."'):
        assert status in outcome
    assert "route" in queries(by_title["Messages stored by route and entity"])
    latency = queries(by_title["Request latency"])
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "sbgate_broker_batch_messages_bucket" in queries(by_title["Broker batch size"])
    assert "sbgate_failover_state" in queries(by_title["Failover state per entity"])
    assert "sbgate_failover_status" in queries(by_title["Entities not healthy now"])
    assert "sbgate_backlog_messages" in queries(by_title["Backlog depth per queue"])
    assert "sbgate_backlog_dwell_seconds_bucket" in queries(by_title["Backlog dwell (202 → home)"])
    assert "sbgate_syphon_moved_total" in queries(by_title["Syphon moves"])
    assert "sbgate_redis_connected" in queries(by_title["Redis per pod"])


def test_states_are_shown_as_words() -> None:
    by_title = {p["title"]: p for p in panels(load())}
    for title, words in (
        ("Failover state per entity", {"healthy", "failing", "failed over"}),
        ("Redis per pod", {"connected", "disconnected"}),
    ):
        (mapping,) = by_title[title]["fieldConfig"]["defaults"]["mappings"]
        assert {m["text"] for m in mapping["options"].values()} == words


def test_the_grafana_variables_in_queries_are_the_dashboards_own() -> None:
    dashboard = load()
    declared = {v["name"] for v in dashboard["templating"]["list"]}
    builtin = {"__rate_interval", "__interval", "__range"}
    used = {
        m
        for p in panels(dashboard)
        for t in p["targets"]
        for m in re.findall(r"\$\{?(\w+)", t["expr"])
    }
    assert used <= declared | builtin, used - declared - builtin
