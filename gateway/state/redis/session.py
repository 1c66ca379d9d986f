"""One connection generation to Redis: its command client and its registered scripts."""

from __future__ import annotations

from dataclasses import dataclass

from redis.commands.core import AsyncScript

from gateway.state.connect import Client
from gateway.state.redis.lua import (
    ACQUIRE_LUA,
    DISABLE_LUA,
    ENABLE_LUA,
    RELEASE_LUA,
    RESTORE_LUA,
    TRANSITION_LUA,
)


class SessionBroken(Exception):
    """A call on this session failed elsewhere (writer, lease): reconnect and resync."""


@dataclass(slots=True)
class Session:
    """One connection generation: the command client and its registered scripts."""

    client: Client
    publish: str  # PUBLISH, or SPUBLISH when the subscribers listen on a sharded channel
    transition: AsyncScript
    restore: AsyncScript
    disable: AsyncScript
    enable: AsyncScript
    acquire: AsyncScript
    release: AsyncScript
    # The dataset mark this session resynced against (`RedisStateStore` module docstring):
    # a script that finds another one, or none, refuses (Redis lost its data meanwhile).
    mark: str = ""

    @classmethod
    def open(cls, client: Client, publish: str, mark: str = "") -> Session:
        def reg(lua: str) -> AsyncScript:
            return client.register_script(lua.replace("'PUBLISH'", f"'{publish}'"))

        return cls(
            client,
            publish,
            reg(TRANSITION_LUA),
            reg(RESTORE_LUA),
            reg(DISABLE_LUA),
            reg(ENABLE_LUA),
            reg(ACQUIRE_LUA),
            reg(RELEASE_LUA),
            mark,
        )
