"""Session fences shared through Redis (`gateway.state.fence` says what a fence is).

Layout: `{<prefix>}:fence:<entity>\\n<session>` — one hash per fenced session (an entity
path holds no newline, so the key splits back unambiguously):

* `since` (unix time), `id` (this fence's incarnation: a lift event names it, so a late
  lift never removes a newer fence from memory), `gen` (current generation), `seq`;
* `q:<gen>` — the backlog queue of generation `gen`;
* `p:<write id>` — `"<deadline> <gen>"`: a write in flight;
* `t:<token>` — `"<gen> <seq>"`: an acknowledged message not yet home;
* `x:<token>` — a message moved home before its acknowledgement was recorded;
* `u` — an unknown fence (its contents were lost): nothing of the session moves until a
  syphon rebuilds it from the backlog (`REBUILD_LUA`: the session's older messages in
  generations numbered from -1 down), or it lifts on an empty backlog.

Every change is one Lua script (check, write, lift, publish: atomic); the lift deletes the
hash and publishes `{"kind": "fence", "on": false, ...}` on the state channel, the first
write publishes `"on": true`. Each replica keeps the set of fenced sessions in memory
(`fenced`: the hot path), from the events and from a resync on every (re)connection.

Fail closed: until its first resync a replica takes every session to be fenced;
`begin_write` raises `FenceUnavailable` while Redis is unreachable (the request
is answered 503). An `end_write` or `moved` that fails is tried once more on the current
session if the one it ran on was replaced meanwhile, else kept and replayed by the next
resync (one at a time; what fails stays). Both scripts are idempotent (an end whose write
is no longer pending adds no tokens), so a call whose answer was lost may run twice.
A resync that finds a fence this replica knows of missing from Redis (Redis restarted
empty, or it lifted while we were away: we cannot tell) writes it back as an unknown
fence. Values read from Redis are validated; a field that does not parse holds the
fence (never a reason to send to the primary).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import orjson
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError

from gateway.state.fence import (
    Fence,
    FenceKey,
    FenceListener,
    FenceStore,
    FenceUnavailable,
    generations,
)
from gateway.state.redis.values import Invalid, parse_text, parse_time

if TYPE_CHECKING:
    from gateway.state.redis.session import Session
    from gateway.state.redis.store import RedisStateStore

log = logging.getLogger(__name__)

_REDIS_ERRORS = (RedisError, OSError, TimeoutError)
DATA_LOST = "DATALOST"  # a script's refusal: the dataset mark changed
MAX_REPLAY = 100_000  # end/moved calls kept for replay while Redis is away, at most
# Fence calls in flight at once, per replica: each holds a connection of the client's pool
# (100). Unbounded, a burst of session writes (a failover under load) opened connections
# past the op timeout or the pool's limit, which broke the state session and answered every
# session's backlog write 503. The others wait their turn, before their op timeout starts.
MAX_CALLS = 32

# Every script gets KEYS[2], the dataset mark's key, and the session's mark as its last
# argument, and refuses first if Redis holds another mark or none: it lost its data since
# this replica resynced, so a fence missing now was lost, not lifted (the store's module
# docstring). `NARGV` is the count of the script's own arguments.
_MARK_LUA = r"""
if redis.call('GET', KEYS[2]) ~= ARGV[#ARGV] then
  return redis.error_reply('DATALOST redis lost its data since this replica resynced')
end
local NARGV = #ARGV - 1
"""

_LIFT_LUA = (
    _MARK_LUA
    + r"""
local function held(key, now)
  local h = redis.call('HGETALL', key)
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    local c = string.sub(f, 1, 2)
    if c == 't:' or f == 'u' then return true end
    if c == 'p:' then
      local d = tonumber(string.match(v, '^(%S+)'))
      if d == nil or d > now then return true end
    end
  end
  return false
end
local function lift(key, now, channel, entity, session)
  if redis.call('EXISTS', key) == 0 or held(key, now) then return '-1' end
  local since = tonumber(redis.call('HGET', key, 'since')) or now
  local id = redis.call('HGET', key, 'id') or ''
  redis.call('DEL', key)
  local age = math.max(now - since, 0)
  redis.call('PUBLISH', channel, cjson.encode({kind = 'fence', entity = entity,
    session = session, on = false, id = id, age = age}))
  return tostring(age)
end
local function fence_key(key)
  local t = redis.call('TYPE', key).ok
  if t ~= 'hash' and t ~= 'none' then redis.call('DEL', key) end
end
"""
)

# KEYS[1]; ARGV: write id, deadline, now, new id, channel, entity, session, n ranked,
# ranked..., disabled... -> {queue, gen, id} or {} (no queue usable).
BEGIN_LUA = (
    _LIFT_LUA
    + r"""
local k = KEYS[1]
fence_key(k)
local n = tonumber(ARGV[8])
local ranked, disabled = {}, {}
for i = 1, n do ranked[i] = ARGV[8 + i] end
for i = 9 + n, NARGV do disabled[ARGV[i]] = true end
local created = redis.call('EXISTS', k) == 0
local gen = tonumber(redis.call('HGET', k, 'gen') or '0') or 0
local cur = false
if gen > 0 then cur = redis.call('HGET', k, 'q:' .. gen) end
if not cur or disabled[cur] then
  local pick = false
  for i = 1, n do
    if not disabled[ranked[i]] then pick = ranked[i]; break end
  end
  if not pick then return {} end
  if created then redis.call('HSET', k, 'since', ARGV[3], 'id', ARGV[4]) end
  gen = gen + 1
  redis.call('HSET', k, 'gen', gen, 'q:' .. gen, pick)
  cur = pick
end
redis.call('HSET', k, 'p:' .. ARGV[1], ARGV[2] .. ' ' .. gen)
local id = redis.call('HGET', k, 'id') or ''
if created then
  redis.call('PUBLISH', ARGV[5], cjson.encode({kind = 'fence', entity = ARGV[6],
    session = ARGV[7], on = true, id = id, age = 0}))
end
return {cur, tostring(gen), id}
"""
)

# KEYS[1]; ARGV: write id, ok (1/0), now, channel, entity, session, tokens... -> age or -1.
# Idempotent: a write whose pending entry is gone adds no tokens.
END_LUA = (
    _LIFT_LUA
    + r"""
local k = KEYS[1]
fence_key(k)
if redis.call('EXISTS', k) == 0 then return '-1' end
local now = tonumber(ARGV[3])
local p = redis.call('HGET', k, 'p:' .. ARGV[1])
local gen = p and tonumber(string.match(p, '%s(%d+)$'))
if not gen then gen = tonumber(redis.call('HGET', k, 'gen')) or 0 end
redis.call('HDEL', k, 'p:' .. ARGV[1])
-- Without its pending entry this write was ended already (a replay of an end that had
-- run, its answer lost): adding its tokens again would hold the fence for messages that
-- may be home already.
if ARGV[2] == '1' and p then
  local seq = tonumber(redis.call('HGET', k, 'seq')) or 0
  for i = 7, NARGV do
    if redis.call('HDEL', k, 'x:' .. ARGV[i]) == 0 then
      seq = seq + 1
      redis.call('HSET', k, 't:' .. ARGV[i], gen .. ' ' .. seq)
    end
  end
  redis.call('HSET', k, 'seq', seq)
end
return lift(k, now, ARGV[4], ARGV[5], ARGV[6])
"""
)

# KEYS[1]; ARGV: now, channel, entity, session, tokens... -> age or -1.
MOVED_LUA = (
    _LIFT_LUA
    + r"""
local k = KEYS[1]
fence_key(k)
if redis.call('EXISTS', k) == 0 then return '-1' end
for i = 5, NARGV do
  if redis.call('HDEL', k, 't:' .. ARGV[i]) == 0 then
    redis.call('HSET', k, 'x:' .. ARGV[i], '1')
  end
end
return lift(k, tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS[1]; ARGV: now, channel, entity, session -> age or -1. An unknown fence forgets what
# it held (the backlog is empty) and lifts unless a write is pending; a known one lifts if
# nothing holds it (a write past its deadline holds nothing, and may be all that is left).
EMPTY_LUA = (
    _LIFT_LUA
    + r"""
local k = KEYS[1]
fence_key(k)
if redis.call('HEXISTS', k, 'u') == 0 then
  return lift(k, tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4])
end
local h = redis.call('HKEYS', k)
for _, f in ipairs(h) do
  if f == 'u' or string.sub(f, 1, 2) == 't:' then redis.call('HDEL', k, f) end
end
return lift(k, tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS[1]; ARGV: now, channel, entity, session, n generations, n queues (generation -n
# first, -1 last), then (token, "<gen> <seq>") pairs -> age or -1. Only on an unknown fence
# (run once, by whichever replica's syphon gets there first); a token the fence counts
# already, or moved home meanwhile (`x:`), is skipped.
REBUILD_LUA = (
    _LIFT_LUA
    + r"""
local k = KEYS[1]
fence_key(k)
if redis.call('HEXISTS', k, 'u') == 0 then return '-1' end
local n = tonumber(ARGV[5])
for i = 1, n do redis.call('HSET', k, 'q:' .. (i - n - 1), ARGV[5 + i]) end
for i = 6 + n, NARGV, 2 do
  local t = ARGV[i]
  if redis.call('HDEL', k, 'x:' .. t) == 0 and redis.call('HEXISTS', k, 't:' .. t) == 0 then
    redis.call('HSET', k, 't:' .. t, ARGV[i + 1])
  end
end
redis.call('HDEL', k, 'u')
return lift(k, tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS[1]; ARGV: now, id. Write a fence back as unknown if Redis lacks it -> the id Redis
# holds (another replica may have written it back first).
UNKNOWN_LUA = (
    _MARK_LUA
    + r"""
local k = KEYS[1]
local t = redis.call('TYPE', k).ok
if t ~= 'hash' then
  if t ~= 'none' then redis.call('DEL', k) end
  redis.call('HSET', k, 'u', '1', 'since', ARGV[1], 'id', ARGV[2], 'gen', '0')
end
return redis.call('HGET', k, 'id') or ''
"""
)


# KEYS[1]: the fence hash as a flat list of fields and values (empty: none).
READ_LUA = _MARK_LUA + "return redis.call('HGETALL', KEYS[1])"


def fence_from_hash(h: Mapping[str, str]) -> Fence:
    """A fence hash as read from Redis. A field that does not parse makes it unknown (it
    then holds until the backlog is found empty): never unfenced by bad data."""
    fence = Fence(since=0.0)
    try:
        fence.since = parse_time(h.get("since", "0"))
        fence.generation = int(h.get("gen", "0"))
        for f, v in h.items():
            if f.startswith("q:"):
                fence.queues[int(f[2:])] = parse_text(v, "queue", empty=False)
            elif f.startswith("p:"):
                deadline, gen = v.split(" ")
                fence.pending[f[2:]] = (parse_time(deadline), int(gen))
            elif f.startswith("t:"):
                gen, seq = v.split(" ")
                fence.tokens[f[2:]] = (int(gen), int(seq))
            elif f == "u":
                fence.unknown = True
    except (ValueError, TypeError):  # Invalid is a ValueError
        fence.unknown = True
        fence.tokens.clear()
    return fence


def _split_key(name: str) -> FenceKey | None:
    entity, sep, session = name.partition("\n")
    return (entity, session) if sep and entity and session else None


class RedisFences:
    """`FenceStore` through Redis (the module docstring), owned by a `RedisStateStore`:
    it uses the store's session, channel and failure handling."""

    def __init__(self, store: RedisStateStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._fenced: dict[FenceKey, str] = {}  # fenced session -> fence id
        self._listeners: list[FenceListener] = []
        self._replay: deque[tuple[str, FenceKey, list[str]]] = deque()  # ("end"|"moved", ...)
        self._scripts: tuple[Session, dict[str, AsyncScript]] | None = None
        self._calls = asyncio.Semaphore(MAX_CALLS)
        # Until the first resync this replica cannot know which sessions are fenced: it
        # takes every one to be (fail closed: their messages take the backlog path, which
        # needs Redis, so they are answered 503 until Redis is reached).
        self._synced = False

    # -- FenceStore: memory ---------------------------------------------------------------

    def fenced(self, entity: str, session: str) -> bool:
        return not self._synced or (entity, session) in self._fenced

    def sessions(self, entity: str) -> list[str]:
        return sorted(s for e, s in self._fenced if e == entity)

    def subscribe_fences(self, listener: FenceListener) -> None:
        self._listeners.append(listener)

    # -- FenceStore: Redis ----------------------------------------------------------------

    async def begin_write(
        self,
        entity: str,
        session: str,
        write_id: str,
        ranked: Sequence[str],
        disabled: Collection[str],
        deadline: float,
    ) -> tuple[str, int] | None:
        args: list[str | int] = [
            write_id,
            repr(deadline),
            repr(self._clock()),
            uuid.uuid4().hex,
            self._store.channel,
            entity,
            session,
            len(ranked),
            *ranked,
            *disabled,
        ]
        try:
            reply = await self._call("begin", (entity, session), args)
        except _REDIS_ERRORS as exc:
            raise FenceUnavailable(f"redis: {exc!r}") from None
        if not reply:
            return None
        try:
            queue, gen, fid = (parse_text(v, "fence reply", empty=True) for v in reply[:3])
            result = (queue, int(gen))
        except (ValueError, TypeError) as exc:
            raise FenceUnavailable(f"an invalid reply from redis: {exc}") from None
        self._fenced[(entity, session)] = fid  # at once: before the event comes back
        return result

    async def end_write(
        self, entity: str, session: str, write_id: str, tokens: Sequence[str], ok: bool
    ) -> None:
        await self._settle("end", (entity, session), [write_id, "1" if ok else "0", *tokens])

    async def moved(self, entity: str, session: str, tokens: Sequence[str]) -> None:
        await self._settle("moved", (entity, session), list(tokens))

    async def movable(
        self, entity: str, session: str, queue: str, held: Sequence[str | None]
    ) -> int:
        fence = await self._read((entity, session))
        if fence is None:
            return 0  # cannot tell: the queue waits
        return len(held) if fence is False else fence.movable(queue, held, self._clock())

    async def unknown(self, entity: str, session: str) -> bool:
        fence = await self._read((entity, session))
        return isinstance(fence, Fence) and fence.unknown

    async def rebuild(self, entity: str, session: str, old: Sequence[tuple[str, str]]) -> None:
        runs = generations(old)
        queues = [q for i, (_, g, _, q) in enumerate(runs) if i == 0 or runs[i - 1][1] != g]
        args: list[str | int] = [len(queues), *queues]
        for token, gen, seq, _ in runs:
            args += [token, f"{gen} {seq}"]
        try:
            await self._call("rebuild", (entity, session), args)
        except _REDIS_ERRORS:
            return  # still unknown: the next wait of the session tries again

    async def _read(self, key: FenceKey) -> Fence | Literal[False] | None:
        """The fence of `key` as Redis holds it: False if there is none, None if Redis
        cannot be reached."""
        sess = self._store.session
        if sess is None:
            return None
        try:
            flat = await self._call("read", key, [], sess)
        except _REDIS_ERRORS:
            return None
        if not flat:
            return False
        if not isinstance(flat, list) or len(flat) % 2:
            self._store.invalid("reply", self._key(key), f"a fence read answered {flat!r:.200}")
            return Fence(since=0.0, unknown=True)  # holds: never a reason to move
        # The client decodes: str already.
        return fence_from_hash({str(f): str(v) for f, v in zip(flat[::2], flat[1::2], strict=True)})

    async def backlog_empty(self, entities: Collection[str]) -> None:
        for key in [k for k in self._fenced if k[0] in entities]:
            try:
                await self._call("empty", key, [])
            except _REDIS_ERRORS:
                return  # the next depth check tries again

    # -- events and resync ------------------------------------------------------------------

    def on_event(self, ev: Mapping[str, Any]) -> None:
        """A fence event from the channel (validated here: it is input)."""
        try:
            entity = parse_text(ev["entity"], "entity", empty=False)
            session = parse_text(ev["session"], "session", empty=False)
            fid = parse_text(ev["id"], "id")
            on = ev["on"]
            age = parse_time(ev.get("age", 0) or 0)
            if not isinstance(on, bool):
                raise Invalid("on is not a boolean")
        except (KeyError, ValueError) as exc:
            self._store.invalid("event", self._store.channel, f"fence event: {exc!r}")
            return
        key = (entity, session)
        if on:
            self._fenced[key] = fid
        elif self._fenced.get(key, fid) == fid:
            self._fenced.pop(key, None)
        else:
            return  # the lift of an older incarnation: the newer fence stands
        self._tell(key, on, age)

    async def resync(self, sess: Session) -> None:
        """Read every fence from Redis (adopt them), write back as unknown those memory
        knows and Redis lacks (fail closed), then replay what failed meanwhile."""
        head = self._key(("", ""))[:-1]  # "{prefix}:fence:"
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        keys = [k async for k in sess.client.scan_iter(match=pattern, count=500)]
        found: dict[FenceKey, str] = {}
        if keys:
            pipe = sess.client.pipeline(transaction=False)
            for k in keys:
                pipe.hget(k, "id")
            ids = await pipe.execute(raise_on_error=False)
            for k, fid in zip(keys, ids, strict=True):
                key = _split_key(k[len(head) :])
                if key is not None:
                    found[key] = fid if isinstance(fid, str) else ""
        missing = [k for k in self._fenced if k not in found]
        for key in missing:
            fid = await self._run(sess, "unknown", key, [repr(self._clock()), uuid.uuid4().hex])
            found[key] = fid if isinstance(fid, str) else ""
            log.warning("fence %s/%s written back to redis as unknown", *key)
        for key in found.keys() - self._fenced.keys():
            self._tell(key, True, 0.0)
        self._fenced = found
        self._synced = True
        # One at a time, each dropped only once it has run: a failure keeps the rest for
        # the next resync, and what failed while this ran is replayed too (the loop ends
        # with the list empty, and the session goes online without another await).
        while self._replay:
            kind, key, args = self._replay[0]
            await self._run(sess, kind, key, args)
            self._replay.popleft()

    # -- helpers ------------------------------------------------------------------------------

    async def _settle(self, kind: str, key: FenceKey, args: list[str]) -> None:
        """`end` or `moved`: now, or replayed after the next resync if Redis is away.

        A call that fails on a session that has been replaced meanwhile is tried once more
        on the current one: that session's resync replayed what was queued before it, so
        queueing now would wait for a resync that may never come (and a lost `moved`
        holds its fence for ever). Both scripts are idempotent, so a call whose answer
        was lost after it ran may run twice."""
        sess = self._store.session
        try:
            await self._call(kind, key, args, sess)
            return
        except _REDIS_ERRORS:
            current = self._store.session
            if current is not None and current is not sess:
                try:
                    await self._call(kind, key, args, current)
                    return
                except _REDIS_ERRORS:
                    pass
            if len(self._replay) < MAX_REPLAY:
                self._replay.append((kind, key, args))
            else:
                log.error("fence %s/%s: too much to replay; this %s is dropped", *key, kind)

    async def _call(
        self, kind: str, key: FenceKey, args: list[Any], sess: Session | None = None
    ) -> Any:
        """Run script `kind` on `sess` (default: the current session); a failure breaks
        that session (if it is still the current one) and is raised."""
        sess = sess if sess is not None else self._store.session
        if sess is None:
            raise ConnectionError("redis is unreachable")
        try:
            return await self._run(sess, kind, key, args)
        except _REDIS_ERRORS as exc:
            if isinstance(exc, ResponseError) and str(exc).startswith(DATA_LOST):
                self._store.data_lost(sess, f"fence {kind}", exc)
            else:
                self._store.call_failed(sess, f"fence {kind}", exc)
            raise

    async def _run(self, sess: Session, kind: str, key: FenceKey, args: list[Any]) -> Any:
        scripts = self._scripts_of(sess)
        now = repr(self._clock())
        channel = self._store.channel
        if kind == "end":
            args = [args[0], args[1], now, channel, *key, *args[2:]]
        elif kind in {"moved", "empty", "rebuild"}:
            args = [now, channel, *key, *args]
        keys = [self._key(key), self._store.dataset_key]
        async with self._calls, asyncio.timeout(self._store.op_timeout):
            reply = await scripts[kind](keys=keys, args=[*args, sess.mark], client=sess.client)
        if kind in {"end", "moved", "empty", "rebuild"} and reply not in (None, "-1", b"-1"):
            self._fenced.pop(key, None)  # lifted: memory at once (the event follows)
        return reply

    def _scripts_of(self, sess: Session) -> dict[str, AsyncScript]:
        if self._scripts is None or self._scripts[0] is not sess:
            publish = sess.publish

            def reg(lua: str) -> AsyncScript:
                return sess.client.register_script(lua.replace("'PUBLISH'", f"'{publish}'"))

            self._scripts = (
                sess,
                {
                    "begin": reg(BEGIN_LUA),
                    "end": reg(END_LUA),
                    "moved": reg(MOVED_LUA),
                    "empty": reg(EMPTY_LUA),
                    "unknown": reg(UNKNOWN_LUA),
                    "rebuild": reg(REBUILD_LUA),
                    "read": reg(READ_LUA),
                },
            )
        return self._scripts[1]

    def _key(self, key: FenceKey) -> str:
        return self._store.key("fence", f"{key[0]}\n{key[1]}")

    def _tell(self, key: FenceKey, on: bool, age: float) -> None:
        for listener in self._listeners:
            try:
                listener(key, on, age)
            except Exception:  # a listener's bug must not stop the subscriber
                log.exception("fence listener failed")


def encode_event(entity: str, session: str, on: bool, fid: str, age: float) -> bytes:
    """A fence event as the scripts publish it (for tests)."""
    return orjson.dumps(
        {"kind": "fence", "entity": entity, "session": session, "on": on, "id": fid, "age": age}
    )


if TYPE_CHECKING:

    def _conforms(fences: RedisFences) -> FenceStore:
        return fences
