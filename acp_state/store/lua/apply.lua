-- APPLY: a worker's state transition. Update the session hash, append each event to the
-- replay log and publish it, and keep the listing set and the catalog in step, all or
-- nothing. Transitions carry the session's running number (`op`): one whose answer was
-- lost is retried, and applies once.
-- Readers' caches are told first (the workspace's change channel), so that a process never
-- delivers an event and then serves a cached status from before it.
-- Every write is fenced by the owner's incarnation, so a worker that lost its lease (and
-- was swept) can no longer resurrect or modify a session.
--   KEYS: 1 session hash, 2 event stream (also the pub/sub channel), 3 live set,
--         4 catalog hash, 5 catalog order zset, 6 single-scope key, 7 transcript stream,
--         8 the workspace's change channel, 9 the workspace's catalog version,
--         10 the session's turn records, 11 the ids of its ended turns,
--         12 the workspace's attention index, 13 its details (the attention prelude)
--   ARGV: 1 incarnation, 2 ops JSON (see RedisStore.apply), 3 the session hash's TTL ms
--         (refreshed by every transition)
--   -> {applied, last event id, epoch}; applied: 1, 0 the session is not in the store (data
--      loss, or swept: the worker asks the registry which), -1 another incarnation owns it,
--      2 a rewrite (`missing_only`) found the session already there
local inc = ARGV[1]
local ops = cjson.decode(ARGV[2])
local owner = redis.call('HGET', KEYS[1], {{F.OWNER}})
if ops.op and owner == inc and tonumber(redis.call('HGET', KEYS[1], {{F.OP}}) or '0') >= ops.op then
  -- A retry of a transition that did apply (its answer was lost): nothing happens twice.
  return {1, tonumber(redis.call('HGET', KEYS[1], {{F.SEQ}}) or '0'), redis.call('HGET', KEYS[1], {{F.EPOCH}}) or ''}
end
if ops.mode == 'create' then
  if owner and owner ~= inc then return {-1, 0, ''} end
  if owner and ops.missing_only then
    -- A rewrite after a loss, but the session is here (another path rewrote it first).
    return {2, tonumber(redis.call('HGET', KEYS[1], {{F.SEQ}}) or '0'), redis.call('HGET', KEYS[1], {{F.EPOCH}}) or ''}
  end
  -- A whole snapshot (first publish, or a rewrite under a new epoch): start clean. What it
  -- waited for before and the snapshot no longer holds leaves the attention index.
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if not (ops.set and ops.set[name]) then attention_unset(12, 13, ops.sid, name) end
  end
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], {{F.OWNER}}, inc)
  redis.call('SADD', KEYS[3], ops.sid)
  redis.call('PEXPIRE', KEYS[3], ops.retention or ARGV[3])
  if ops.single then redis.call('SET', KEYS[6], ops.sid) end
elseif not owner then
  return {0, 0, ''}
elseif owner ~= inc then
  return {-1, 0, ''}
end
if ops.set then
  local args = {}
  for k, v in pairs(ops.set) do
    args[#args + 1] = k; args[#args + 1] = v
    attention_set(12, 13, ops.sid, k, inc, v, ops.verttl)
  end
  if #args > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
end
if ops.del and #ops.del > 0 then
  redis.call('HDEL', KEYS[1], unpack(ops.del))
  for _, k in ipairs(ops.del) do attention_unset(12, 13, ops.sid, k) end
end
if ops.incr then
  for k, n in pairs(ops.incr) do redis.call('HINCRBY', KEYS[1], k, n) end
end
changed(9, 8, ops.sid, ops.verttl)
local seq = tonumber(redis.call('HGET', KEYS[1], {{F.SEQ}}) or '0')
local epoch = redis.call('HGET', KEYS[1], {{F.EPOCH}}) or ''
local bodies = ops.events or {}
local fields = ops.mode == 'delete' and redis.call('HKEYS', KEYS[1]) or {}
if ops.mode == 'delete' and ops.orphan then
  -- Prompts admitted (field p:<promptId>) that the transition does not end itself: the
  -- owner never saw them (a close raced them) or is dead. Each gets its one terminal
  -- before the session's own last event.
  local orphans = {}
  for _, name in ipairs(fields) do
    if string.sub(name, 1, #{{F.PROMPT}}) == {{F.PROMPT}} then
      local pid = string.sub(name, #{{F.PROMPT}} + 1)
      orphans[#orphans + 1] = (string.gsub(ops.orphan, '@PID@', pid))
    end
  end
  if #orphans > 0 then
    for _, body in ipairs(bodies) do orphans[#orphans + 1] = body end
    bodies = orphans
  end
end
if #bodies > 0 then
  local transcript = {}
  for _, i in ipairs(ops.tr or {}) do transcript[i] = true end
  local shift = #bodies - #(ops.events or {})
  for i, body in ipairs(bodies) do
    seq = redis.call('HINCRBY', KEYS[1], {{F.SEQ}}, 1)
    local envelope = '{"id":' .. seq .. ',' .. body .. '}'
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ops.evmax, seq .. '-0', 'e', envelope)
    redis.call('SPUBLISH', KEYS[2], envelope)
    if ops.tev == i - shift then redis.call('HSET', KEYS[1], {{F.TURN_ERROR_EVENT}}, envelope) end
    if transcript[i - shift] then
      redis.call('XADD', KEYS[7], 'MAXLEN', '~', ops.trmax, '*', 'e', envelope)
    end
  end
  redis.call('PEXPIRE', KEYS[2], ops.evttl)
  if ops.tr and #ops.tr > 0 then redis.call('PEXPIRE', KEYS[7], ops.trttl) end
end
if ops.catalog then
  redis.call('HSET', KEYS[4], ops.sid, ops.catalog)
  redis.call('ZADD', KEYS[5], ops.score, ops.sid)
  redis.call('PEXPIRE', KEYS[4], ops.retention)
  redis.call('PEXPIRE', KEYS[5], ops.retention)
  local stale = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. ops.cutoff, 'LIMIT', 0, 64)
  for _, id in ipairs(stale) do
    if redis.call('SISMEMBER', KEYS[3], id) == 0 then
      redis.call('HDEL', KEYS[4], id)
      redis.call('ZREM', KEYS[5], id)
    end
  end
end
if ops.turns and ops.mode ~= 'delete' then
  -- Turn records (queued, running, ended); only the newest `turnkeep` ended ones are kept.
  for _, turn in ipairs(ops.turns) do
    redis.call('HSET', KEYS[10], turn[1], turn[2])
    if turn[3] == 1 then
      redis.call('LREM', KEYS[11], 0, turn[1])
      redis.call('RPUSH', KEYS[11], turn[1])
      while redis.call('LLEN', KEYS[11]) > ops.turnkeep do
        redis.call('HDEL', KEYS[10], redis.call('LPOP', KEYS[11]))
      end
    end
  end
  redis.call('PEXPIRE', KEYS[10], ops.turnttl)
  redis.call('PEXPIRE', KEYS[11], ops.turnttl)
end
if ops.mode == 'delete' then
  redis.call('DEL', KEYS[10], KEYS[11])
  -- A session whose creator was never told of it (its answer not taken: the field is still
  -- there) leaves no catalog row when its worker is swept.
  local untold = ops.uncatalog_untold and redis.call('HEXISTS', KEYS[1], {{F.REQUEST}}) == 1
  for _, name in ipairs(fields) do attention_unset(12, 13, ops.sid, name) end
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ops.sid)
  if redis.call('GET', KEYS[6]) == ops.sid then redis.call('DEL', KEYS[6]) end
  if ops.uncatalog or untold then
    redis.call('HDEL', KEYS[4], ops.sid)
    redis.call('ZREM', KEYS[5], ops.sid)
  end
else
  if ops.op then redis.call('HSET', KEYS[1], {{F.OP}}, ops.op) end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {1, seq, epoch}
