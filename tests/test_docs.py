"""The docs say what the code does: the reference tables are rendered from the code, and
every route, status, error code, setting and link they name exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from gateway.config import env_names, load_settings
from gateway.errors import GatewayError, SendFailure
from gateway.web.openapi import DOCUMENT
from tests.support import doc_tables

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(doc_tables.TABLES))
def test_the_generated_tables_are_the_codes(name):
    page, render = doc_tables.TABLES[name]
    assert doc_tables.current(name) == render(), (
        f"{page.relative_to(ROOT)}'s {name} table is out of date: "
        "run .venv/bin/python -m tests.support.doc_tables --write"
    )


def test_every_environment_variable_is_documented():
    page = text(DOCS / "configuration.md")
    missing = sorted(n for n in env_names() if f"`{n}`" not in page)
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
    # The loader's names and the table's rows are derived apart: they name the same variables.
    assert env_names() == {name for row in doc_tables.documentation() for name in row.env}


def test_every_route_and_status_of_the_openapi_document_is_in_the_http_api_page():
    page = text(DOCS / "http-api.md")
    paths = set(DOCUMENT["paths"])
    statuses = {
        status
        for operations in DOCUMENT["paths"].values()
        for op in operations.values()
        if isinstance(op, dict)
        for status in op.get("responses", {})
    }
    assert not sorted(p for p in paths if p not in page), "routes missing from docs/http-api.md"
    missing = sorted(s for s in statuses - {"200"} if f"`{s}`" not in page)
    assert not missing, f"statuses missing from docs/http-api.md's answers: {missing}"


def _error_codes() -> set[str]:
    for module in ("gateway.web.admin", "gateway.web.hardening", "gateway.web.handlers"):
        importlib.import_module(module)  # defines its own errors
    codes: set[str] = set()
    todo = [GatewayError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls not in (GatewayError, SendFailure):  # a SendFailure's code is its row's
            codes.add(cls.code)
    return codes


def test_every_error_code_is_documented():
    pages = "".join(text(DOCS / p) for p in ("http-api.md", "errors.md", "auth.md"))
    missing = sorted(c for c in _error_codes() if c not in pages)
    assert not missing, f"error codes missing from docs/http-api.md, errors.md, auth.md: {missing}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix()
)
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
