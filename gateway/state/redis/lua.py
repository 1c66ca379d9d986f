"""The Lua scripts every change to the shared state is: "check, write, publish", atomic.

A transition applies only if the stored epoch is still the one the proposal was built on
(compare-and-set); a restore only if Redis lacks the entity or holds something older. Each
script checks the values it reads with the grammar of `gateway.state.redis.values`.
"""

from __future__ import annotations

from gateway.state.base import SEVERITY
from gateway.state.redis.values import MAX_EPOCH, MAX_TIME

# Shared by the scripts: `sev`, `valid_time(s)`, `valid_entity(cur)` (cur = HMGET epoch,
# status, since), and `repair(key, type)`: a key of another type than ours is deleted (it
# cannot be read, and would make every write to it fail), so the write that follows
# replaces it.
PRELUDE_LUA = (
    "local sev = {"
    + ", ".join(f"{k}={v}" for k, v in SEVERITY.items())
    + "}\n"
    + f"local MAX_TIME, MAX_EPOCH = {MAX_TIME!r}, {MAX_EPOCH}\n"
    + r"""
local function valid_time(s)
  if type(s) ~= 'string' or #s > 45 then return nil end
  if not (string.match(s, '^%d+$') or string.match(s, '^%d+%.%d*$')
          or string.match(s, '^%d+[eE][-+]?%d+$') or string.match(s, '^%d+%.%d*[eE][-+]?%d+$')) then
    return nil
  end
  local t = tonumber(s)
  if t == nil or not (t >= 0 and t <= MAX_TIME) then return nil end
  return t
end
local function valid_entity(cur)
  if type(cur[1]) ~= 'string' or #cur[1] > 16 or not string.match(cur[1], '^%d+$') then
    return false
  end
  if tonumber(cur[1]) >= MAX_EPOCH then return false end
  if cur[2] == nil or sev[cur[2]] == nil then return false end
  return cur[3] == nil or valid_time(cur[3]) ~= nil
end
local function repair(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= want and t ~= 'none' then redis.call('DEL', key) end
end
"""
)

# KEYS[1] entity hash. ARGV: base epoch, epoch, status, since, by, reason, channel, event.
# -> {1} applied, {0} absent (or invalid: the caller restores over it), {0, epoch, status,
# since, by, reason} stored.
TRANSITION_LUA = (
    PRELUDE_LUA
    + """
repair(KEYS[1], 'hash')
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'status', 'since', 'by', 'reason')
local valid = cur[1] and valid_entity(cur)
if (valid and tonumber(cur[1]) or 0) == tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'epoch', ARGV[2], 'since', ARGV[4],
             'by', ARGV[5], 'reason', ARGV[6])
  redis.call('PUBLISH', ARGV[7], ARGV[8])
  return {1}
end
if not valid then return {0} end
return {0, cur[1], cur[2] or '', cur[3] or '0', cur[4] or '', cur[5] or ''}
"""
)

# Restore-if-absent-or-older (what a resync writes back; an invalid hash counts as absent).
# Same ARGV as the transition minus the base epoch; "older" is `EntityState.newer_than`:
# lower epoch, or same epoch and less severe.
RESTORE_LUA = (
    PRELUDE_LUA
    + """
repair(KEYS[1], 'hash')
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'status', 'since', 'by', 'reason')
local apply = false
if not cur[1] or not valid_entity(cur) then
  apply = true
else
  local e, ne = tonumber(cur[1]), tonumber(ARGV[1])
  if ne > e or (ne == e and (sev[ARGV[2]] or 0) > (sev[cur[2]] or 0)) then
    apply = true
  end
end
if apply then
  redis.call('HSET', KEYS[1], 'status', ARGV[2], 'epoch', ARGV[1], 'since', ARGV[3],
             'by', ARGV[4], 'reason', ARGV[5])
  redis.call('PUBLISH', ARGV[6], ARGV[7])
  return {1}
end
return {0, cur[1], cur[2] or '', cur[3] or '0', cur[4] or '', cur[5] or ''}
"""
)

# KEYS[1] backlog hash. ARGV: until, px, by, reason, channel, event. The later `until` wins
# (an invalid one loses). -> {1} applied, {0, until, by, reason} stored (out at least as long).
DISABLE_LUA = (
    PRELUDE_LUA
    + """
repair(KEYS[1], 'hash')
local cur = redis.call('HMGET', KEYS[1], 'until', 'by', 'reason')
local u = valid_time(cur[1])
if u and u >= tonumber(ARGV[1]) then
  return {0, cur[1], cur[2] or '', cur[3] or ''}
end
redis.call('HSET', KEYS[1], 'until', ARGV[1], 'by', ARGV[3], 'reason', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[5], ARGV[6])
return {1}
"""
)

# KEYS[1] backlog hash. ARGV: channel, event. Published even if absent, so a replica that
# missed the disable's expiry still drops it. DEL takes a key of any type.
ENABLE_LUA = """
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""

# KEYS[1] lease. ARGV: replica, ttl ms. Take it if free, renew it only if we hold it.
ACQUIRE_LUA = (
    PRELUDE_LUA
    + """
repair(KEYS[1], 'string')
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
)

RELEASE_LUA = """
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
