"""sbamqp stays pure: it imports only the standard library and itself (no proton, no
aiohttp, no azure, nothing of the gateway), so both the gateway and the local broker can
build on it and the image needs nothing more for it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "sbamqp"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_sbamqp_imports_only_the_standard_library() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 8
    foreign = {
        (path.name, name)
        for path in modules
        for name in _imports(path)
        if name not in sys.stdlib_module_names and name not in ("sbamqp", "__future__")
    }
    assert not foreign, f"sbamqp must stay dependency-free: {sorted(foreign)}"
