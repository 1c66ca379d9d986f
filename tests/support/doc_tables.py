"""The reference tables in docs/, rendered from the code that defines them.

Each table sits in its page between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``;
tests/test_docs.py fails when one no longer matches the code. To rewrite them after a change
to the settings, the error table or the metrics:

    .venv/bin/python -m tests.support.doc_tables --write
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config.declare import ENV_PREFIX, SettingInfo
from gateway.config.loading import (
    CONFIG_FILE_ENV,
    DECLARED,
    ENTITIES_ENV,
    NAMESPACE_FIELDS,
    NAMESPACE_ROLES,
)
from gateway.config.values import plain
from gateway.errors import CLASSIFICATIONS, Classification
from gateway.ledger import NullLedger
from gateway.metrics import Metrics
from gateway.servicebus.errors import SDK_CONDITIONS, SDK_EXCEPTIONS

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _code(items: Iterable[str]) -> str:
    return ", ".join(f"`{i}`" for i in items) or "—"


# --- settings (gateway/config/settings.py) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class DocRow:
    """One row of the settings' table."""

    env: tuple[str, ...]
    toml: tuple[str, ...]
    default: str
    accepts: str
    doc: str


def _shown(value: Any) -> str:
    if value is None or value == ():
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return plain(value) if isinstance(value, float) else str(value)


def _doc_row(info: SettingInfo) -> DocRow:
    spec = info.spec
    default = spec.shown_default if spec.shown_default is not None else _shown(info.default)
    toml = () if spec.standard else (info.toml,)
    return DocRow((info.env,), toml, default, spec.parse.accepts(), spec.doc)


def documentation() -> list[DocRow]:
    """Every setting, in the order the docs list them: derived from the declarations."""
    rows = [DocRow((CONFIG_FILE_ENV,), (), "", "a file path", "the TOML file (or `--config`)")]
    rows += [_doc_row(info) for info in DECLARED if info.section is None]
    rows.append(
        DocRow(
            (ENTITIES_ENV,),
            ("[[entities]] path, kind, pair",),
            "",
            "`queue:orders,topic:events@pair`",
            "the entities clients may send to (`kind` defaults to `queue`, `pair` to "
            "`default`); required with a namespace",
        )
    )
    for suffix, (name, ns) in NAMESPACE_FIELDS.items():
        env = tuple(f"{ENV_PREFIX}{role}_{suffix}" for role in NAMESPACE_ROLES)
        toml = tuple(f"[pairs.<pair>.{role.lower()}] {name}" for role in NAMESPACE_ROLES)
        rows.append(DocRow(env, toml, ns.shown_default or "", "", ns.doc))
    rows += [_doc_row(info) for info in DECLARED if info.section is not None]
    return rows


def _setting_cells(row: DocRow) -> list[str]:
    default = f"`{row.default}`" if row.default else "—"
    return [_code(row.env), _code(row.toml), default, row.accepts or "—", row.doc]


def settings_table() -> str:
    """docs/configuration.md's table: every setting, from the declarations."""
    head = ["environment variable", "TOML key", "default", "accepts", "meaning"]
    return _table(head, (_setting_cells(r) for r in documentation()))


# --- errors (gateway/errors.py, gateway/servicebus/errors.py) ------------------------------


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _error_row(row: Classification) -> list[str]:
    causes = [f"`{c}`" for c, r in SDK_CONDITIONS.items() if r is row]
    causes += [f"`{t.__name__}`" for t, r in SDK_EXCEPTIONS.items() if r is row]
    if row.also_raised_for:
        causes.append(row.also_raised_for)
    answer = str(row.http_status)
    if row.retry_after is not None:
        answer += f", Retry-After {row.retry_after:g}"
    if row.recreate_sender:
        answer += "; sender reopened"
    return [
        ", ".join(causes),
        f"`upstream_{row.kind.value}`",
        _yes(row.transient),
        _yes(row.counts_toward_failover),
        _yes(row.message_fault),
        answer,
    ]


def errors_table() -> str:
    """docs/errors.md's table: the one classification table and the SDK map."""
    head = [
        "raised for",
        "error code",
        "transient",
        "counts toward failover",
        "the message's fault",
        "answer",
    ]
    return _table(head, (_error_row(r) for r in CLASSIFICATIONS))


# --- metrics (gateway/metrics.py) ----------------------------------------------------------


def metrics_table() -> str:
    """docs/metrics.md's table: every metric a gateway exposes, with its help text."""
    metrics = Metrics()
    metrics.bind_ledger(NullLedger())
    # prometheus_client keeps a metric's label names private; the exposition format shows
    # them only once a labelled child exists, so read them from the declarations.
    labels = {m._name: m._labelnames for m in vars(metrics).values() if hasattr(m, "_labelnames")}
    rows = []
    for family in metrics.registry.collect():
        if not family.name.startswith("sbgate_"):
            continue  # the standard collectors: documented as families below the table
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names = labels.get(family.name, ())
        if family.type == "info":
            names = tuple(family.samples[0].labels)
        if family.type == "stateset":  # one series per state, labelled with the metric's name
            names = (*names, family.name)
        rows.append([f"`{family.name}{suffix}`", family.type, _code(names), family.documentation])
    return _table(["metric", "type", "labels", "meaning"], rows)


# --- the pages ----------------------------------------------------------------------------

TABLES: dict[str, tuple[Path, Callable[[], str]]] = {
    "settings": (DOCS / "configuration.md", settings_table),
    "errors": (DOCS / "errors.md", errors_table),
    "metrics": (DOCS / "metrics.md", metrics_table),
}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(\n<!-- end generated -->)", re.DOTALL)


def current(name: str) -> str | None:
    """The table as the page has it now (None: the page has no such block)."""
    page, _ = TABLES[name]
    m = _block(name).search(page.read_text(encoding="utf-8"))
    return m.group(2) if m else None


def write(name: str) -> bool:
    """Rewrite one table in its page; True if it changed."""
    page, render = TABLES[name]
    text = page.read_text(encoding="utf-8")
    new, n = _block(name).subn(lambda m: m.group(1) + render() + m.group(3), text)
    if n != 1:
        raise SystemExit(f"{page}: no '<!-- generated: {name} -->' block")
    page.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in place")
    args = parser.parse_args(argv)
    stale = []
    for name, (page, render) in TABLES.items():
        if args.write:
            if write(name):
                print(f"rewrote the {name} table in {page.relative_to(ROOT)}")
        elif current(name) != render():
            stale.append(f"{page.relative_to(ROOT)} ({name})")
    if stale:
        print("out of date: " + ", ".join(stale) + "; run with --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
