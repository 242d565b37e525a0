-- The attention prelude, shared by APPLY and VOTE: the workspace's index of what waits for a
-- human (a pending permission or question, a turn error), kept in the same step as the
-- change that causes it, never by scanning. Index ZSET member `<sessionId>/<requestId>`
-- (`<sessionId>/!` for the session's turn error) -> since when (epoch ms, Redis's clock);
-- details HASH member -> `<owner incarnation>\n<the field's JSON>`. A session-hash field
-- stands for a member: `pi:<requestId>` (a pending interaction) or the turn error.
local function attention_member(sid, field)
  if field == {{F.TURN_ERROR}} then return sid .. '/!' end
  if string.sub(field, 1, #{{F.INTERACTION}}) == {{F.INTERACTION}} then
    return sid .. '/' .. string.sub(field, #{{F.INTERACTION}} + 1)
  end
  return nil
end
local function redis_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
-- `index` and `details` are indexes in KEYS. A pending interaction keeps its first `since`
-- (a rewrite after a loss does not restart its wait); a new turn error restarts it.
local function attention_set(index, details, sid, field, owner, value, ttl_ms)
  local member = attention_member(sid, field)
  if not member then return end
  if field == {{F.TURN_ERROR}} then
    redis.call('ZADD', KEYS[index], redis_ms(), member)
  else
    redis.call('ZADD', KEYS[index], 'NX', redis_ms(), member)
  end
  redis.call('HSET', KEYS[details], member, owner .. '\n' .. value)
  redis.call('PEXPIRE', KEYS[index], ttl_ms)
  redis.call('PEXPIRE', KEYS[details], ttl_ms)
end
local function attention_unset(index, details, sid, field)
  local member = attention_member(sid, field)
  if not member then return end
  redis.call('ZREM', KEYS[index], member)
  redis.call('HDEL', KEYS[details], member)
end
-- The session changed owners (a move): what it waits for now counts under the new owner's
-- lease, still since when it began.
local function attention_reown(index, details, sid, field, owner, value)
  local member = attention_member(sid, field)
  if member and redis.call('ZSCORE', KEYS[index], member) then
    redis.call('HSET', KEYS[details], member, owner .. '\n' .. value)
  end
end
