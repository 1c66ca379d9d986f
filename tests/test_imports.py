"""Every module of the product imports alone (as aiohttp's test_circular_imports does).

A cycle between layers stays hidden while some other module happens to be imported first;
importing each module into an interpreter where none of ours is loaded yet brings it out. One
child interpreter does them all (our packages are dropped from `sys.modules` between
modules; third-party ones stay, they cannot take part in our cycles), so this stays fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "sblocal", "pipeline", "sbamqp")

_CHILD = r"""
import importlib, sys, traceback
ours = tuple(sys.argv[1].split(","))
failed = []
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + "\n" + traceback.format_exc(limit=-3))
print("\n\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":  # runs the program; its imports are checked below
                continue
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


@pytest.mark.integration
def test_every_module_imports_alone() -> None:
    modules = _modules()
    assert len(modules) > 50 and "gateway.core.dispatcher" in modules
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, ",".join(PACKAGES), *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"modules that do not import alone:\n{done.stdout}{done.stderr}"
