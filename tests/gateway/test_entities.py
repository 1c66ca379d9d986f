"""Entity path validation and the configured catalog."""

from __future__ import annotations

import json
import re

import pytest

from gateway.config import ConfigError, EntitySettings, load_settings
from gateway.core.backlog import backlog_path, is_backlog_path
from gateway.core.entities import ENTITY_PATH_PATTERN, EntityCatalog, validate_entity_path
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


VALID = ["orders", "a/b/c", "Orders.v2", "x_y-z", "a" * 260]
CS = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s"


@pytest.mark.parametrize("path", [p for p in ATTACKS if p] + VALID)
def test_configuration_holds_declared_paths_to_the_same_rule(path, tmp_path):
    """One rule: configuration refuses exactly the paths a request may not name."""
    toml = tmp_path / "gw.toml"
    toml.write_text(f"[[entities]]\npath = {json.dumps(path)}\n", encoding="utf-8")
    env = {"SBGATE_PRIMARY_CONNECTION_STRING": CS}
    if path in VALID:
        assert load_settings(env, toml).entities[0].path == path
    else:
        with pytest.raises(ConfigError, match="not a valid entity path"):
            load_settings(env, toml)


@pytest.mark.parametrize(
    "path",
    # What a pattern leaves to the rest of the schema (maxLength) or to the handler ($
    # segments, backlog queues) is left out.
    [p for p in ATTACKS if len(p) <= 260 and "$" not in p and "transfer" not in p.lower()] + VALID,
)
def test_the_openapi_pattern_follows_the_rule(path):
    """The OpenAPI document's pattern is derived from the rule and agrees with it."""
    by_pattern = re.fullmatch(ENTITY_PATH_PATTERN.removeprefix("^").removesuffix("$"), path)
    assert (by_pattern is not None) == (path in VALID)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (backlog_path("contoso", 3), True),
        ("contoso/X-ServiceBus-Transfer/0", True),
        ("contoso/x-servicebus-transfer/0/$DeadLetterQueue", True),
        ("contoso/x-servicebus-transfer", False),
        ("contoso/x-servicebus-transfer/zero", False),
        ("orders", False),
        ("orders/$DeadLetterQueue", False),
    ],
)
def test_is_backlog_path(path, expected):
    assert is_backlog_path(path) is expected
