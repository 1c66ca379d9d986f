"""The README documents every setting, every metric and the error table the code has."""

from __future__ import annotations

from pathlib import Path

from gateway import config
from gateway.errors import CLASSIFICATIONS, Classification
from gateway.metrics import Metrics
from gateway.servicebus.errors import SDK_EXCEPTIONS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_every_setting_is_in_the_readme():
    missing = sorted(n for n in config.env_names() if n not in README)
    assert not missing, f"settings missing from the README: {missing}"


def test_every_metric_is_in_the_readme():
    registry = Metrics().registry
    names = {m.name for c in registry._collector_to_names for m in c.collect()}  # type: ignore[attr-defined]
    missing = sorted(n for n in names if n not in README)
    assert not missing, f"metrics missing from the README: {missing}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _error_row(row: Classification) -> str:
    causes = [f"`{t.__name__}`" for t, r in SDK_EXCEPTIONS.items() if r is row]
    if row.also_raised_for:
        causes.append(row.also_raised_for)
    answer = str(row.http_status)
    if row.retry_after is not None:
        answer += f", Retry-After {row.retry_after:g}"
    if row.recreate_sender:
        answer += "; sender reopened"
    cells = [
        ", ".join(causes),
        f"`upstream_{row.kind.value}`",
        _yes(row.transient),
        _yes(row.counts_toward_failover),
        answer,
    ]
    return "| " + " | ".join(cells) + " |"


def errors_table() -> str:
    """The README's Errors table, rendered from the code's one table."""
    head = [
        "| raised for | error code | transient | counts toward failover | answer |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + [_error_row(r) for r in CLASSIFICATIONS])


def test_the_errors_table_is_the_codes():
    table = errors_table()
    assert table in README, f"the README's Errors table must read:\n{table}"
