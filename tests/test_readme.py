"""The README documents every setting and every metric the code has."""

from __future__ import annotations

from pathlib import Path

from gateway import config
from gateway.metrics import Metrics

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def accepted_env_vars() -> set[str]:
    names = {f"SBGATE_{k.upper()}" for k in config._TOP_FIELDS}
    names |= {
        f"SBGATE_{f.upper()}"
        for _, fields in config._SECTION_FIELDS.values()
        for f in fields
        if f != "enabled"  # ambiguous across sections: set through the aliases below
    }
    names |= {f"SBGATE_{k}" for k in config._ENV_ALIASES}
    names |= {
        f"SBGATE_{role}_{field}"
        for role in ("PRIMARY", "SECONDARY")
        for field in config._NS_ENV_FIELDS
    }
    return names | {"SBGATE_ENTITIES", "SBGATE_CONFIG"}


def test_every_setting_is_in_the_readme():
    missing = sorted(n for n in accepted_env_vars() if n not in README)
    assert not missing, f"settings missing from the README: {missing}"


def test_every_metric_is_in_the_readme():
    registry = Metrics().registry
    names = {m.name for c in registry._collector_to_names for m in c.collect()}  # type: ignore[attr-defined]
    missing = sorted(n for n in names if n not in README)
    assert not missing, f"metrics missing from the README: {missing}"
