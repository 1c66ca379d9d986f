"""One grammar for shared state (issue 33): the Lua scripts and the Python readers accept the
same strings, proven by feeding the same generated strings to both against a real
redis-server. The Lua side accepted `1e0001` and 22-digit integers that Python refused, and
one such hash made every compare-and-set for its entity fail: the scripts refused the
replica's write, the replica refused the stored value, and two replicas stayed diverged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.state.redis.lua import PRELUDE_LUA
from gateway.state.redis.values import Invalid, parse_epoch, parse_time
from tests.support.processes import RedisServer
from tests.support.redis import redis_server as redis_server

pytestmark = pytest.mark.integration

_LUA = (
    PRELUDE_LUA
    + """
local t = valid_time(ARGV[1])
local e = valid_entity({ARGV[2], 'healthy', nil})
return {t and string.format('%.17g', t) or false, e and 1 or 0}
"""
)

_DIGITS = st.text("0123456789", min_size=0, max_size=30)
_SHAPED = st.builds(
    lambda a, dot, b, e, sign, x: a + (("." + b) if dot else "") + (("e" + sign + x) if e else ""),
    _DIGITS,
    st.booleans(),
    _DIGITS,
    st.booleans(),
    st.sampled_from(["", "+", "-"]),
    _DIGITS,
)
_JUNK = st.text(st.sampled_from("0123456789.eE+- xinfa\t"), max_size=50)
_STRINGS = st.one_of(_SHAPED, _JUNK, st.text(max_size=50))


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis(port=redis_server.port, socket_timeout=5)
    yield c
    c.close()


def _python(value: str) -> tuple[float | None, bool]:
    try:
        t: float | None = parse_time(value)
    except Invalid:
        t = None
    try:
        parse_epoch(value)
        e = True
    except Invalid:
        e = False
    return t, e


@settings(
    max_examples=600,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(value=_STRINGS)
@example(value="1e0001")
@example(value="0" * 21 + "1")
@example(value="1." + "0" * 30)
@example(value="4102444800")
@example(value="4102444800.0000001")
@example(value="9007199254740992")
@example(value="1e-400")
def test_lua_and_python_accept_the_same_times_and_epochs(client: redis.Redis, value: str) -> None:
    lua_time, lua_epoch = client.eval(_LUA, 0, value, value)  # type: ignore[misc]
    py_time, py_epoch = _python(value)
    assert (lua_time is None) == (py_time is None), (value, lua_time, py_time)
    if py_time is not None:
        assert float(lua_time) == py_time, value
    assert bool(lua_epoch) == py_epoch, value
