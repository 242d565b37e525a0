-- The transition prelude, shared by APPLY (one session) and SWEEP (many): one state
-- transition of one session. `at` maps each of the 16 roles below to its index in KEYS, so
-- the same step runs on the keys one call declares, however many sessions it carries.
--   roles: 1 session hash, 2 event stream (also the pub/sub channel), 3 live set,
--          4 catalog hash, 5 catalog order zset, 6 single-scope key, 7 transcript stream,
--          8 the workspace's change channel, 9 the workspace's catalog version,
--          10 the session's turn records, 11 the ids of its ended turns,
--          12 the workspace's attention index, 13 its details, 14 the deployment's
--          attention index (its part in the workspace's slot), 15 its details (the
--          attention prelude), 16 the workspace's change log (the changes prelude)
--   inc: the writer's incarnation; ops: the decoded ops (see codec.transition_ops); ttl_ms: the
--   session hash's TTL (refreshed by every transition); batch (SWEEP's deletes only, else
--   nil): what the caller does once for many sessions, {flat = this session hash's HGETALL,
--   removed = the ids it removes from the live set and the single-scope key itself}, the
--   change being announced by the caller too
--   -> {applied, last event id, epoch} (see apply.lua)
-- End the turn records of `ids` that have not ended (queued or running) with the error
-- `e` = {message, code, at (epoch ms, a string), keep (ended records kept), ttl (ms)}, as
-- acp_state.turns.TurnRecord.failed does; a record already ended, or gone, stays as it is.
local function end_turns(turns, ended, ids, e)
  local open = {}
  for _, id in ipairs(ids) do
    local packed = redis.call('HGET', turns, id)
    local record = packed and cjson.decode(packed)
    if record and (record.state == 'queued' or record.state == 'running') then
      open[#open + 1] = {id = id, record = record}
    end
  end
  if #open == 0 then return end
  -- In the order they were admitted (the hash's fields have none), so the last ended turn
  -- (`turns/current` once idle) is the last admitted, as when the owner ends them itself.
  local function queued_at(turn) return tonumber(turn.record.queued_at) or 0 end
  table.sort(open, function(a, b)
    if queued_at(a) ~= queued_at(b) then return queued_at(a) < queued_at(b) end
    return a.id < b.id
  end)
  for _, turn in ipairs(open) do
    local record = turn.record
    record.state = 'error'
    record.ended_at = tonumber(e.at)
    record.error = {message = e.message, code = e.code}
    redis.call('HSET', turns, turn.id, cjson.encode(record))
    redis.call('LREM', ended, 0, turn.id)
    redis.call('RPUSH', ended, turn.id)
  end
  while redis.call('LLEN', ended) > e.keep do
    redis.call('HDEL', turns, redis.call('LPOP', ended))
  end
  redis.call('PEXPIRE', turns, e.ttl)
  redis.call('PEXPIRE', ended, e.ttl)
end

local function transition(at, inc, ops, ttl_ms, batch)
  local hash, log, live, catalog, order, single = KEYS[at[1]], KEYS[at[2]], KEYS[at[3]], KEYS[at[4]], KEYS[at[5]], KEYS[at[6]]
  local transcript, turns, ended = KEYS[at[7]], KEYS[at[10]], KEYS[at[11]]
  local ix = {at[12], at[13], at[14], at[15]}
  -- A delete reads the whole hash once and keeps its changes to it here, as the hash goes
  -- at the end: every check and every field it leaves behind come from that one read (a
  -- sweep runs this for each of a dead worker's 25,000 sessions). `names` keeps HKEYS's order.
  local deleting, held, names = ops.mode == 'delete', nil, {}
  -- A delete ends every prompt the session admitted (field p:<promptId>), whoever ends it
  -- (the owner's own terminals, or `orphan`): their ids, for their turn records.
  local admitted = {}
  if deleting then
    held = {}
    local flat = batch and batch.flat or redis.call('HGETALL', hash)
    for i = 1, #flat, 2 do
      held[flat[i]] = flat[i + 1]
      names[#names + 1] = flat[i]
      if string.sub(flat[i], 1, #{{F.PROMPT}}) == {{F.PROMPT}} then
        admitted[#admitted + 1] = string.sub(flat[i], #{{F.PROMPT}} + 1)
      end
    end
  end
  local function get(name)
    if held then return held[name] end
    return redis.call('HGET', hash, name)
  end
  local owner = get({{F.OWNER}})
  if ops.op and owner == inc and tonumber(get({{F.OP}}) or '0') >= ops.op then
    -- A retry of a transition that did apply (its answer was lost): nothing happens twice.
    return {1, tonumber(get({{F.SEQ}}) or '0'), get({{F.EPOCH}}) or ''}
  end
  if ops.mode == 'create' then
    if owner and owner ~= inc then return {-1, 0, ''} end
    if owner and ops.missing_only then
      -- A rewrite after a loss, but the session is here (another path rewrote it first).
      return {2, tonumber(redis.call('HGET', hash, {{F.SEQ}}) or '0'), redis.call('HGET', hash, {{F.EPOCH}}) or ''}
    end
    -- A whole snapshot (first publish, or a rewrite under a new epoch): start clean. What it
    -- waited for before and the snapshot no longer holds leaves the attention index.
    for _, name in ipairs(redis.call('HKEYS', hash)) do
      if not (ops.set and ops.set[name]) then attention_unset(ix, ops.sid, name) end
    end
    if ops.resumed and not ops.missing_only and redis.call('HEXISTS', catalog, ops.sid) == 0 then
      -- A resume of a session deleted meanwhile (DELETE_LISTED won the race after the
      -- load's claim lapsed): it is not revived. The worker drops it, as a foreign one.
      return {-1, 0, ''}
    end
    redis.call('DEL', hash, log)
    if ops.resumed then
      -- The turns of its earlier life that ended stay; one that never ended (its worker died
      -- under it, and its prompt got its terminal from the sweep) is no turn of this one.
      local ended_ids = {}
      for _, id in ipairs(redis.call('LRANGE', ended, 0, -1)) do ended_ids[id] = true end
      for _, id in ipairs(redis.call('HKEYS', turns)) do
        if not ended_ids[id] then redis.call('HDEL', turns, id) end
      end
    end
    redis.call('HSET', hash, {{F.OWNER}}, inc)
    redis.call('SADD', live, ops.sid)
    redis.call('PEXPIRE', live, ops.retention or ttl_ms)
    if ops.single then redis.call('SET', single, ops.sid) end
  elseif ops.mode == 'takeover' then
    -- A move's last step: the session passes from the owner that is handing it over (and
    -- named this writer its target) to the writer, with its fields, event log and epoch.
    if not owner then return {0, 0, ''} end
    if owner ~= ops.from or get({{F.MOVING}}) ~= inc then return {-1, 0, ''} end
    redis.call('HSET', hash, {{F.OWNER}}, inc)
    redis.call('HDEL', hash, {{F.MOVING}}, {{F.OP}})
    local flat = redis.call('HGETALL', hash)
    for i = 1, #flat, 2 do attention_reown(ix, ops.sid, flat[i], inc, flat[i + 1], ops.verttl) end
    owner = inc
  elseif not owner then
    return {0, 0, ''}
  elseif owner ~= inc then
    return {-1, 0, ''}
  end
  if ops.set and deleting then
    -- Its attention entry would go again at the end: only the field is kept.
    for k, v in pairs(ops.set) do
      if not held[k] then names[#names + 1] = k end
      held[k] = v
    end
  elseif ops.set then
    local args = {}
    for k, v in pairs(ops.set) do
      args[#args + 1] = k; args[#args + 1] = v
      attention_set(ix, ops.sid, k, inc, v, ops.verttl)
    end
    if #args > 0 then redis.call('HSET', hash, unpack(args)) end
  end
  if ops.del and #ops.del > 0 then
    if deleting then
      for _, k in ipairs(ops.del) do held[k] = nil end
    else
      redis.call('HDEL', hash, unpack(ops.del))
    end
    for _, k in ipairs(ops.del) do attention_unset(ix, ops.sid, k) end
  end
  if ops.incr and not deleting then
    for k, n in pairs(ops.incr) do redis.call('HINCRBY', hash, k, n) end
  end
  if not batch then changed(at[9], at[8], at[16], ops.sid, ops.verttl) end
  local seq = tonumber(get({{F.SEQ}}) or '0')
  local epoch = get({{F.EPOCH}}) or ''
  local bodies = ops.events or {}
  local fields = {}
  if deleting then
    for _, name in ipairs(names) do
      if held[name] then fields[#fields + 1] = name end
    end
  end
  if deleting and ops.orphan then
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
    local to_transcript = {}
    for _, i in ipairs(ops.tr or {}) do to_transcript[i] = true end
    local shift = #bodies - #(ops.events or {})
    for i, body in ipairs(bodies) do
      if deleting then seq = seq + 1 else seq = redis.call('HINCRBY', hash, {{F.SEQ}}, 1) end
      local envelope = '{"id":' .. seq .. ',' .. body .. '}'
      redis.call('XADD', log, 'MAXLEN', '~', ops.evmax, seq .. '-0', 'e', envelope)
      redis.call('SPUBLISH', log, envelope)
      if ops.tev == i - shift and not deleting then redis.call('HSET', hash, {{F.TURN_ERROR_EVENT}}, envelope) end
      if to_transcript[i - shift] then
        redis.call('XADD', transcript, 'MAXLEN', '~', ops.trmax, '*', 'e', envelope)
      end
    end
    redis.call('PEXPIRE', log, ops.evttl)
    if ops.tr and #ops.tr > 0 then redis.call('PEXPIRE', transcript, ops.trttl) end
  end
  if ops.catalog then
    redis.call('HSET', catalog, ops.sid, ops.catalog)
    redis.call('ZADD', order, ops.score, ops.sid)
    redis.call('PEXPIRE', catalog, ops.retention)
    redis.call('PEXPIRE', order, ops.retention)
    local stale = redis.call('ZRANGEBYSCORE', order, '-inf', '(' .. ops.cutoff, 'LIMIT', 0, 64)
    for _, id in ipairs(stale) do
      if redis.call('SISMEMBER', live, id) == 0 then
        redis.call('HDEL', catalog, id)
        redis.call('ZREM', order, id)
      end
    end
  end
  if ops.turns and not deleting then
    -- Turn records (queued, running, ended); only the newest `turnkeep` ended ones are kept.
    for _, turn in ipairs(ops.turns) do
      redis.call('HSET', turns, turn[1], turn[2])
      if turn[3] == 1 then
        redis.call('LREM', ended, 0, turn[1])
        redis.call('RPUSH', ended, turn[1])
        while redis.call('LLEN', ended) > ops.turnkeep do
          redis.call('HDEL', turns, redis.call('LPOP', ended))
        end
      end
    end
    redis.call('PEXPIRE', turns, ops.turnttl)
    redis.call('PEXPIRE', ended, ops.turnttl)
  end
  if deleting then
    -- A session whose creator was never told of it (its answer not taken: the field is still
    -- there) leaves no catalog row when its worker is swept.
    local untold = ops.uncatalog_untold and held[{{F.REQUEST}}] ~= nil
    for _, name in ipairs(fields) do attention_unset(ix, ops.sid, name) end
    if ops.uncatalog or untold then
      redis.call('DEL', hash, turns, ended)
    else
      -- A session that stays listed may be resumed: its turn records stay (their own TTL),
      -- so that its turns answer again then (see the resumed CREATE above). Each turn this
      -- delete ends (the sweeper's `worker_lost`, a close's `session_closed`) is recorded
      -- as ended so, as its terminal event says.
      if ops.endturn then end_turns(turns, ended, admitted, ops.endturn) end
      redis.call('DEL', hash)
    end
    if batch then
      batch.removed[#batch.removed + 1] = ops.sid
    else
      redis.call('SREM', live, ops.sid)
      if redis.call('GET', single) == ops.sid then redis.call('DEL', single) end
    end
    if ops.uncatalog or untold then
      redis.call('HDEL', catalog, ops.sid)
      redis.call('ZREM', order, ops.sid)
    end
  else
    if ops.op then redis.call('HSET', hash, {{F.OP}}, ops.op) end
    redis.call('PEXPIRE', hash, ttl_ms)
  end
  return {1, seq, epoch}
end
