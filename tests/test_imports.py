"""Every module of the product imports alone (as aiohttp's test_circular_imports does).

A cycle between layers stays hidden while some other module happens to be imported first;
importing each module into an interpreter where none of ours is loaded yet brings it out. One
child interpreter does them all (our packages are dropped from `sys.modules` between
modules; third-party ones stay, they cannot take part in our cycles), so this stays fast.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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


# -- the layer map -------------------------------------------------------------------------
#
# Which of our packages each layer may import, and which third-party libraries. A module's
# layer is its longest prefix in `LAYERS`; every import counts, those inside functions and
# under TYPE_CHECKING too (a type-only import is still the wrong way round). `sbamqp` and
# `gateway.amqp` are held before they exist, so their first commit already obeys the map.

# Leaf modules every layer of the gateway may import: the version, errors as data, secrets,
# the entity-path grammar, the task-lifetime kit and the listeners' batch accept.
_BASE = (
    "gateway",
    "gateway.accepting",
    "gateway.errors",
    "gateway.secret",
    "gateway.entitypath",
    "gateway.lifetimes",
)
# Libraries that are data formats, not layers: any gateway layer may use them.
_ANY = ("orjson",)


@dataclass(frozen=True)
class Layer:
    ours: tuple[str, ...] = ()  # our layers it may import (besides itself)
    third: tuple[str, ...] = ()  # third-party imports it may make: "redis", "azure.core"
    private: tuple[str, ...] = ()  # of those, the libraries whose `_private` names it may use


_GATEWAY_ALL = (
    *_BASE,
    "gateway.amqp",
    "gateway.audit",
    "gateway.auth",
    "gateway.config",
    "gateway.core",
    "gateway.embedded",
    "gateway.ingest",
    "gateway.ledger",
    "gateway.logs",
    "gateway.metrics",
    "gateway.servicebus",
    "gateway.state",
    "gateway.syphon",
    "gateway.tracing",
    "gateway.web",
)

LAYERS: dict[str, Layer] = {
    # the leaves: nothing of ours but each other
    "gateway": Layer(),  # the package itself: its version
    "gateway.errors": Layer(ours=_BASE),
    "gateway.secret": Layer(ours=_BASE),
    "gateway.entitypath": Layer(ours=_BASE),
    "gateway.lifetimes": Layer(ours=_BASE),
    "gateway.accepting": Layer(ours=_BASE),
    # settings: read once, validated; the SDK only to parse a connection string
    "gateway.config": Layer(ours=_BASE, third=("azure.servicebus",)),
    "gateway.auth": Layer(ours=_BASE),
    "gateway.ledger": Layer(ours=_BASE, third=_ANY),
    # the engine: no SDK, no HTTP, no Redis (its ports are in gateway.core.ports)
    "gateway.core": Layer(ours=(*_BASE, "gateway.config", "gateway.ledger", "gateway.state")),
    "gateway.state": Layer(ours=(*_BASE, "gateway.config"), third=(*_ANY, "redis", "azure.core")),
    "gateway.syphon": Layer(
        ours=(*_BASE, "gateway.config", "gateway.core", "gateway.ledger", "gateway.state")
    ),
    # the Service Bus adapter: the only layer that drives the SDK, on its public API
    "gateway.servicebus": Layer(
        ours=(*_BASE, "gateway.config", "gateway.core"),
        third=(*_ANY, "azure.servicebus", "azure.core", "azure.identity", "certifi"),
    ),
    # the seam: the one place that uses the SDK's private names (docs/design.md)
    "gateway.servicebus.internals": Layer(
        ours=(*_BASE, "gateway.config", "gateway.core", "gateway.servicebus"),
        third=(*_ANY, "azure.servicebus", "azure.core", "certifi"),
        private=("azure.servicebus",),
    ),
    "gateway.tracing": Layer(
        ours=(*_BASE, "gateway.config", "gateway.core"), third=("aiohttp", "opentelemetry")
    ),
    "gateway.logs": Layer(ours=(*_BASE, "gateway.tracing"), third=_ANY),
    # the send request every edge makes (lookup, rights, sizes, submit, record): no wire format
    "gateway.ingest": Layer(
        ours=(
            *_BASE,
            "gateway.auth",
            "gateway.config",
            "gateway.core",
            "gateway.ledger",
            "gateway.logs",
            "gateway.tracing",
        ),
    ),
    # the HTTP edge: never the app, the metrics or an adapter
    "gateway.web": Layer(
        ours=(
            *_BASE,
            "gateway.ingest",
            "gateway.auth",
            "gateway.config",
            "gateway.core",
            "gateway.ledger",
            "gateway.logs",
            "gateway.state",
            "gateway.tracing",
        ),
        third=(*_ANY, "aiohttp", "multidict", "yarl"),
        private=("aiohttp",),
    ),
    # the metrics implement every layer's observer interface
    "gateway.metrics": Layer(
        ours=(
            *_BASE,
            "gateway.core",
            "gateway.ingest",
            "gateway.ledger",
            "gateway.state",
            "gateway.syphon",
            "gateway.web",
        ),
        third=("prometheus_client",),
    ),
    "gateway.embedded": Layer(ours=(*_BASE, "gateway.config"), third=_ANY),
    # `gateway drain`, the audit's receiver: the SDK's public API, the process's credential
    "gateway.audit": Layer(
        ours=(*_BASE, "gateway.core", "gateway.servicebus"),
        third=(*_ANY, "azure.servicebus", "azure.core"),
    ),
    # only the app factory and the command line know the concrete adapters
    "gateway.app": Layer(ours=_GATEWAY_ALL, third=(*_ANY, "aiohttp", "prometheus_client")),
    "gateway.cli": Layer(
        ours=(*_GATEWAY_ALL, "gateway.app", "pipeline"), third=(*_ANY, "aiohttp", "uvloop")
    ),
    "gateway.__main__": Layer(ours=("gateway.cli",)),
    # the AMQP edge (held for it): the engine, auth and settings; no HTTP server, no SDK
    "gateway.amqp": Layer(
        ours=(
            *_BASE,
            "sbamqp",
            "gateway.core",
            "gateway.auth",
            "gateway.config",
            "gateway.ingest",
        ),
        third=_ANY,
    ),
    # an AMQP 1.0 codec and framing of our own: the standard library only
    "sbamqp": Layer(),
    # the local broker stands alone: none of the gateway (tests see it as the real thing)
    # (cproton_ffi is proton's own C binding, part of python-qpid-proton)
    "sblocal": Layer(
        third=("aiohttp", "cryptography", "proton", "cproton_ffi", "orjson"),
        private=("proton",),
    ),
    "pipeline": Layer(third=("pyspark", "orjson", "matplotlib")),
}
OURS = ("gateway", "sblocal", "pipeline", "sbamqp")
# Libraries whose import name is two levels deep: the rules name them whole.
_TWO_LEVEL = ("azure",)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def _library(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in _TWO_LEVEL else parts[0]


def _imports(module: str, source: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) for every import statement in `source`."""
    package = module.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: against the module's own package
                base = package[: len(package) - node.level]
                target = ".".join([*base, target] if target else base)
            yield node.lineno, target, [alias.name for alias in node.names]


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports of `module` (whose text is `source`) that its layer may not make."""
    layer_name = layer_of(module)
    if layer_name is None:
        return [f"{module}: no layer in LAYERS holds it"]
    layer = LAYERS[layer_name]
    found = []
    # a package's relative imports resolve against the package itself
    as_module = f"{module}.__init__" if is_package else module
    for line, target, names in _imports(as_module, source):
        top = target.split(".")[0]
        if top == "__future__" or top in sys.stdlib_module_names:
            continue
        where = f"{module}:{line} imports {target}"
        if top in OURS:
            # `from gateway import x` names the modules it imports
            targets = [f"{target}.{n}" for n in names] if target == top and names else [target]
            for each in targets:
                dest = layer_of(each)
                if dest is None or (dest != layer_name and dest not in layer.ours):
                    found.append(f"{where}: {layer_name} may not import {dest or each}")
            continue
        library = _library(target)
        if library not in layer.third:
            found.append(f"{where}: {layer_name} may not use {library}")
            continue
        private = any(p.startswith("_") for p in target.split(".")) or any(
            n.startswith("_") for n in names
        )
        if private and library not in layer.private:
            found.append(f"{where}: {layer_name} may not use {library}'s private names")
    return found


def _sources() -> Iterator[tuple[str, Path]]:
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


@pytest.mark.unit
def test_every_import_follows_the_layer_map() -> None:
    found = []
    for module, path in _sources():
        found += violations(module, path.read_text(), is_package=path.name == "__init__.py")
    assert not found, "imports against the layer map:\n" + "\n".join(found)


@pytest.mark.unit
def test_the_layer_map_names_only_layers() -> None:
    """Every layer a rule allows is itself a rule (a typo would allow nothing, silently)."""
    for name, layer in LAYERS.items():
        for other in layer.ours:
            assert other in LAYERS, f"{name} allows {other}, which is not a layer"
        assert set(layer.private) <= set(layer.third), name
    # every package of ours that exists is mapped
    for module, _path in _sources():
        assert layer_of(module) is not None, module


# The map must refuse each wrong-way import this codebase once had, and each library outside
# its layer: the rule is shown to fail on a synthetic module of that layer.
WRONG_WAY = [
    ("gateway.config.loading", "from gateway.core.entities import validate_entity_path"),
    ("gateway.web.handlers", "from gateway.metrics import Metrics"),
    ("gateway.web.runner", "from gateway.app import LOOP_LAG"),
    ("gateway.servicebus.receiver", "from gateway.syphon.ports import Received"),
    ("gateway.web.x", "from gateway import app"),
    ("gateway.web.x", "from .. import metrics"),
    ("gateway.core.x", "import aiohttp"),
    ("gateway.core.x", "from redis.asyncio import Redis"),
    ("gateway.core.x", "from azure.servicebus import ServiceBusMessage"),
    ("gateway.syphon.x", "import azure.servicebus.aio"),
    ("gateway.web.x", "from azure.servicebus import ServiceBusMessage"),
    ("gateway.state.x", "from aiohttp import web"),
    ("gateway.servicebus.x", "import redis"),
    ("gateway.servicebus.x", "from proton import Message"),
    ("gateway.servicebus.x", "from aiohttp import web"),
    ("gateway.config.x", "from azure.servicebus._pyamqp import error"),
    ("gateway.servicebus.client", "from azure.servicebus._pyamqp.aio import Connection"),
    ("gateway.servicebus.receiver", "from azure.servicebus.aio._base_handler_async import X"),
    ("gateway.servicebus.x", "from azure.servicebus import _common"),
    ("gateway.core.x", "from gateway.servicebus.internals import encode"),
    ("gateway.web.x", "from gateway.servicebus.client import SdkNamespaceClient"),
    ("gateway.auth.x", "from gateway.core.entities import EntityCatalog"),
    ("gateway.tracing.x", "from proton._reactor import Acceptor"),
    ("sblocal.x", "from gateway.errors import GatewayError"),
    ("sblocal.x", "from azure.servicebus import ServiceBusClient"),
    ("pipeline.x", "from gateway.config import Settings"),
    ("sbamqp.x", "import aiohttp"),
    ("sbamqp.x", "from gateway.core.message import OutboundMessage"),
    ("gateway.amqp.x", "from aiohttp import web"),
    ("gateway.amqp.x", "from azure.servicebus import ServiceBusMessage"),
    ("gateway.amqp.x", "from gateway.app import create_app"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("module", "line"), WRONG_WAY)
def test_the_layer_map_refuses(module: str, line: str) -> None:
    assert violations(module, line), f"{module} may {line!r}, and must not"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("gateway.core.x", "from gateway.errors import SendFailure"),
        ("gateway.metrics", "from gateway.web.overload import Shedder"),
        ("gateway.app", "from gateway.web.runner import HardenedAppRunner"),
        ("gateway.amqp.x", "from sbamqp.codec import decode"),
        ("gateway.web.x", "from aiohttp.web_protocol import _ErrInfo"),
        ("gateway.servicebus.internals.pool", "from azure.servicebus._pyamqp import _encode"),
        ("gateway.servicebus.client", "from gateway.servicebus import internals"),
    ],
)
def test_the_layer_map_allows(module: str, line: str) -> None:
    assert not violations(module, line)


# Copies of a library's function, kept line for line so that a test can compare them with
# the original (splitting one would lose that): (module, function name) -> that test.
COPIED = {
    # aiohttp's request loop, dropping the last request's objects before it idles
    ("gateway.web.protocol", "start"): "tests/security/test_aiohttp_privates.py",
}


@pytest.mark.unit
def test_no_function_is_over_80_lines() -> None:
    """A function a reader cannot see whole is split where its steps are (STYLE: function
    size); decorators and the docstring count. `COPIED` functions are exempt."""
    long = []
    for module, path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80 and (module, node.name) not in COPIED:
                    long.append(f"{module}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
