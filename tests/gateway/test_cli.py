"""The `gateway` command line: delegated subcommands get their options untouched."""

from __future__ import annotations

import pytest

from gateway.auth import Authorizer, Right, parse_rules
from gateway.cli import main

KEY = "Y2xpLXRlc3Qta2V5LWZvci10ZXN0cy1vbmx5LTAwMDAwMDA="


def test_token_options_reach_the_token_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "token",
            "--key",
            KEY,
            "--rule",
            "sender",
            "--entity",
            "orders",
            "--host",
            "gw.example.com",
            "--ttl",
            "600",
        ]
    )
    assert code == 0
    header = capsys.readouterr().out.strip().splitlines()[0]
    rules = parse_rules(
        {
            "rules": [
                {"name": "sender", "primary_key": KEY, "rights": ["Send"], "entities": ["orders"]}
            ]
        },
        source="test",
    )
    principal = Authorizer(rules, ["gw.example.com"]).authorize(
        header, entity_path="orders", right=Right.SEND
    )
    assert principal.key_name == "sender"


@pytest.mark.parametrize("command", ["drain", "audit", "token"])
def test_delegated_help_works(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([command, "--help"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_a_bad_configuration_exits_2_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SBGATE_MAX_IN_FLIGHT", "0")
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    assert info.value.code == 2
    assert "limits.max_in_flight" in capsys.readouterr().err
