"""Configuration: env + TOML into frozen dataclasses, validated with messages naming the setting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.config import ConfigError, Secret, Settings, load_settings
from gateway.config.declare import SettingInfo
from gateway.config.loading import DECLARED

CS = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=secret"
CS2 = "Endpoint=sb://fabrikam.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s2"


def test_defaults_are_embedded_and_loopback():
    s = load_settings({})
    assert s.embedded and s.listen_host == "127.0.0.1" and s.listen_port == 8080
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.listen_port = 1  # type: ignore[misc]


def test_env_builds_the_default_pair_and_entities():
    s = load_settings(
        {
            "SBGATE_PRIMARY_CONNECTION_STRING": CS,
            "SBGATE_SECONDARY_CONNECTION_STRING": CS2,
            "SBGATE_ENTITIES": "queue:orders, topic:events",
            "SBGATE_MAX_IN_FLIGHT": "8",
            "SBGATE_FAILOVER_INTERVAL": "2.5",
            "SBGATE_ENABLE_SYPHON": "false",
            "SBGATE_REDIS_URL": "redis://:pw@r:6379/0",
            "PATH": "/usr/bin",
        }
    )
    pair = s.pair("default")
    assert pair.primary.name == "contoso" and pair.secondary and pair.secondary.name == "fabrikam"
    assert [(e.path, e.kind) for e in s.entities] == [("orders", "queue"), ("events", "topic")]
    assert s.limits.max_in_flight == 8 and s.failover.failover_interval == 2.5
    assert s.syphon.enabled is False
    text = repr(s) + str(dataclasses.asdict(s))
    assert "secret" not in text and "pw" not in text


def test_toml_file_and_env_override(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        f"""
listen_port = 9000
[limits]
max_in_flight = 16
[pairs.default]
primary = "{CS}"
[pairs.default.secondary]
connection_string = "{CS2}"
name = "dr"
[[entities]]
path = "orders"
kind = "queue"
"""
    )
    s = load_settings({"SBGATE_LISTEN_PORT": "9100"}, f)
    assert s.listen_port == 9100 and s.limits.max_in_flight == 16
    assert s.pair("default").secondary.name == "dr"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"SBGATE_MAX_IN_FLIGHT": "0"}, "limits.max_in_flight"),
        ({"SBGATE_SEND_TIMEOUT": "soon"}, "timeouts.send_timeout"),
        ({"SBGATE_ENABLE_SYPHON": "maybe"}, "syphon.enabled"),
        ({"SBGATE_LOG_FORMAT": "xml"}, "log_format"),
        ({"SBGATE_NOPE": "1"}, "SBGATE_NOPE"),
        # The SDK's parser and its words: a key name without a key is refused.
        (
            {"SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://x/;SharedAccessKeyName=a"},
            "must have both SharedAccessKeyName and SharedAccessKey",
        ),
        ({"SBGATE_AZURE_CREDENTIAL": "cli"}, "azure_credential"),
        ({"SBGATE_PRIMARY_CONNECTION_STRING": CS}, "declare at least one entity"),
        (
            {"SBGATE_PRIMARY_CONNECTION_STRING": CS, "SBGATE_ENTITIES": "queue:a/$DeadLetterQueue"},
            "not a valid entity path",
        ),
        (
            {"SBGATE_PRIMARY_CONNECTION_STRING": CS, "SBGATE_ENTITIES": "queue:a,topic:A"},
            "declared twice",
        ),
        ({"SBGATE_MAX_MESSAGE_BYTES": "999999999"}, "max_message_bytes"),
        (
            {
                "SBGATE_PRIMARY_CONNECTION_STRING": CS,
                "SBGATE_ENTITIES": "queue:p/X-ServiceBus-Transfer/0",
            },
            "not a valid entity path",
        ),
        ({"SBGATE_AUTH_MAX_TOKEN_LIFETIME": "-1"}, "auth_max_token_lifetime"),
        ({"SBGATE_PROBE_PORT": "8080"}, "(probe_port) must differ from listen_port"),
    ],
)
def test_invalid_settings_name_the_setting(env, fragment):
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert fragment in str(info.value)


def test_an_entity_path_with_a_trailing_newline_is_refused(tmp_path):
    f = tmp_path / "gw.toml"
    f.write_text('[[entities]]\npath = "orders\\n"\n')
    with pytest.raises(ConfigError, match="not a valid entity path"):
        load_settings({"SBGATE_PRIMARY_CONNECTION_STRING": CS}, f)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings({}, tmp_path / "missing.toml")


def test_settings_hold_the_one_secret_type():
    """Connection strings and auth keys share one `Secret`, compared in constant time."""
    from gateway.auth import Secret as AuthSecret

    s = load_settings({"SBGATE_PRIMARY_CONNECTION_STRING": CS, "SBGATE_ENTITIES": "queue:q"})
    cs = s.pair("default").primary.connection_string
    assert type(cs) is AuthSecret
    assert cs == AuthSecret(CS) and cs != AuthSecret(CS2) and repr(cs) == "Secret('***')"


def _raw(value: object) -> str:
    """A value as an environment variable would spell it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value.get() if isinstance(value, Secret) else value)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    return f'"{_raw(value)}"'


def _sample(info: SettingInfo) -> object:
    """A valid value other than the default, to see it arrive."""
    default = info.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        # Its bounds, or twice or half the default: the first the cross-checks allow
        # (a message may not exceed a batch, nor a batch the pending budget).
        parse: Any = info.spec.parse
        for n in (parse.maximum, parse.minimum, default * 2, default / 2):
            value = type(default)(n)
            if value != default and parse.minimum <= value <= parse.maximum:
                try:
                    load_settings({info.env: str(value)})
                except ConfigError:
                    continue
                return value
        raise AssertionError(f"no sample value for {info.env}")
    if info.name == "public_hosts":
        return ("gw.example.com", "localhost")
    if info.name == "log_format":
        return "text"
    if info.name == "log_level":
        return "WARNING"
    if info.name == "azure_credential":
        return "workload"
    allowed = getattr(info.spec.parse, "allowed", None)  # any other choice: not its default
    if allowed:
        return next(a for a in allowed if a != default)
    return Secret("sample") if info.spec.parse.accepts() == "a secret string" else "sample"


@pytest.mark.parametrize("info", DECLARED, ids=lambda i: i.env)
def test_each_setting_arrives_from_its_variable_and_its_toml_key(info, tmp_path):
    """Each declared setting is read from its environment variable and its TOML key, into
    its field; nothing else is declared for it."""
    value = _sample(info)

    def read(s: Settings) -> object:
        return getattr(s if info.section is None else getattr(s, info.section), info.name)

    assert read(load_settings({info.env: _raw(value)})) == value
    toml = tmp_path / "c.toml"
    key = f"{info.name} = {_toml(value)}"
    toml.write_text(f"[{info.section}]\n{key}\n" if info.section else f"{key}\n")
    if info.spec.standard:  # OTEL_*: the standard variable only, never the file
        with pytest.raises(ConfigError, match="unknown setting"):
            load_settings({}, toml)
        return
    assert read(load_settings({}, toml)) == value


def test_an_ambiguous_or_misspelt_variable_is_refused():
    """`enabled` exists in two tables: each has its own variable, and SBGATE_ENABLED is not
    one of them."""
    for name in ("SBGATE_ENABLED", "SBGATE_listen_host", "SBGATE_TERTIARY_NAME"):
        with pytest.raises(ConfigError, match=f"{name}: unknown setting"):
            load_settings({name: "1"})


def test_a_choice_given_a_list_is_a_clear_error(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('log_format = ["json"]\n')
    with pytest.raises(ConfigError, match="log_format: must be one of"):
        load_settings({}, toml)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SBGATE_PING_PRIMARY_INTERVAL": "0"},
            "SBGATE_PING_PRIMARY_INTERVAL (failover.ping_primary_interval): must be",
        ),
        ({"SBGATE_LOG_FORMAT": "xml"}, "SBGATE_LOG_FORMAT (log_format): must be one of"),
        (
            {"SBGATE_PRIMARY_CONNECTION_STRING": "Endpoint=sb://x/;SharedAccessKeyName=a"},
            "SBGATE_PRIMARY_CONNECTION_STRING (pairs.default.primary.connection_string):",
        ),
    ],
)
def test_an_error_names_the_variable_the_user_set(env, message):
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert str(info.value).startswith(message), info.value


def test_an_error_in_the_file_names_the_key(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[failover]\nping_primary_interval = 0\n")
    with pytest.raises(ConfigError, match=r"^failover\.ping_primary_interval: must be"):
        load_settings({}, toml)


@pytest.mark.parametrize(
    ("env", "suggestion"),
    [
        ("SBGATE_FAILOVER_INTERVALL", "SBGATE_FAILOVER_INTERVAL"),
        ("SBGATE_PING_INTERVAL", "SBGATE_PING_PRIMARY_INTERVAL"),
        ("SBGATE_PRIMARY_CONECTION_STRING", "SBGATE_PRIMARY_CONNECTION_STRING"),
        ("SBGATE_ENTITY", "SBGATE_ENTITIES"),
    ],
)
def test_an_unknown_variable_gets_the_nearest_known_name(env, suggestion):
    with pytest.raises(ConfigError, match=f"{env}: unknown setting; did you mean {suggestion}?"):
        load_settings({env: "1"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[failover]\nping_intervall = 5\n", "did you mean 'ping_primary_interval'?"),
        ("log_formt = 'text'\n", "did you mean 'log_format'?"),
        ("[failovr]\nenabled = true\n", "did you mean 'failover'?"),
        (
            "[pairs.p.primary]\nconection_string = 'x'\n",
            "did you mean 'connection_string'?",
        ),
        ("[pairs.p]\nprimry = 'x'\n", "did you mean 'primary'?"),
    ],
)
def test_an_unknown_key_in_the_file_gets_the_nearest_known_key(tmp_path, text, message):
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_settings({}, toml)
