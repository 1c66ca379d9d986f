"""Failover state shared by every replica: the `StateStore` port and its two stores."""

from gateway.state.base import (
    SEVERITY,
    BacklogListener,
    BacklogState,
    EntityState,
    StateListener,
    StateStore,
    Status,
)
from gateway.state.memory import MemoryStateStore, StoreStats
from gateway.state.redis import RedisStateStore

__all__ = [
    "SEVERITY",
    "BacklogListener",
    "BacklogState",
    "EntityState",
    "MemoryStateStore",
    "RedisStateStore",
    "StateListener",
    "StateStore",
    "Status",
    "StoreStats",
]
