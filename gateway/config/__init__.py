"""Configuration: read once at start-up into frozen dataclasses, validated with clear messages.

Sources, later ones winning: built-in defaults → the TOML file (``SBGATE_CONFIG`` or
``--config``) → environment variables ``SBGATE_*``. Nothing else in the gateway reads
``os.environ``: `load_settings` receives the environment as a mapping.

Each setting is declared once, on its dataclass field; the loader's tables and the
documentation's table (docs/configuration.md) are derived from those declarations.

* `values` — the value parsers (`ConfigError`);
* `declare` — how a setting is declared (`setting`, `section`), and read back;
* `settings` — the declarations: the one file to edit to add a setting;
* `loading` — `load_settings`, from a TOML file and the environment.
"""

from gateway.config.loading import env_names, load_settings
from gateway.config.settings import (
    LOG_LEVELS,
    AmqpSettings,
    CredentialKind,
    EntityKind,
    EntitySettings,
    FailoverSettings,
    HttpSettings,
    LimitSettings,
    LogFormat,
    NamespaceSettings,
    PairSettings,
    RedisCredential,
    RedisMode,
    SessionOrder,
    Settings,
    ShutdownSettings,
    SyphonSettings,
    TimeoutSettings,
    TracingSettings,
)
from gateway.config.values import ConfigError
from gateway.secret import Secret  # settings hold secrets

__all__ = [
    "LOG_LEVELS",
    "AmqpSettings",
    "ConfigError",
    "CredentialKind",
    "EntityKind",
    "EntitySettings",
    "FailoverSettings",
    "HttpSettings",
    "LimitSettings",
    "LogFormat",
    "NamespaceSettings",
    "PairSettings",
    "RedisCredential",
    "RedisMode",
    "Secret",
    "SessionOrder",
    "Settings",
    "ShutdownSettings",
    "SyphonSettings",
    "TimeoutSettings",
    "TracingSettings",
    "env_names",
    "load_settings",
]
