"""The `gateway` command line: delegated subcommands get their options untouched; how
`gateway syphon` stops."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from gateway.auth import Authorizer, Right, parse_rules
from gateway.cli import _first_fault, main

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


def test_the_banner_prints_a_load_test_token_that_sends_to_every_entity() -> None:
    """`make run`'s banner: the LOADTEST_AUTHORIZATION line is ready to paste, and its token
    sends to each declared entity on the listen address."""
    import shlex

    from gateway.auth import Authorizer, Right, load_rules
    from gateway.cli import _banner
    from gateway.config import load_settings

    settings = load_settings(
        {
            "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://p.example/;SharedAccessKeyName=k;"
            "SharedAccessKey=a2V5",
            "SBGATE_ENTITIES": "queue:orders,topic:events",
            "SBGATE_AUTH_RULES_FILE": "dev/demo-rules.toml",
            "SBGATE_LISTEN_PORT": "8093",
        }
    )
    lines = _banner(settings, None).splitlines()
    [line] = [x for x in lines if "LOADTEST_AUTHORIZATION=" in x]
    [assignment] = [w for w in shlex.split(line) if w.startswith("LOADTEST_AUTHORIZATION=")]
    token = assignment.partition("=")[2]
    authorizer = Authorizer(load_rules("dev/demo-rules.toml"), ["127.0.0.1"])
    for entity in ("orders", "events"):
        assert authorizer.authorize(token, entity_path=entity, right=Right.SEND)
    assert any("LOADTEST_ENTITIES=queue:orders,topic:events" in x for x in lines)


async def test_gateway_syphon_stops_on_the_first_fault_or_signal_leaving_no_waiter() -> None:
    """`syphon.exit_on_fault`: a fault before the signal means exit 3; either way every
    waiter task is cancelled and awaited (none left pending for the loop to complain of)."""
    stop, faults = asyncio.Event(), [asyncio.Event(), asyncio.Event()]
    before = asyncio.all_tasks()
    faults[1].set()
    assert await _first_fault(faults, stop) is True
    stop.set()
    assert await _first_fault([asyncio.Event()], stop) is False
    assert asyncio.all_tasks() == before


@pytest.mark.parametrize(("rule", "warned"), [("demo", False), ("demo-admin", False)])
def test_a_namespace_token_for_a_send_rule_gets_no_warning(
    rule: str, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A namespace token is what the load test sends with (every entity): a Send rule is
    the right one for it, and a Manage rule for the admin API; neither gets a warning."""
    assert main(["token", "--rules", "dev/demo-rules.toml", "--rule", rule, "--namespace"]) == 0
    assert ("warning" in capsys.readouterr().err) is warned


def test_a_namespace_token_for_a_rule_with_neither_right_is_warned(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(
        f'[[rules]]\nname = "listen"\nprimary_key = "{KEY}"\nrights = ["Listen"]\n'
        'entities = ["*"]\n'
    )
    assert main(["token", "--rules", str(rules), "--rule", "listen", "--namespace"]) == 0
    err = capsys.readouterr().err
    assert "does not grant Send or Manage" in err


def test_the_development_profile_fills_in_only_what_the_environment_leaves_unset() -> None:
    """`gateway serve --dev` (make run): quick pings, no drain delay, text logs, the demo
    keys; a variable the user set wins, and production (no --dev) keeps its defaults."""
    import argparse

    from gateway.cli import _load

    def load(dev: bool, **env: str) -> Any:
        args = argparse.Namespace(config=None, dev=dev)
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in os.environ if n.startswith("SBGATE_")]:
                mp.delenv(name)
            for name, value in env.items():
                mp.setenv(name, value)
            return _load(args)

    dev = load(True)
    assert dev.failover.ping_primary_interval == 5 and dev.shutdown.drain_delay == 0
    assert dev.log_format == "text" and dev.auth_rules_file == "dev/demo-rules.toml"
    mine = load(True, SBGATE_PING_PRIMARY_INTERVAL="60", SBGATE_LOG_FORMAT="json")
    assert mine.failover.ping_primary_interval == 60 and mine.log_format == "json"
    production = load(False)
    assert production.failover.ping_primary_interval == 60
    assert production.shutdown.drain_delay == 5 and production.log_format == "json"
    assert production.auth_rules_file is None


@pytest.mark.integration
def test_the_development_amqp_port_moves_off_a_port_another_broker_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5672 is RabbitMQ's port too: `make run` on a machine running one must still start. The
    profile's default moves to a free port, the banner's connection string carries it and
    says why; a port the user chose is left as given (a busy one is the listener's error)."""
    import socket

    from gateway.cli import _banner, dev_amqp_port
    from gateway.config import load_settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        moved = dev_amqp_port("127.0.0.1", busy)
        assert moved not in (0, busy)
        with socket.socket() as check:  # the port it chose can be listened on
            check.bind(("127.0.0.1", moved))
    assert dev_amqp_port("127.0.0.1", moved) == moved  # a free port stays

    env = {
        "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://p.example/;SharedAccessKeyName=k;"
        "SharedAccessKey=a2V5",
        "SBGATE_ENTITIES": "queue:orders",
        "SBGATE_AMQP_PLAIN_PORT": str(moved),
    }
    monkeypatch.delenv("SBGATE_AMQP_PLAIN_PORT", raising=False)
    lines = _banner(load_settings(env), None, dev=True).splitlines()
    assert f"Endpoint=sb://localhost:{moved};" in lines[1]
    assert lines[2].startswith("  (port 5672 is in use by another process")
    monkeypatch.setenv("SBGATE_AMQP_PLAIN_PORT", str(moved))  # the user's own choice
    assert "in use" not in _banner(load_settings(env), None, dev=True)


def test_the_development_banner_says_the_ping_interval_and_exports_the_demo_variables() -> None:
    import shlex

    from gateway.cli import _banner
    from gateway.config import load_settings

    settings = load_settings(
        {
            "SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://p.example/;SharedAccessKeyName=k;"
            "SharedAccessKey=a2V5",
            "SBGATE_ENTITIES": "queue:orders",
            "SBGATE_AUTH_RULES_FILE": "dev/demo-rules.toml",
            "SBGATE_PING_PRIMARY_INTERVAL": "5",
        }
    )
    info = {
        "namespaces": {"primary": {"connection_string": "Endpoint=sb://localhost:1;X=y"}},
        "control": "http://127.0.0.1:2",
    }
    lines = _banner(settings, info, dev=True).splitlines()
    assert "pinged every 5 s (production default: 60 s)" in lines[1]
    [export] = [x for x in lines if x.strip().startswith("export SEND=")]
    names = {w.partition("=")[0] for w in shlex.split(export)[1:]}
    assert names == {"SEND", "ADMIN", "CTRL", "PRIMARY"}
    assert "development profile" not in _banner(settings, info)


@pytest.mark.integration  # a subprocess
def test_a_serving_process_freezes_its_start_up_and_collects_less_often() -> None:
    """`tune_gc`, which `serve` calls once started, in a process of its own (freezing is
    process-wide: never in the test process)."""
    code = (
        "import gc; from gateway.cli import GC_THRESHOLD0, tune_gc; tune_gc(); "
        "print(gc.get_threshold()[0] == GC_THRESHOLD0, gc.get_freeze_count() > 1000)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("app.localhost", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_one_loopback_rule_for_the_listen_host_and_the_host_check(
    host: str, loopback: bool
) -> None:
    """`gateway serve` refuses to listen open on a non-loopback host by the same rule as open
    mode's ``Host`` check (there were two, which disagreed on ``LOCALHOST`` and ``[::1]``)."""
    from gateway.web.hosts import is_loopback

    assert is_loopback(host) is loopback
