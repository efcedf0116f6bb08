"""The Lua scripts: one atomic decision each.

Why Lua: every decision below reads a value and writes depending on it (is this sample already counted? is
the dataset still open? is this chunk's lease still ours?). Done as separate commands, two workers (or one
redis-py resend of a command whose reply was lost) could both see "not yet" and both write. A script runs
alone on the server, so each decision is taken exactly once.

Each script starts with a header naming its KEYS, ARGV and return value. Time comes from Redis (``TIME``),
never from a client's clock, so leases mean the same to every machine.
"""
from __future__ import annotations

# Shared by the scripts that change ``used``: close the dataset when the counter reaches its budget.
# Expects local ``meta`` (KEYS of the dataset hash) and ``used`` (number). Returns 1 if it closed it now.
_CLOSE_IF_SPENT = """
local function close_if_spent(meta, used)
  local budget = redis.call('HGET', meta, 'budget')
  if budget and budget ~= '' and used >= tonumber(budget) and redis.call('HGET', meta, 'status') == 'open' then
    local t = redis.call('TIME')
    redis.call('HSET', meta, 'status', 'closed', 'closed_at', t[1] .. '.' .. string.format('%06d', t[2]))
    return 1
  end
  return 0
end
"""

_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

SET_BUDGET = """
-- set_budget: store a dataset's budget and open or close it accordingly.
-- KEYS[1] meta hash, KEYS[2] used counter
-- ARGV[1] budget in tokens, or '' for unlimited
-- returns {status, used}
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('HSET', KEYS[1], 'budget', ARGV[1])
local status = 'open'
if ARGV[1] ~= '' and used >= tonumber(ARGV[1]) then status = 'closed' end
redis.call('HSET', KEYS[1], 'status', status)
return {status, used}
"""

START_CHUNK = _NOW_MS + """
-- start_chunk: a worker begins a chunk job; take its lease if the chunk is still live and the dataset open.
-- KEYS[1] meta hash, KEYS[2] chunks zset
-- ARGV[1] chunk id, ARGV[2] lease length (ms)
-- returns 'ok', 'revoked' (chunk discarded or reclaimed: do nothing) or 'closed' (dataset closed: the chunk
-- is dropped from the live set so its samples count as not held)
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 'revoked' end
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 'closed'
end
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), ARGV[1])
return 'ok'
"""

REFRESH_CHUNK = _NOW_MS + """
-- refresh_chunk: extend a running chunk's lease.
-- KEYS[1] chunks zset
-- ARGV[1] chunk id, ARGV[2] lease length (ms)
-- returns 1 if extended, 0 if the chunk is no longer ours (reclaimed after a missed lease, or discarded)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[2]), ARGV[1])
return 1
"""

ADMIT = """
-- admit: may this chunk start a request for this sample now?
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] pending hash, KEYS[4] done hash
-- ARGV[1] sample id, ARGV[2] chunk id
-- returns 1 start it; 0 dataset closed (start nothing more); -1 chunk revoked (start nothing more);
--         -2 skip this sample (already committed, or now held by another chunk)
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return 0 end
if not redis.call('ZSCORE', KEYS[2], ARGV[2]) then return -1 end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then return -2 end
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return -2 end
return 1
"""

COMMIT = _CLOSE_IF_SPENT + """
-- commit: record one response exactly once and count its tokens.
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash, KEYS[4] pending hash, KEYS[5] results stream,
-- KEYS[6] failed hash
-- ARGV[1] sample id, ARGV[2] completion tokens, ARGV[3] result JSON
-- returns {committed (1, or 0 for a duplicate that changed nothing), used after, closed now (1/0)}
-- A duplicate (RQ retry, a reclaimed chunk's zombie, a redis-py resend after a lost reply) hits the done
-- guard and changes nothing, so no token is ever counted twice and no line is ever written twice.
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return {0, tonumber(redis.call('GET', KEYS[2]) or '0'), 0}
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
local used = redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('XADD', KEYS[5], '*', 'id', ARGV[1], 'r', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'committed', 1)
return {1, used, close_if_spent(KEYS[1], used)}
"""

FAIL = """
-- fail: a sample failed every attempt (or got a final 400); record why, release it.
-- KEYS[1] done hash, KEYS[2] pending hash, KEYS[3] failed hash
-- ARGV[1] sample id, ARGV[2] chunk id, ARGV[3] reason JSON
-- returns 1 if recorded, 0 if the sample is committed or held by another chunk (then this failure is stale)
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
"""

DISCARD = """
-- discard: remove a closed dataset's queued chunks from the shared RQ queue so no worker can take them.
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] RQ queue list, KEYS[4] RQ canceled registry zset
-- ARGV[1] RQ job key prefix, ARGV[2] reason
-- returns the number of chunks discarded (0 when run again: safe to repeat)
-- Queued chunks are the live ones with score +inf. Their ids leave the list in one pass (LRANGE, filter,
-- rewrite: O(queue length), not one LREM per chunk), their job hashes are marked canceled with the reason
-- in the description and they join RQ's canceled registry, where rq-dashboard shows them. Other datasets'
-- jobs keep their order. A worker that popped one a moment ago finds it gone at start_chunk.
if redis.call('HGET', KEYS[1], 'status') == 'open' then return 0 end
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '+inf', '+inf')
if #ids == 0 then return 0 end
local drop = {}
for _, id in ipairs(ids) do drop[id] = true end
local queue = redis.call('LRANGE', KEYS[3], 0, -1)
local keep = {}
for _, id in ipairs(queue) do
  if not drop[id] then keep[#keep + 1] = id end
end
if #keep ~= #queue then
  redis.call('DEL', KEYS[3])
  for i = 1, #keep, 1000 do
    redis.call('RPUSH', KEYS[3], unpack(keep, i, math.min(i + 999, #keep)))
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1])
for i = 1, #ids, 1000 do
  redis.call('ZREM', KEYS[2], unpack(ids, i, math.min(i + 999, #ids)))
end
for _, id in ipairs(ids) do
  local key = ARGV[1] .. id
  if redis.call('EXISTS', key) == 1 then
    local desc = redis.call('HGET', key, 'description') or id
    redis.call('HSET', key, 'status', 'canceled', 'description', desc .. ' [discarded: ' .. ARGV[2] .. ']')
    redis.call('ZADD', KEYS[4], now, id)
  end
end
redis.call('HINCRBY', KEYS[1], 'discarded_chunks', #ids)
return #ids
"""

RECLAIM = _NOW_MS + """
-- reclaim: take back running chunks whose lease expired (their worker died or lost Redis).
-- KEYS[1] chunks zset
-- returns the reclaimed chunk ids; their samples are then held by nobody and the producer enqueues them
-- again. If the old worker was only slow, its later commits hit the done guard and its next admit fails.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now_ms())
for i = 1, #ids, 1000 do
  redis.call('ZREM', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
end
return ids
"""

RECONCILE = _CLOSE_IF_SPENT + """
-- reconcile: count responses found on disk (raw_responses.jsonl) that Redis does not know (a new Redis, or
-- a rerun after Redis lost data).
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash
-- ARGV pairs: sample id, completion tokens, ...
-- returns {added, tokens added, used after}
local added, tokens = 0, 0
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[3], ARGV[i], ARGV[i + 1]) == 1 then
    added = added + 1
    tokens = tokens + tonumber(ARGV[i + 1])
  end
end
local used = redis.call('INCRBY', KEYS[2], tokens)
close_if_spent(KEYS[1], used)
return {added, tokens, used}
"""

UNCOMMIT = """
-- uncommit: forget committed samples whose response exists nowhere any more (not on disk, not in the results
-- stream: the output file was deleted or replaced), so they are generated again instead of counted for
-- nothing. Reopens the dataset if that brings it back under its budget.
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash
-- ARGV sample ids
-- returns {removed, tokens removed, used after}
local removed, tokens = 0, 0
for _, id in ipairs(ARGV) do
  local n = redis.call('HGET', KEYS[3], id)
  if n then
    redis.call('HDEL', KEYS[3], id)
    removed = removed + 1
    tokens = tokens + tonumber(n)
  end
end
local used = redis.call('DECRBY', KEYS[2], tokens)
local budget = redis.call('HGET', KEYS[1], 'budget')
if removed > 0 and (not budget or budget == '' or used < tonumber(budget)) then
  redis.call('HSET', KEYS[1], 'status', 'open')
end
return {removed, tokens, used}
"""

LOCK_REFRESH = """
-- lock_refresh: extend a lock only if we still hold it.
-- KEYS[1] lock key; ARGV[1] our token, ARGV[2] ttl (ms)
-- returns 1 if extended, 0 if the lock is gone or someone else's
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

LOCK_RELEASE = """
-- lock_release: delete a lock only if we hold it.
-- KEYS[1] lock key; ARGV[1] our token
-- returns 1 if released
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
