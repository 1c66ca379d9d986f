"""values.yaml is documented, typed and read: every value has a `## @param` line (bitnami's
readme-generator-for-helm checks it and writes the README's tables from them), a schema in
values.schema.json, and every `.Values.x.y` a template reads exists (Helm's non-strict
rendering would print a missing key as empty)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.packaging.chart import CHART, CHART_VALUES, ROOT

SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
# Installed by scripts/lint-packaging.sh (pinned in scripts/node/package-lock.json).
README_GENERATOR = ROOT / ".tools" / "node_modules" / ".bin" / "readme-generator"
_PARAM = re.compile(r"^\s*## @param (\S+)(?:\s+\[[^\]]*\])?(.*)$")


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
        node = (node or {}).get("properties", {}).get(part)
        if node is None:
            return None
    return node


def test_every_param_has_a_description() -> None:
    text = (CHART / "values.yaml").read_text(encoding="utf-8")
    params = [m for m in map(_PARAM.match, text.splitlines()) if m]
    assert len(params) > 100
    assert [m.group(1) for m in params if not m.group(2).strip()] == []


def test_every_value_has_a_schema_and_matches_it() -> None:
    assert [leaf for leaf in leaf_paths(CHART_VALUES) if schema_at(SCHEMA, leaf) is None] == []
    jsonschema.validate(CHART_VALUES, SCHEMA)


def test_templates_read_only_values_that_exist() -> None:
    missing = [
        f"{tpl.name}: .Values{ref}"
        for tpl in sorted((CHART / "templates").glob("*"))
        for ref in re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", tpl.read_text("utf-8"))
        if not has_path(CHART_VALUES, ref.lstrip("."))
    ]
    assert missing == []


def generate_readme(values: str, readme: str, tmp: Path) -> str:
    """The README with its `## Parameters` tables regenerated from `values`."""
    (tmp / "values.yaml").write_text(values, encoding="utf-8")
    (tmp / "README.md").write_text(readme, encoding="utf-8")
    proc = subprocess.run(
        [str(README_GENERATOR), "--values", "values.yaml", "--readme", "README.md"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # it lists values without @param
    return (tmp / "README.md").read_text(encoding="utf-8")


@pytest.mark.integration  # a node subprocess
@pytest.mark.skipif(
    shutil.which("node") is None or not README_GENERATOR.exists(),
    reason="no readme-generator-for-helm: run scripts/lint-packaging.sh --install-only",
)
def test_the_readme_tables_are_generated_from_values_yaml(tmp_path: Path) -> None:
    values = (CHART / "values.yaml").read_text(encoding="utf-8")
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    fix = "make chart-readme"
    assert generate_readme(values, readme, tmp_path) == readme, f"stale tables: run `{fix}`"
    # The check has teeth: a changed default shows.
    changed = values.replace("\n  repository: sbgate\n", "\n  repository: sbgate-next\n", 1)
    assert changed != values
    assert "`sbgate-next`" in generate_readme(changed, readme, tmp_path)
