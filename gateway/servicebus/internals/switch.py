"""The one switch: whether what we borrow from the SDK's insides applies, now.

Everything in `gateway.servicebus.internals` was checked against exactly one SDK release,
`SDK_VERSION` (pyproject.toml pins it, and tests/gateway/test_sdk_seam.py hashes every SDK
function and constructor the seam relies on, `relied_on.RELIED_ON`). Two questions, both
answered here and nowhere else:

* `version_matches`: the installed SDK is that release. Otherwise nothing is patched
  (`install` returns False), the pool gives each sender the SDK's own connection, and every
  send takes the SDK's public path: the gateway still works, only slower.
* `applies`: that, and azure-core tracing is off. With tracing on, the SDK adds trace
  properties and span links per message in `add_message` and `send_messages`; our encoded
  paths would skip them, so the sender takes the SDK's own path instead. Read at each send
  (tracing can be configured after start-up).
"""

from __future__ import annotations

from typing import Final

import azure.servicebus
from azure.core.settings import settings as azure_settings

SDK_VERSION: Final = "7.15.0"
VERSION_MATCHES: Final = azure.servicebus.__version__ == SDK_VERSION


def version_matches() -> bool:
    """The installed azure-servicebus is the release the seam was checked against."""
    return VERSION_MATCHES


def applies() -> bool:
    """The encoded paths (`encoding.add`, `lean.send`) may stand in for the SDK's: the
    pinned SDK, and azure-core tracing off."""
    return VERSION_MATCHES and azure_settings.tracing_implementation() is None
