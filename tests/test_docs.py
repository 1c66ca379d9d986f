"""The docs say what the code does: the reference tables are rendered from the code; each
reference page lists every setting, route, metric, error code and `make` target, and the
README, an entrance, links to it and to every other page; and every setting, metric, `make`
target, module, file and link the pages name exists."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.config import env_names, load_settings
from gateway.errors import BrokerFailure, GatewayError, SendFailure
from gateway.ledger import NullLedger
from gateway.metrics import Metrics
from gateway.web.openapi import DOCUMENT
from tests.support import doc_tables

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("name", sorted(doc_tables.TABLES))
def test_the_generated_tables_are_the_codes(name):
    page, render = doc_tables.TABLES[name]
    assert doc_tables.current(name) == render(), (
        f"{page.relative_to(ROOT)}'s {name} table is out of date: "
        "run .venv/bin/python -m tests.support.doc_tables --write"
    )


def test_the_loaders_names_and_the_tables_rows_name_the_same_variables():
    # They are derived apart (the loader's tables, the documentation rows).
    assert env_names() == {name for row in doc_tables.documentation() for name in row.env}


def test_every_status_of_the_openapi_document_is_in_the_http_api_page():
    page = text(DOCS / "http-api.md")
    statuses = {
        status
        for operations in DOCUMENT["paths"].values()
        for op in operations.values()
        if isinstance(op, dict)
        for status in op.get("responses", {})
    }
    missing = sorted(s for s in statuses - {"200"} if f"`{s}`" not in page)
    assert not missing, f"statuses missing from docs/http-api.md's answers: {missing}"


def _error_codes() -> set[str]:
    for module in (
        "gateway.web.admin",
        "gateway.web.hosts",
        "gateway.web.protocol",
        "gateway.web.handlers",
    ):
        importlib.import_module(module)  # defines its own errors
    codes: set[str] = set()
    todo = [GatewayError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls not in (GatewayError, BrokerFailure, SendFailure):  # their code is their row's
            codes.add(cls.code)
    return codes


def _metric_families() -> dict[str, set[str]]:
    """Each metric as docs/metrics.md names it (`sbgate_x_total`), with every series name it
    exposes (`sbgate_x_bucket`, ...)."""
    metrics = Metrics()
    metrics.bind_ledger(NullLedger())
    families = {}
    for family in metrics.registry.collect():
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        families[name] = {name, family.name, *(sample.name for sample in family.samples)}
    return families


MAKE_TARGETS = frozenset(
    re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
)

# The README is an entrance: for each of these it links to the one page that lists them all.
# what: (the pages that list it, the page the README links to, every item as the pages write it)
REFERENCE: dict[str, tuple[tuple[str, ...], str, Callable[[], set[str]]]] = {
    "settings": (
        ("configuration.md",),
        "configuration.md",
        lambda: {f"`{n}`" for n in env_names()},
    ),
    "routes": (("http-api.md",), "http-api.md", lambda: set(DOCUMENT["paths"])),
    "metrics": (
        ("metrics.md",),
        "metrics.md",
        lambda: {f"`{n}`" for n in _metric_families() if n.startswith("sbgate_")},
    ),
    "error codes": (("http-api.md", "errors.md", "auth.md"), "errors.md", _error_codes),
    "make targets": (
        ("development.md",),
        "development.md",
        lambda: {f"`make {t}`" for t in MAKE_TARGETS},
    ),
}


def _readme_links() -> set[str]:
    return {target.partition("#")[0] for target in _LINK.findall(text(README))}


@pytest.mark.parametrize("what", sorted(REFERENCE))
def test_each_reference_page_is_complete_and_the_readme_links_to_it(what):
    pages, linked, items = REFERENCE[what]
    page = "".join(text(DOCS / p) for p in pages)
    missing = sorted(i for i in items() if i not in page)
    assert not missing, f"{what} missing from {', '.join('docs/' + p for p in pages)}: {missing}"
    assert f"docs/{linked}" in _readme_links(), f"the README does not link docs/{linked} ({what})"


def test_the_readme_links_every_docs_page():
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")}
    missing = sorted(pages - _readme_links())
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_is_an_entrance():
    """At most ~250 lines, and no dated figure: those live in docs/performance.md (and the
    pages it links), next to how they were measured."""
    readme = text(README)
    assert len(readme.splitlines()) <= 250, "the README grew past 250 lines: move text to docs/"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not dates, f"dated figures in the README (they belong in docs/performance.md): {dates}"


PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Shown on purpose as what is not a setting: the naming rule's placeholder, a misspelling.
_NOT_SETTINGS = {"SBGATE_K", "SBGATE_FAILOVER_INTERVALL"}


def _named(pattern: str, page: Path) -> set[str]:
    return set(re.findall(pattern, text(page)))


_CODE = re.compile(r"^```[^\n]*\n.*?^```|^(?: {4}|\t).*$|`[^`\n]+`", re.M | re.S)


def _commands(pattern: str, page: Path) -> set[str]:
    """What `pattern` finds in the page's code: fenced and indented blocks, inline spans."""
    return set(re.findall(pattern, "\n".join(_CODE.findall(text(page)))))


_REPO_PATH = re.compile(
    r"`((?:gateway|sblocal|sbamqp|pipeline|tests|bench|loadtests|scripts|helm|dev|fuzz|docs|requirements)"
    r"/[^`\s]*)`"
)
_NOT_COMMITTED = {"bench/out/"}  # written by the benchmarks


def _exists(path: str) -> bool:
    path = path.partition("::")[0]  # tests/x.py::test_name
    return any(ROOT.glob(path)) if any(c in path for c in "*?[") else (ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_setting_metric_make_target_module_and_file_a_page_names_exists(page):
    """Text moved between pages, or a renamed setting or file, leaves no name behind that the
    code no longer has."""
    settings = _named(r"\bSBGATE_[A-Z0-9_]*[A-Z0-9]\b(?!\*)", page) - _NOT_SETTINGS
    assert not settings - env_names(), f"unknown settings: {sorted(settings - env_names())}"
    series = set().union(*_metric_families().values())
    metrics = _named(r"\bsbgate_[a-z0-9_]*[a-z0-9]\b", page)
    assert not metrics - series, f"unknown metrics: {sorted(metrics - series)}"
    targets = _commands(r"\bmake ([a-z][\w-]*)", page)
    assert not targets - MAKE_TARGETS, f"unknown make targets: {sorted(targets - MAKE_TARGETS)}"
    modules = _commands(r"python -m ([a-z_][\w.]*)", page)
    absent = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not absent, f"`python -m` of modules that do not exist: {absent}"
    files = sorted(f for f in _named(_REPO_PATH.pattern, page) - _NOT_COMMITTED if not _exists(f))
    assert not files, f"files that do not exist: {files}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_between_the_pages_resolve(page):
    """Relative links name files that exist, and anchors name headings of their page."""
    broken = []
    for target in _LINK.findall(text(page)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", text(file), re.MULTILINE)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_the_configuration_pages_toml_example_loads(tmp_path):
    example = re.search(r"```toml\n(.*?)```", text(DOCS / "configuration.md"), re.DOTALL)
    assert example is not None, "docs/configuration.md has no TOML example"
    path = tmp_path / "sbgate.toml"
    path.write_text(example.group(1), encoding="utf-8")
    settings = load_settings({}, path)
    assert [p.name for p in settings.pairs] == ["default", "eu"]
    assert [e.path for e in settings.entities] == ["orders", "invoices"]


_CONFLICT = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.MULTILINE)
_SOURCES = {".md", ".py", ".toml", ".yaml", ".yml", ".tpl", ".json", ".sh", ".txt", ".cfg"}


def _sources() -> list[Path]:
    """The repository's text files (not the environments, caches and build output)."""
    found = []
    skip = {"node_modules", "dist", "out", "__pycache__"}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and (d == ".ci" or not d.startswith("."))]
        for name in files:
            path = Path(top) / name
            if path.suffix in _SOURCES or name in {"Makefile", "Dockerfile", "run"}:
                found.append(path)
    return found


def test_no_file_holds_a_merge_conflicts_markers():
    marked = [str(p.relative_to(ROOT)) for p in _sources() if _CONFLICT.search(text(p))]
    assert not marked, f"unresolved merge conflicts: {marked}"
