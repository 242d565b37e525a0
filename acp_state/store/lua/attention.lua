-- The attention prelude, shared by APPLY, VOTE and SWEEP: what waits for a human (a pending
-- permission or question, a turn error), indexed twice, kept in the same step as the change
-- that causes it, never by scanning:
-- * the workspace's index: ZSET member `<sessionId>/<requestId>` (`<sessionId>/!` for the
--   session's turn error) -> since when (epoch ms, Redis's clock), and its details HASH
--   member -> `<owner incarnation>\n<the field's JSON>`;
-- * the deployment's index (one on a single Redis; on a cluster one per hash slot, in the
--   workspace's slot, so that the script stays in one slot): the same, member
--   `<workspaceId>/<sessionId>/<requestId>`, with the same since.
-- A session-hash field stands for a member: `pi:<requestId>` (a pending interaction) or the
-- turn error. `ix` holds the KEYS indexes of {workspace index, its details, deployment index,
-- its details}; the workspace id is the workspace index's hash tag.
local function attention_member(sid, field)
  if field == {{F.TURN_ERROR}} then return sid .. '/!' end
  if string.sub(field, 1, #{{F.INTERACTION}}) == {{F.INTERACTION}} then
    return sid .. '/' .. string.sub(field, #{{F.INTERACTION}} + 1)
  end
  return nil
end
local function attention_whole(ix, member)
  return string.match(KEYS[ix[1]], '{(.-)}') .. '/' .. member
end
local function redis_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
-- A pending interaction keeps its first `since` (a rewrite after a loss does not restart its
-- wait); a new turn error restarts it. The deployment's index takes the workspace's since.
local function attention_set(ix, sid, field, owner, value, ttl_ms)
  local member = attention_member(sid, field)
  if not member then return end
  local since = redis_ms()
  if field == {{F.TURN_ERROR}} then
    redis.call('ZADD', KEYS[ix[1]], since, member)
  elseif redis.call('ZADD', KEYS[ix[1]], 'NX', since, member) == 0 then
    since = redis.call('ZSCORE', KEYS[ix[1]], member)
  end
  local whole = attention_whole(ix, member)
  redis.call('ZADD', KEYS[ix[3]], since, whole)
  redis.call('HSET', KEYS[ix[2]], member, owner .. '\n' .. value)
  redis.call('HSET', KEYS[ix[4]], whole, owner .. '\n' .. value)
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[ix[i]], ttl_ms) end
end
local function attention_unset(ix, sid, field)
  local member = attention_member(sid, field)
  if not member then return end
  local whole = attention_whole(ix, member)
  redis.call('ZREM', KEYS[ix[1]], member)
  redis.call('HDEL', KEYS[ix[2]], member)
  redis.call('ZREM', KEYS[ix[3]], whole)
  redis.call('HDEL', KEYS[ix[4]], whole)
end
-- The session changed owners (a move): what it waits for now counts under the new owner's
-- lease, still since when it began. A wait only the workspace's index holds (written before
-- the deployment's index existed) enters the deployment's here: a rolling deploy's moves
-- bring every wait in.
local function attention_reown(ix, sid, field, owner, value, ttl_ms)
  local member = attention_member(sid, field)
  local since = member and redis.call('ZSCORE', KEYS[ix[1]], member)
  if since then
    local whole = attention_whole(ix, member)
    redis.call('HSET', KEYS[ix[2]], member, owner .. '\n' .. value)
    redis.call('ZADD', KEYS[ix[3]], since, whole)
    redis.call('HSET', KEYS[ix[4]], whole, owner .. '\n' .. value)
    redis.call('PEXPIRE', KEYS[ix[3]], ttl_ms)
    redis.call('PEXPIRE', KEYS[ix[4]], ttl_ms)
  end
end
