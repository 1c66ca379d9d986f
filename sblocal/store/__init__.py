"""The local broker's state: namespaces, entities and messages, with Service Bus semantics.

`Namespace` (namespace.py) owns one namespace; it is assembled from `sending`, `receiving`,
`sessions` and `registry` over the shared state in `base`. `entity` holds what messages live in,
`messages` the stored message, its states and the broker's errors.
"""

from sblocal.store.entity import Entity, EntityKind, SendTarget, Topic
from sblocal.store.messages import (
    PING_CONTENT_TYPE,
    BrokerError,
    Counters,
    MessageState,
    StoredMessage,
    lock_lost,
    now_ms,
)
from sblocal.store.namespace import Namespace
from sblocal.store.sending import EnqueueResult

__all__ = [
    "PING_CONTENT_TYPE",
    "BrokerError",
    "Counters",
    "EnqueueResult",
    "Entity",
    "EntityKind",
    "MessageState",
    "Namespace",
    "SendTarget",
    "StoredMessage",
    "Topic",
    "lock_lost",
    "now_ms",
]
