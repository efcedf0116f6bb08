"""The Lua scripts: one atomic decision each.

Why Lua: every decision below reads a value and writes depending on it (is this sample already counted? is
the dataset still open? is this chunk's lease still ours?). Done as separate commands, two workers (or one
redis-py resend of a command whose reply was lost) could both see "not yet" and both write. A script runs
alone on the server, so each decision is taken exactly once.

Each script starts with a header naming its KEYS, ARGV and return value. Time comes from Redis (``TIME``),
never from a client's clock, so leases mean the same to every machine. Each is called through one typed
method: budget/ledger.py's, and budget/runstate.py's for the collector lock.

One module on purpose, though it is long (nearly all of it Lua): it is one concept and reads top to bottom in
the order of a dataset's life: the shared fragments; the budget (SET_BUDGET, CLOSE); a chunk's lease
(START_CHUNK, REFRESH_CHUNK, JOB_META, LENGTH_SAMPLE, FINISH_CHUNK); a request (ADMIT, COMMIT); a conversation's
turns (COMMIT_TURN, ADMIT_TURN, END_CONVERSATION, RECONCILE_TURNS, REOPEN); a failure (FAIL); the close
(DISCARD, MARK_DISCARDED); recovery (RECLAIM, RECLAIM_QUEUED, RECONCILE, UNCOMMIT); the collector lock
(LOCK_REFRESH, LOCK_RELEASE). The fragments are pasted into several scripts, so a split would put a decision
and the fragment it relies on in different files.
"""
from __future__ import annotations

from budget.keys import TURN_BUCKETS

# The last turn bucket (budget/keys.py TURN_BUCKETS): turn j's lengths go to lengths:min(j, LAST_BUCKET), one list
# per bucket. Pasted as a Lua local into the scripts that pick a bucket, so the count is written in one place.
_BUCKETS = f"""
local LAST_BUCKET = {TURN_BUCKETS - 1}
"""

# Shared by the scripts that change ``used``. ``spent``: may nothing more start? In drain and predict a dataset
# is spent when used reaches the budget; in strict when even one more request of max_new_tokens would not fit.
# ``close_if_spent`` closes an open dataset that is spent and returns 1 if it closed it now.
_CLOSE_IF_SPENT = """
local function spent(meta, used)
  local budget = redis.call('HGET', meta, 'budget')
  if not budget or budget == '' then return false end
  budget = tonumber(budget)
  if redis.call('HGET', meta, 'mode') == 'strict' then
    return used + tonumber(redis.call('HGET', meta, 'max_new_tokens') or '0') > budget
  end
  return used >= budget
end
local function close_if_spent(meta, used)
  if redis.call('HGET', meta, 'status') == 'open' and spent(meta, used) then
    local t = redis.call('TIME')
    redis.call('HSET', meta, 'status', 'closed', 'closed_at', t[1] .. '.' .. string.format('%06d', t[2]))
    return 1
  end
  return 0
end
"""

# The deadline (meta ``deadline``, unix ms; docs/mix.md): ``past_deadline(meta, ms)`` closes an open dataset whose
# request of ``ms`` milliseconds could not end by it (``closed_by`` deadline) and returns true if it is past.
_DEADLINE = """
local function past_deadline(meta, ms)
  local deadline = redis.call('HGET', meta, 'deadline')
  if not deadline or deadline == '' then return false end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if now + ms < tonumber(deadline) then return false end
  if redis.call('HGET', meta, 'status') == 'open' then
    redis.call('HSET', meta, 'status', 'closed', 'closed_at', t[1] .. '.' .. string.format('%06d', t[2]),
               'closed_by', 'deadline')
  end
  return true
end
"""

_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

_RESERVED = """
local function reserved(resv)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', resv)) do total = total + tonumber(v) end
  return total
end
"""

SET_BUDGET = _CLOSE_IF_SPENT + """
-- set_budget: store a dataset's budget and open or close it accordingly (raising reopens, lowering to what is
-- spent closes at once, anything between tightens admission through the admit script).
-- KEYS[1] meta hash, KEYS[2] used counter
-- ARGV[1] budget in tokens, or '' for unlimited
-- returns {status, used}
-- Also the meta field cut (docs/multiturn.md): set when the budget is lowered to <= used (admit_turn then
-- stops every started conversation), deleted when the budget is removed or set above used; setting the same
-- budget again (a rerun's attach) leaves it as it is, so a drained dataset's conversations still finish.
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local old = redis.call('HGET', KEYS[1], 'budget')
if ARGV[1] == '' or tonumber(ARGV[1]) > used then
  redis.call('HDEL', KEYS[1], 'cut')
elseif old ~= false and (old == '' or tonumber(ARGV[1]) < tonumber(old)) then
  redis.call('HSET', KEYS[1], 'cut', 1)
end
redis.call('HSET', KEYS[1], 'budget', ARGV[1])
local status = 'open'
if spent(KEYS[1], used) then status = 'closed' end
redis.call('HSET', KEYS[1], 'status', status)
if status == 'open' then redis.call('HDEL', KEYS[1], 'closed_by') end
return {status, used}
"""

CLOSE = """
-- close: close a dataset whatever its budget says (--new-run closes the old run before it discards and forgets
-- it), recording when, as a commit that reaches the budget does.
-- KEYS[1] meta hash
-- returns 1 if it was open, 0 if it was already closed (or never set up)
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'status', 'closed') end
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'status', 'closed', 'closed_at', t[1] .. '.' .. string.format('%06d', t[2]))
return 1
"""

START_CHUNK = _NOW_MS + """
-- start_chunk: a worker begins a chunk job; take its lease if the chunk is still live and the dataset open.
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] reservations hash, KEYS[4] in-flight hash
-- ARGV[1] chunk id, ARGV[2] lease length (ms)
-- returns 'ok', 'revoked' (chunk discarded or reclaimed: do nothing) or 'closed' (dataset closed: the chunk
-- is dropped from the live set so its samples count as not held)
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 'revoked' end
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 'closed'
end
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], 0)
redis.call('HSET', KEYS[4], ARGV[1], 0)
return 'ok'
"""

REFRESH_CHUNK = _NOW_MS + """
-- refresh_chunk: extend a running chunk's lease and restate what its requests in flight reserve and how far
-- they have got (predict's length model counts running requests as "at least this long").
-- KEYS[1] chunks zset, KEYS[2] reservations hash, KEYS[3] progress hash
-- ARGV[1] chunk id, ARGV[2] lease length (ms), ARGV[3] tokens reserved by the chunk now, or '' to keep,
-- ARGV[4] JSON list of its running requests' progress in tokens, or '' to keep; ARGV[5..8] optional, with
-- ARGV[4]: the progress of its conversations' running turns, by turn bucket 0..3 (JSON lists), kept in the
-- fields '{chunk}\\31{bucket}' (ARGV[4] then holds its one-turn requests only, so a reader summing every
-- field of the hash sees each running request once)
-- returns 1 if extended, 0 if the chunk is no longer ours (reclaimed after a missed lease, or discarded)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[2]), ARGV[1])
if ARGV[3] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  if ARGV[4] ~= '' then
    redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
    for i = 5, #ARGV do redis.call('HSET', KEYS[3], ARGV[1] .. '\\31' .. (i - 5), ARGV[i]) end
  end
end
return 1
"""

# The progress hash's fields of one chunk: its own (one-turn requests) and one per turn bucket of its conversations
# (refresh_chunk); whoever drops a chunk's progress drops them all.
_PROGRESS_FIELDS = _BUCKETS + """
local function progress_fields(ids)
  local out = {}
  for _, id in ipairs(ids) do
    out[#out + 1] = id
    for b = 0, LAST_BUCKET do out[#out + 1] = id .. '\\31' .. b end
  end
  return out
end
"""

JOB_META = """
-- job_meta: copy a chunk's progress into its RQ job's meta field (rq-dashboard's job page shows it).
-- KEYS[1] the RQ job hash
-- ARGV[1] the meta, JSON as RQ's JSONSerializer writes it
-- returns 1 if written, 0 if the job hash is gone (an HSET would leave a stub hash without a TTL)
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'meta', ARGV[1])
return 1
"""

LENGTH_SAMPLE = _BUCKETS + """
-- length_sample: what predict's length model learns from, read at one instant (a script, not a pipeline, so
-- that it rides in the worker's batches like every other ledger call: worker/batch.py).
-- KEYS[1] lengths list, KEYS[2] progress hash, KEYS[3] meta hash, KEYS[4..] optional: the per-turn lengths lists
-- (lengths:0 .. lengths:LAST_BUCKET) then the stats hash
-- returns {the recent completion lengths, the progress hash's values (JSON lists),
--          {prior_mean, max_new_tokens, mode} (nil where unset)[, each per-turn list, the stats hash's
--          reached:{j} and offered:{j} fields for j = 1..LAST_BUCKET as a flat field/value list, the progress hash's
--          fields and values as a flat list (a field '{chunk}\\31{b}' holds turn bucket b's running turns)]};
-- reads only
local out = {redis.call('LRANGE', KEYS[1], 0, -1), redis.call('HVALS', KEYS[2]),
             redis.call('HMGET', KEYS[3], 'prior_mean', 'max_new_tokens', 'mode')}
if #KEYS > 3 then
  for i = 4, #KEYS - 1 do out[#out + 1] = redis.call('LRANGE', KEYS[i], 0, -1) end
  local names = {}
  for j = 1, LAST_BUCKET do
    names[#names + 1] = 'reached:' .. j
    names[#names + 1] = 'offered:' .. j
  end
  local values = redis.call('HMGET', KEYS[#KEYS], unpack(names))
  local counts = {}
  for i = 1, #names do
    counts[#counts + 1] = names[i]
    counts[#counts + 1] = values[i] or '0'
  end
  out[#out + 1] = counts
  out[#out + 1] = redis.call('HGETALL', KEYS[2])
end
return out
"""

FINISH_CHUNK = _PROGRESS_FIELDS + """
-- finish_chunk: a chunk's job is over; it is no longer live and reserves nothing.
-- KEYS[1] chunks zset, KEYS[2] reservations hash, KEYS[3] in-flight hash, KEYS[4] progress hash, KEYS[5] stats
-- ARGV[1] chunk id, ARGV[2] the milliseconds its requests ran, summed (start to answer), ARGV[3] the
-- milliseconds of the servers' busy time they took (their share: the GPU time)
-- returns 1
-- Both times go to stats (request_ms, server_ms) once: only while the chunk is still live, so a resend after a
-- lost reply adds nothing (a chunk reclaimed from its worker is not live either: its requests' time is not counted).
local chunk, request_ms, server_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('ZREM', KEYS[1], chunk) == 1 then
  if request_ms > 0 then redis.call('HINCRBY', KEYS[5], 'request_ms', request_ms) end
  if server_ms > 0 then redis.call('HINCRBY', KEYS[5], 'server_ms', server_ms) end
end
redis.call('HDEL', KEYS[2], chunk)
redis.call('HDEL', KEYS[3], chunk)
redis.call('HDEL', KEYS[4], unpack(progress_fields({chunk})))
return 1
"""

ADMIT = _CLOSE_IF_SPENT + _RESERVED + _DEADLINE + """
-- admit: may this chunk start requests for these samples now, and what does each reserve?
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] pending hash, KEYS[4] done hash, KEYS[5] used counter,
-- KEYS[6] reservations hash, KEYS[7] in-flight hash
-- ARGV[1] chunk id, ARGV[2] expected completion tokens (the predict reservation), ARGV[3] predict's safety
-- margin per sqrt(request in flight), in tokens (k x the length's standard deviation), ARGV[4] predict's taper
-- margin per sqrt(request in flight), in tokens (t x sd; 0 = no taper), ARGV[5] the milliseconds a request is
-- expected to take at this worker's speed (0: not known yet), ARGV[6..] sample ids, decided in order, each as if
-- admitted alone after the ones before it
-- returns {verdict, reserved, verdict, reserved, ...}, one pair per sample, up to and including the first
-- verdict that stops the chunk (0, -1 or -3): the samples after it were not looked at and share that verdict.
-- verdict 1 start it; 0 dataset closed (start nothing more); -1 chunk revoked (start nothing more); -2 skip
-- this sample (already committed, or held by another chunk); -3 full (the budget is reserved by requests in
-- flight: start nothing now, the dataset is still open)
-- Modes: drain reserves nothing; predict starts while used + reserved + margin < budget and reserves the
-- expected length, where margin = ARGV[3] x sqrt(requests in flight): the sum of running requests' lengths is
-- uncertain, and admitting whenever the estimate dips below the budget would lock in its low swings (a
-- winner's curse); the margin shrinks to 0 as the dataset drains, so predict still reaches its budget.
-- The taper (ARGV[4] > 0) adds: while any request of the dataset is in flight, a new one starts only if it fits
-- too, with the spread of what would then be in flight: used + reserved + expected + ARGV[4] x sqrt(in flight
-- + 1) <= budget. Near the close fewer start, so the batch drains instead of refilling; an idle dataset under
-- its budget still starts one (docs/budget.md, "The taper").
-- strict reserves max_new_tokens and starts only while that fits, closing when nothing can.
-- A deadline (meta deadline) closes the dataset at the first request that could not end by it: what runs
-- finishes, nothing more starts.
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return {0, 0} end
if past_deadline(KEYS[1], tonumber(ARGV[5])) then return {0, 0} end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {-1, 0} end
local mode = redis.call('HGET', KEYS[1], 'mode') or 'drain'
local budget = redis.call('HGET', KEYS[1], 'budget')
local budgeted = budget and budget ~= '' and mode ~= 'drain'
local used, held, running, res = 0, 0, 0, 0
if budgeted then
  budget = tonumber(budget)
  used = tonumber(redis.call('GET', KEYS[5]) or '0')
  held = reserved(KEYS[6])
  if mode == 'strict' then
    res = tonumber(redis.call('HGET', KEYS[1], 'max_new_tokens'))
    if close_if_spent(KEYS[1], used) == 1 then return {0, 0} end
  else
    res = tonumber(ARGV[2])
    for _, v in ipairs(redis.call('HVALS', KEYS[7])) do running = running + tonumber(v) end
  end
end
local taper = tonumber(ARGV[4])
local out, started = {}, 0
for i = 6, #ARGV do
  local sample = ARGV[i]
  if redis.call('HEXISTS', KEYS[4], sample) == 1 or redis.call('HGET', KEYS[3], sample) ~= ARGV[1] then
    out[#out + 1] = -2
    out[#out + 1] = 0
  else
    if budgeted then
      local full
      if mode == 'strict' then full = used + held + res > budget
      else
        full = used + held + tonumber(ARGV[3]) * math.sqrt(running) >= budget
        if not full and taper > 0 and running > 0 then
          full = used + held + res + taper * math.sqrt(running + 1) > budget
        end
      end
      if full then
        out[#out + 1] = -3
        out[#out + 1] = 0
        break
      end
    end
    held = held + res
    running = running + 1
    started = started + 1
    out[#out + 1] = 1
    out[#out + 1] = res
  end
end
if started > 0 then
  redis.call('HINCRBY', KEYS[6], ARGV[1], res * started)
  redis.call('HINCRBY', KEYS[7], ARGV[1], started)
end
return out
"""

# Shared by commit and fail: the request ended; give back what it reserved. A chunk no longer in the in-flight
# hash lost its lease while the request ran (its reservation was dropped by reclaim): the request is "late".
_RECORD = """
local function record(lengths, stats, tokens, finish, bucket, late)
  -- a committed response's (or turn's) share of the stats: its length for predict's model, its finish reason,
  -- the tokens of its 10-second bucket, and whether it came in after its chunk had lost its lease
  redis.call('LPUSH', lengths, tokens)
  redis.call('HINCRBY', stats, 'finish_' .. finish, 1)
  redis.call('HINCRBY', stats, bucket, tokens)
  if late == 1 then
    redis.call('HINCRBY', stats, 'late', 1)
    redis.call('HINCRBY', stats, 'late_tokens', tokens)
  end
end
"""

# Shared by commit and commit_turn: one response's (or turn's) four reply values, appended to the flat reply.
_REPLY = """
local function reply(out, verdict, used, closed, late)
  out[#out + 1] = verdict
  out[#out + 1] = used
  out[#out + 1] = closed
  out[#out + 1] = late
end
"""

_SETTLE = """
local function settle(resv, inflight, chunk, reservation)
  if redis.call('HEXISTS', inflight, chunk) == 1 then
    redis.call('HINCRBY', inflight, chunk, -1)
    redis.call('HINCRBY', resv, chunk, 0 - tonumber(reservation))  -- never -0: HINCRBY refuses it
    return 0
  end
  return 1
end
"""

COMMIT = _CLOSE_IF_SPENT + _SETTLE + _RECORD + _REPLY + """
-- commit: record responses exactly once each, count their tokens, settle their reservations.
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash, KEYS[4] pending hash, KEYS[5] results stream,
-- KEYS[6] failed hash, KEYS[7] reservations hash, KEYS[8] in-flight hash, KEYS[9] lengths list,
-- KEYS[10] stats hash
-- ARGV: one group of 6 per response, committed in order, each as if alone: sample id, completion tokens,
-- result JSON, chunk id, tokens the request reserved, finish reason
-- returns per response {committed (1, or 0 for a duplicate that changed nothing), used after, closed now
-- (1/0), late (1/0)}, flattened
-- A duplicate (RQ retry, a reclaimed chunk's zombie, a redis-py resend after a lost reply) hits the done
-- guard and changes nothing, so no token is ever counted twice and no line is ever written twice.
local out = {}
local t = redis.call('TIME')
local bucket = 't:' .. math.floor(tonumber(t[1]) / 10)
for g = 0, #ARGV / 6 - 1 do
  local sample, tokens, result, chunk, reserved, finish = unpack(ARGV, g * 6 + 1, g * 6 + 6)
  tokens = tonumber(tokens)
  local late = settle(KEYS[7], KEYS[8], chunk, reserved)
  if redis.call('HEXISTS', KEYS[3], sample) == 1 then
    reply(out, 0, tonumber(redis.call('GET', KEYS[2]) or '0'), 0, late)
  else
    redis.call('HSET', KEYS[3], sample, tokens)
    local used = redis.call('INCRBY', KEYS[2], tokens)
    redis.call('HDEL', KEYS[4], sample)
    redis.call('HDEL', KEYS[6], sample)
    redis.call('XADD', KEYS[5], '*', 'id', sample, 'r', result)
    redis.call('HINCRBY', KEYS[1], 'committed', 1)
    record(KEYS[9], KEYS[10], tokens, finish, bucket, late)
    reply(out, 1, used, close_if_spent(KEYS[1], used), late)
  end
end
redis.call('LTRIM', KEYS[9], 0, 4095)
return out
"""

COMMIT_TURN = _BUCKETS + _CLOSE_IF_SPENT + _SETTLE + _RECORD + _REPLY + """
-- commit_turn: record one turn of a multi-turn conversation exactly once, keyed by (sample, turn); count its
-- tokens; settle its reservation (docs/multiturn.md). The conversation's record is written when it ends: until
-- then the turn's record stays here, durable, and counts in used (used = sum of done + sum of turns).
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash, KEYS[4] turns hash, KEYS[5] turn records hash,
-- KEYS[6] conversations hash, KEYS[7] reservations hash, KEYS[8] in-flight hash, KEYS[9] lengths list,
-- KEYS[10] stats hash, KEYS[11 ..] optional: the per-turn lengths lists lengths:0 .. lengths:LAST_BUCKET (turn i's
-- length goes to lengths:min(i, LAST_BUCKET) too: predict's per-turn model, worker/estimate.py TurnModels)
-- ARGV: one group of 7 per turn, committed in order, each as if alone: sample key, turn index (0-based),
-- completion tokens, turn record JSON, chunk id, tokens the request reserved, finish reason
-- returns per turn {verdict, used after, closed now (1/0), late (1/0)}, flattened. verdict 1: committed;
-- 0: duplicate (this turn is committed already, or its conversation is written: in done), nothing changed;
-- -1: out of order (the conversation has not exactly this many turns committed: the turn was generated on a
-- history that is not the committed one), nothing changed. Whatever the verdict the request has ended, so its
-- reservation is settled, as commit does.
-- A turn's field is its index in decimal, byte 0x1f, the sample key (budget/keys.py turn_field): the digits
-- come first, so it splits at the first 0x1f whatever the sample key holds. A duplicate (RQ retry, a reclaimed
-- chunk's zombie, a redis-py resend after a lost reply) hits the field and changes nothing: no turn is counted
-- twice, and the first committed record of a turn is the one kept.
local out = {}
local t = redis.call('TIME')
local bucket = 't:' .. math.floor(tonumber(t[1]) / 10)
for g = 0, #ARGV / 7 - 1 do
  local sample, turn, tokens, turn_record, chunk, reserved, finish = unpack(ARGV, g * 7 + 1, g * 7 + 7)
  turn, tokens = tonumber(turn), tonumber(tokens)
  local late = settle(KEYS[7], KEYS[8], chunk, reserved)
  local field = string.format('%d', turn) .. '\\31' .. sample
  local verdict = 1
  if redis.call('HEXISTS', KEYS[3], sample) == 1 or redis.call('HEXISTS', KEYS[4], field) == 1 then
    verdict = 0
  elseif tonumber(redis.call('HGET', KEYS[6], sample) or '0') ~= turn then
    verdict = -1
  end
  if verdict ~= 1 then
    reply(out, verdict, tonumber(redis.call('GET', KEYS[2]) or '0'), 0, late)
  else
    redis.call('HSET', KEYS[4], field, tokens)
    redis.call('HSET', KEYS[5], field, turn_record)
    redis.call('HSET', KEYS[6], sample, turn + 1)
    local used = redis.call('INCRBY', KEYS[2], tokens)
    redis.call('HINCRBY', KEYS[10], 'turns', 1)
    record(KEYS[9], KEYS[10], tokens, finish, bucket, late)
    if #KEYS >= 11 + LAST_BUCKET then
      local per_turn = KEYS[11 + math.min(turn, LAST_BUCKET)]
      redis.call('LPUSH', per_turn, tokens)
      redis.call('LTRIM', per_turn, 0, 4095)
    end
    reply(out, 1, used, close_if_spent(KEYS[1], used), late)
  end
end
redis.call('LTRIM', KEYS[9], 0, 4095)
return out
"""

ADMIT_TURN = _CLOSE_IF_SPENT + _RESERVED + _DEADLINE + """
-- admit_turn: may turn i > 0 of a started conversation start now, and what does it reserve? (docs/multiturn.md)
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] pending hash, KEYS[4] done hash, KEYS[5] conversations hash,
-- KEYS[6] used counter, KEYS[7] reservations hash, KEYS[8] in-flight hash
-- ARGV[1] chunk id, ARGV[2] sample key, ARGV[3] turn index (>= 1), ARGV[4] tokens the turn reserves in predict
-- mode (the caller's expectation; drain and an unlimited budget reserve nothing, strict max_new_tokens),
-- ARGV[5] how long the turn may take, ms (one that could not end by the deadline stops the conversation)
-- returns {verdict, reserved}. verdict 1 start it; 0 stop the conversation with stopped_by budget (the budget
-- was lowered to <= used: meta cut; or strict, and the turn cannot fit even alone); -1 chunk revoked (start
-- nothing more); -2 skip (the conversation is not this chunk's, is written, or has not exactly this many
-- turns committed: someone else carries it on); -3 full (strict: the budget is reserved by requests in
-- flight; wait, the turn may fit once they commit)
-- Unlike admit, a closed dataset does not refuse: closed means no new conversation starts, while a started
-- one is finished (drain, predict) or stopped only when it cannot fit (strict), so its turns so far are kept.
-- A start is booked in resv/inflight exactly as admit books it, so commit_turn's settle gives it back.
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {-1, 0} end
local sample = ARGV[2]
if redis.call('HEXISTS', KEYS[4], sample) == 1 or redis.call('HGET', KEYS[3], sample) ~= ARGV[1]
    or tonumber(redis.call('HGET', KEYS[5], sample) or '0') ~= tonumber(ARGV[3]) then
  return {-2, 0}
end
if redis.call('HEXISTS', KEYS[1], 'cut') == 1 then return {0, 0} end
if past_deadline(KEYS[1], tonumber(ARGV[5])) then return {0, 0} end  -- nor one that could not end by it
local mode = redis.call('HGET', KEYS[1], 'mode') or 'drain'
local budget = redis.call('HGET', KEYS[1], 'budget')
local res = 0
if budget and budget ~= '' and mode ~= 'drain' then
  budget = tonumber(budget)
  if mode == 'strict' then
    res = tonumber(redis.call('HGET', KEYS[1], 'max_new_tokens') or '0')
    local used = tonumber(redis.call('GET', KEYS[6]) or '0')
    if used + res > budget then
      close_if_spent(KEYS[1], used)
      return {0, 0}
    end
    if used + reserved(KEYS[7]) + res > budget then return {-3, 0} end
  else
    res = tonumber(ARGV[4])
  end
end
redis.call('HINCRBY', KEYS[7], ARGV[1], res)
redis.call('HINCRBY', KEYS[8], ARGV[1], 1)
return {1, res}
"""

END_CONVERSATION = _BUCKETS + """
-- end_conversation: a conversation is over; hand its record to the collector, once (docs/multiturn.md).
-- KEYS[1] meta hash, KEYS[2] done hash, KEYS[3] turns hash, KEYS[4] turn records hash, KEYS[5] conversations
-- hash, KEYS[6] pending hash, KEYS[7] results stream, KEYS[8] stats hash
-- ARGV[1] sample key, ARGV[2] turns it ends with (k >= 1: the turns committed), ARGV[3] the record's header JSON
-- (stopped_by, incomplete, ...: everything but the turns), ARGV[4] optional: the turns it planned, when it ended
-- for a reason of the data (0 or missing: it says nothing of how far conversations go; a budget stop, a failure)
-- returns {verdict, tokens}. 1: ended; done[sample] = tokens = the sum of its turns' tokens, one results entry
-- XADDed with fields id, r (the header) and t0 .. t{k-1} (each turn's committed record, verbatim: no JSON in
-- Lua), its turn fields and conversations entry deleted, the sample released from pending. 0: already ended
-- (in done): nothing changed, tokens = its done value. -1: the conversation has not exactly k turns committed
-- (a stale caller's view): nothing changed, tokens = the turns committed.
-- used does not move: the turns were counted by commit_turn; their tokens move from turns to done, so
-- used = sum of done + sum of turns holds before and after. A resend, an RQ retry or a racing zombie hits the
-- done guard, so a conversation is written once.
-- With ARGV[4] = P planned turns, the share of conversations that go on is counted for predict's per-turn model:
-- for each later turn j = 1 .. P-1 (bucket min(j, LAST_BUCKET)), offered:{b} += 1 when it reached turn j-1 (k >= j),
-- reached:{b} += 1 when it reached turn j (k >= j + 1), in the stats hash.
local sample, k = ARGV[1], tonumber(ARGV[2])
local prior = redis.call('HGET', KEYS[2], sample)
if prior then return {0, tonumber(prior)} end
local have = tonumber(redis.call('HGET', KEYS[5], sample) or '0')
if have ~= k or k < 1 then return {-1, have} end
local fields, entry, tokens = {}, {'id', sample, 'r', ARGV[3]}, 0
for t = 0, k - 1 do
  local field = string.format('%d', t) .. '\\31' .. sample
  local n = redis.call('HGET', KEYS[3], field)
  local rec = redis.call('HGET', KEYS[4], field)
  if not n or not rec then return {-1, have} end
  tokens = tokens + tonumber(n)
  fields[#fields + 1] = field
  entry[#entry + 1] = 't' .. t
  entry[#entry + 1] = rec
end
redis.call('XADD', KEYS[7], '*', unpack(entry))
redis.call('HSET', KEYS[2], sample, tokens)
redis.call('HDEL', KEYS[3], unpack(fields))
redis.call('HDEL', KEYS[4], unpack(fields))
redis.call('HDEL', KEYS[5], sample)
redis.call('HDEL', KEYS[6], sample)
redis.call('HINCRBY', KEYS[1], 'committed', 1)
redis.call('HINCRBY', KEYS[8], 'conversations', 1)
local planned = tonumber(ARGV[4] or '0') or 0
for j = 1, planned - 1 do
  if k < j then break end
  local b = math.min(j, LAST_BUCKET)
  redis.call('HINCRBY', KEYS[8], 'offered:' .. b, 1)
  if k >= j + 1 then redis.call('HINCRBY', KEYS[8], 'reached:' .. b, 1) end
end
return {1, tokens}
"""

RECONCILE_TURNS = _CLOSE_IF_SPENT + """
-- reconcile_turns: conversations whose record is on disk (the file is the truth) but whose turns are still in
-- Redis, as committed and unwritten (Redis restored from a copy older than the write): drop those turns and
-- take their tokens out of used, which reconcile already made count the record (docs/multiturn.md).
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash, KEYS[4] turns hash, KEYS[5] turn records hash,
-- KEYS[6] conversations hash
-- ARGV sample keys found on disk
-- returns {conversations cleaned, tokens removed, used after}
-- Only a sample in done is cleaned (reconcile runs first and counts the file's record there); a conversation
-- reopened for a rerun (reopen: out of done, its turns back in turns) is left to finish. Run again, it finds
-- nothing more to drop.
local cleaned, tokens = 0, 0
for _, sample in ipairs(ARGV) do
  local n = tonumber(redis.call('HGET', KEYS[6], sample) or '0')
  if n > 0 and redis.call('HEXISTS', KEYS[3], sample) == 1 then
    for t = 0, n - 1 do
      local field = string.format('%d', t) .. '\\31' .. sample
      tokens = tokens + tonumber(redis.call('HGET', KEYS[4], field) or '0')
      redis.call('HDEL', KEYS[4], field)
      redis.call('HDEL', KEYS[5], field)
    end
    redis.call('HDEL', KEYS[6], sample)
    cleaned = cleaned + 1
  end
end
local used = redis.call('DECRBY', KEYS[2], tokens)
if cleaned > 0 and not spent(KEYS[1], used) and redis.call('HGET', KEYS[1], 'status') == 'closed' then
  redis.call('HSET', KEYS[1], 'status', 'open')
end
return {cleaned, tokens, used}
"""

REOPEN = """
-- reopen: a rerun carries on a conversation whose record on disk ended stopped_by failed: its turns on disk
-- become committed and unwritten again, so it resumes at the failed turn and its new record supersedes
-- (docs/multiturn.md).
-- KEYS[1] used counter, KEYS[2] done hash, KEYS[3] turns hash, KEYS[4] turn records hash, KEYS[5]
-- conversations hash
-- ARGV[1] sample key, then one pair per turn of its record, in order: completion tokens, turn record JSON
-- returns {verdict, turns committed}. 1: reopened; its done entry is gone and its k turns are in turns, turnrec
-- and convs = k. 0: not reopened, nothing changed: not in done (never written, or reopened already: a resend)
-- or its turns already in Redis. -1: the turns' tokens do not add up to its done value (another record than
-- the one counted), nothing changed.
-- used does not move: the tokens move from done to turns, so used = sum of done + sum of turns holds.
local sample = ARGV[1]
local d = redis.call('HGET', KEYS[2], sample)
if not d or redis.call('HEXISTS', KEYS[5], sample) == 1 then
  return {0, tonumber(redis.call('HGET', KEYS[5], sample) or '0')}
end
local k = (#ARGV - 1) / 2
local tokens = 0
for t = 0, k - 1 do tokens = tokens + tonumber(ARGV[2 + 2 * t]) end
if k < 1 or tokens ~= tonumber(d) then return {-1, 0} end
for t = 0, k - 1 do
  local field = string.format('%d', t) .. '\\31' .. sample
  redis.call('HSET', KEYS[3], field, ARGV[2 + 2 * t])
  redis.call('HSET', KEYS[4], field, ARGV[3 + 2 * t])
end
redis.call('HSET', KEYS[5], sample, k)
redis.call('HDEL', KEYS[2], sample)
return {1, k}
"""

FAIL = _SETTLE + """
-- fail: a sample failed every attempt (or got a final 400); settle its reservation, record why, release it.
-- KEYS[1] done hash, KEYS[2] pending hash, KEYS[3] failed hash, KEYS[4] reservations hash, KEYS[5] in-flight
-- ARGV[1] sample id, ARGV[2] chunk id, ARGV[3] reason JSON, ARGV[4] tokens the request reserved
-- returns 1 if recorded, 0 if the sample is committed or held by another chunk (then this failure is stale)
settle(KEYS[4], KEYS[5], ARGV[2], ARGV[4])
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
"""

DISCARD = """
-- discard: remove a closed dataset's queued chunks from the shared RQ queue so no worker can take them.
-- KEYS[1] meta hash, KEYS[2] chunks zset, KEYS[3] RQ queue list, KEYS[4] discarded list (ids still to mark)
-- returns the number of chunks discarded (0 when run again: safe to repeat)
-- Queued chunks are the live ones with score +inf. Their ids leave the list in one pass (LRANGE, filter,
-- rewrite: O(queue length), not one LREM per chunk); other datasets' jobs keep their order. A worker that
-- popped one a moment ago finds it gone at start_chunk. Marking their RQ job hashes canceled is per-job work
-- that no worker waits on, so it is not done here: the ids go to KEYS[4] for mark_discarded, in small calls
-- that leave Redis free for the workers' commits in between (one script over 10,000 jobs held it ~150 ms).
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
for i = 1, #ids, 1000 do
  local j = math.min(i + 999, #ids)
  redis.call('ZREM', KEYS[2], unpack(ids, i, j))
  redis.call('RPUSH', KEYS[4], unpack(ids, i, j))
end
redis.call('HINCRBY', KEYS[1], 'discarded_chunks', #ids)
return #ids
"""

MARK_DISCARDED = """
-- mark_discarded: show up to ARGV[4] discarded chunks as canceled in RQ, where rq-dashboard lists them.
-- KEYS[1] the dataset's discarded list (from discard), KEYS[2] RQ canceled registry zset
-- ARGV[1] RQ job key prefix, ARGV[2] reason, ARGV[3] seconds the canceled job hashes are kept (RQ never cleans
-- its canceled registry: without a TTL a discarded chunk's prompts would stay in Redis for good),
-- ARGV[4] how many to mark in this call
-- returns how many are left to mark (call again until 0)
-- Each job hash gets status canceled and the reason appended to its description; a hash that is gone (the
-- job was deleted) is skipped. Popping and marking happen in one script, so a crash never leaves an id
-- popped and unmarked.
local ids = redis.call('LPOP', KEYS[1], tonumber(ARGV[4]))
if not ids then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1])
local keep_s = tonumber(ARGV[3])
local suffix = ' [discarded: ' .. ARGV[2] .. ']'
local canceled = {}
for _, id in ipairs(ids) do
  local key = ARGV[1] .. id
  local desc = redis.call('HGET', key, 'description')  -- nil: the job hash is gone, nothing to show
  if desc then
    redis.call('HSET', key, 'status', 'canceled', 'description', desc .. suffix)
    redis.call('EXPIRE', key, keep_s)
    canceled[#canceled + 1] = now
    canceled[#canceled + 1] = id
  end
end
if #canceled > 0 then redis.call('ZADD', KEYS[2], unpack(canceled)) end
return redis.call('LLEN', KEYS[1])
"""

RECLAIM = _NOW_MS + _PROGRESS_FIELDS + """
-- reclaim: take back running chunks whose lease expired (their worker died or lost Redis).
-- KEYS[1] chunks zset, KEYS[2] reservations hash, KEYS[3] in-flight hash, KEYS[4] progress hash
-- returns the reclaimed chunk ids; their samples are then held by nobody and the producer enqueues them
-- again; their reservations are dropped, so a dead worker never keeps budget reserved. If the old worker was
-- only slow, its later commits hit the done guard (and count as late) and its next admit fails.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now_ms())
for i = 1, #ids, 1000 do
  local part = {unpack(ids, i, math.min(i + 999, #ids))}
  redis.call('ZREM', KEYS[1], unpack(part))
  redis.call('HDEL', KEYS[2], unpack(part))
  redis.call('HDEL', KEYS[3], unpack(part))
  redis.call('HDEL', KEYS[4], unpack(progress_fields(part)))
end
return ids
"""

RECLAIM_QUEUED = """
-- reclaim_queued: take back queued chunks that no worker will ever start: their RQ job is gone or ended
-- (failed, finished, stopped, canceled) while the chunk is still queued, or a worker popped the job and never
-- started the chunk for as long as the caller allows (ARGV[2..], from earlier calls). Popped means status
-- started, or status still queued while the id sits in RQ's intermediate list: RQ moves a job there when it
-- dequeues it and marks it started only later, so a worker stopped or killed in between leaves it there (RQ's
-- own cleanup fails it only at its next maintenance, up to 10 minutes later).
-- KEYS[1] chunks zset, KEYS[2] RQ's intermediate queue list
-- ARGV[1] RQ job key prefix, ARGV[2..] chunk ids popped so long ago that they are taken back if still queued
-- returns {reclaimed ids, ids queued whose job a worker popped and has not started (the caller times them)}
-- One script because the decision reads two things that move: a worker may start a chunk (its score turns
-- from +inf to a lease) and finish its job (a chunk job ends once its samples have started) between a
-- client's ZRANGEBYSCORE, its HGETs of the job statuses and its ZREM; the chunk would be dropped while its
-- requests run, and its samples enqueued a second time. Here a chunk is removed only while its score is +inf.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '+inf', '+inf')
local forced = {}
for i = 2, #ARGV do forced[ARGV[i]] = true end
local ended = {failed = true, finished = true, stopped = true, canceled = true}
local stale, popped = {}, {}
for _, id in ipairs(ids) do
  local status = redis.call('HGET', ARGV[1] .. id, 'status')
  local taken = status == 'started'
      or (status == 'queued' and redis.call('LPOS', KEYS[2], id) ~= false)
  if not status or ended[status] or (taken and forced[id]) then
    stale[#stale + 1] = id
  elseif taken then
    popped[#popped + 1] = id
  end
end
for i = 1, #stale, 1000 do
  redis.call('ZREM', KEYS[1], unpack(stale, i, math.min(i + 999, #stale)))
end
return {stale, popped}
"""

RECONCILE = _CLOSE_IF_SPENT + """
-- reconcile: make the counter agree with the responses on disk (raw_responses.jsonl is the truth for every id
-- it holds): ids Redis does not know are added and counted (a new Redis, or a rerun after Redis lost data);
-- ids Redis counted with another length (Redis restored from an older copy, the sample generated again in
-- between) get the file's length, and the counter moves by the difference.
-- KEYS[1] meta hash, KEYS[2] used counter, KEYS[3] done hash
-- ARGV pairs: sample id, completion tokens, ...
-- returns {added, tokens moved (may be negative), used after}
local added, delta = 0, 0
for i = 1, #ARGV, 2 do
  local n = tonumber(ARGV[i + 1])
  local old = redis.call('HGET', KEYS[3], ARGV[i])
  if not old then
    redis.call('HSET', KEYS[3], ARGV[i], n)
    added = added + 1
    delta = delta + n
  elseif tonumber(old) ~= n then
    redis.call('HSET', KEYS[3], ARGV[i], n)
    delta = delta + n - tonumber(old)
  end
end
local used = redis.call('INCRBY', KEYS[2], delta)
close_if_spent(KEYS[1], used)
return {added, delta, used}
"""

UNCOMMIT = _CLOSE_IF_SPENT + """
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
if removed > 0 and not spent(KEYS[1], used) then
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
