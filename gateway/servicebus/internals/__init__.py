"""The seam: everything the gateway borrows from the azure-servicebus SDK's insides.

No other module of the gateway imports a private SDK name (``azure.servicebus._*``); the
layer map (tests/test_imports.py) holds it. The rest of the adapter sees this narrow
interface:

* **whether it applies** — `applies` (the pinned SDK and azure-core tracing off: the encoded
  paths may stand in for the SDK's), `version_matches`; both decided in `switch`, and only
  there;
* **the process-wide patches** — `install`, called once by the app's wiring
  (`gateway.app.create_app`) before any client exists. It replaces a few pyamqp methods for
  the whole process, so that several handlers can share one AMQP connection safely: the
  syphon's receivers run on them too (`pyamqp_sharing` says which methods and why, and
  docs/design.md writes up the races they close). With another SDK version it patches
  nothing and returns False;
* **the pool** — `ConnectionPool`: a namespace's few AMQP connections, shared by every
  sender link (one reader task per connection; `pool`, `shared_cbs`). Without the patches it
  gives each sender the SDK's own connection;
* **encode and add, for batches** — `encode` (a message encoded once, as the SDK encodes it),
  `add` (into a `ServiceBusMessageBatch` by the SDK's size rule), `check`, and the mapping's
  pieces `amqp_value`, `ttl_ms`, `PARTITION_KEY`, `SCHEDULED_ENQUEUE_TIME` (`encoding`);
* **one send** — `can_send_one(sender)` / `send_one(sender, payload)`: one encoded message
  over an open pooled sender, the SDK's retries and errors kept (`lean`).

What the seam relies on in the SDK, functions and the constructors that create the
attributes it reads, is one table, `relied_on.RELIED_ON`, hashed by
tests/gateway/test_sdk_seam.py; azure-servicebus is pinned exactly in pyproject.toml.
"""

from __future__ import annotations

from gateway.servicebus.internals.switch import SDK_VERSION, applies, version_matches

from gateway.servicebus.internals.encoding import (  # isort: skip (after the switch)
    PARTITION_KEY,
    SCHEDULED_ENQUEUE_TIME,
    add,
    amqp_value,
    check,
    encode,
    ttl_ms,
)
from gateway.servicebus.internals.lean import send as send_one
from gateway.servicebus.internals.lean import usable as can_send_one
from gateway.servicebus.internals.pool import ConnectionPool
from gateway.servicebus.internals.pyamqp_sharing import install

__all__ = [
    "PARTITION_KEY",
    "SCHEDULED_ENQUEUE_TIME",
    "SDK_VERSION",
    "ConnectionPool",
    "add",
    "amqp_value",
    "applies",
    "can_send_one",
    "check",
    "encode",
    "install",
    "send_one",
    "ttl_ms",
    "version_matches",
]
