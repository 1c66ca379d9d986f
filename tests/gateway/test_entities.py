"""Entity path validation and the configured catalog."""

from __future__ import annotations

import pytest

from gateway.config import EntitySettings
from gateway.core.entities import EntityCatalog, validate_entity_path
from gateway.errors import InvalidEntityPath, UnknownEntity

ATTACKS = [
    "",
    "a" * 261,
    "orders/$DeadLetterQueue",
    "orders/$deadletterqueue",
    "orders/subscriptions/audit/$DeadLetterQueue",
    "primary/x-servicebus-transfer/0",
    "x/X-SERVICEBUS-TRANSFER/3",
    "..",
    "a/../b",
    "a/./b",
    "a//b",
    "/a",
    "a/",
    "a@b",
    "a?b",
    "a#b",
    "a*b",
    "a\x00b",
    "ord\u0435rs",  # Cyrillic small letter ie: a look-alike of "orders"
    "a b",
    "a%2Fb",
    "-leading",
]


@pytest.mark.parametrize("path", ATTACKS)
def test_attack_corpus_is_invalid(path):
    with pytest.raises(InvalidEntityPath) as info:
        validate_entity_path(path)
    assert info.value.status == 400


@pytest.mark.parametrize("path", ["orders", "a/b/c", "Orders.v2", "x_y-z", "a" * 260])
def test_valid_paths(path):
    assert validate_entity_path(path) == path


def test_catalog_is_case_insensitive_and_kind_aware():
    cat = EntityCatalog(
        [EntitySettings("orders", "queue"), EntitySettings("events", "topic", pair="p2")]
    )
    assert cat.resolve("ORDERS").path == "orders"
    assert cat.resolve("events", "topic").pair == "p2"
    with pytest.raises(UnknownEntity) as info:
        cat.resolve("events", "queue")
    assert info.value.status == 404 and info.value.details["entity"] == "events"
    with pytest.raises(UnknownEntity):
        cat.resolve("nope")
