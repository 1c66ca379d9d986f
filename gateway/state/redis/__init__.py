"""Failover state shared through Redis: the store (`store`), its Lua scripts (`lua`), the
values it reads and the events it publishes (`values`), one connection generation
(`session`)."""

from gateway.state.redis.store import RECONNECT, RedisStateStore
from gateway.state.redis.values import MAX_TIME

__all__ = ["MAX_TIME", "RECONNECT", "RedisStateStore"]
