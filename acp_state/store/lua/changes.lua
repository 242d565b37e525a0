-- The changes prelude, shared by APPLY, ATTACH, MOVE, SWEEP, TOLD, VOTE and VERSION: a change
-- of a session's live state moves its workspace's catalog version and is announced on the
-- workspace's change channel, in the same step as the change itself, so every API process
-- reads one revision for one state. A missing version hash (Redis lost the workspace's state,
-- or it was idle past the hash's TTL) starts a new generation, named after Redis's clock:
-- readers that kept a revision of the old one see that it no longer counts.
local function new_generation()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end
-- The change log (`acp:{<ws>}:chg`): each session's id -> the revision of its last change,
-- so that any API process, one started since too, can tell a client that saw revision r
-- which sessions changed (or left) after it. It keeps the newest CHANGE_LOG_MAX sessions;
-- its member FLOOR (never a session id) holds the oldest revision it can answer from: the
-- newest revision it forgot, or the revision it was started at (a log made anew after it
-- was lost knows nothing of changes before).
-- Why 1,000: the log serves a resume on a process that did not follow the workspace (a
-- reconnect after an API restart, or behind a load balancer), a gap of seconds, in which a
-- busy workspace changes its running sessions (5% of 10,000 is 500). A resume that missed
-- more gets a snapshot, as correct (the live rows: at most 10 times such a diff in a
-- workspace of 10,000); each member costs about 130 B of Redis, which at 10,000 sessions a
-- workspace was a tenth of an idle session's memory (docs/capacity.md). A log an older
-- release filled past it shrinks to it at its next new member.
local CHANGE_LOG_MAX = 1000
local FLOOR = '!'
local ZADD_CHUNK = 1000  -- members per ZADD: Lua's unpack has a bounded stack
local function logged(log, sids, revision, fresh, ttl_ms)
  local first = revision - #sids  -- the revision before this step's changes
  if fresh then redis.call('DEL', KEYS[log]) end  -- the old generation's revisions mean nothing
  -- The floor is there whenever the log is: NX adds it only to a log made here.
  redis.call('ZADD', KEYS[log], 'NX', first, FLOOR)
  local args, added = {}, 0
  for i, sid in ipairs(sids) do
    args[#args + 1] = first + i
    args[#args + 1] = sid
    if #args >= 2 * ZADD_CHUNK or i == #sids then
      added = added + redis.call('ZADD', KEYS[log], unpack(args))
      args = {}
    end
  end
  -- Most changes are of sessions already logged: only a new member can take it past the max.
  local excess = added > 0 and redis.call('ZCARD', KEYS[log]) - 1 - CHANGE_LOG_MAX or 0
  if excess > 0 then
    redis.call('ZREM', KEYS[log], FLOOR)
    local forgotten = redis.call('ZPOPMIN', KEYS[log], excess)
    redis.call('ZADD', KEYS[log], forgotten[#forgotten], FLOOR)
  end
  redis.call('PEXPIRE', KEYS[log], ttl_ms)
end
-- `version`, `channel` and `log` are indexes in KEYS: a script touches only the keys it
-- declares. The message is `<sessionId>[,<sessionId>...] <revision> <generation>`: one change
-- per session named, the last of them at `revision` (a sweep announces a whole batch in one).
-- A follower that sees a revision skipped knows it missed a change, and one that sees another
-- generation knows that the revisions it holds no longer count.
local function changed_all(version, channel, log, sids, ttl_ms)
  if #sids == 0 then return end
  local generation = redis.call('HGET', KEYS[version], {{VER.GENERATION}})
  local fresh = not generation
  if fresh then
    generation = new_generation()
    redis.call('HSET', KEYS[version], {{VER.GENERATION}}, generation)
  end
  local revision = redis.call('HINCRBY', KEYS[version], {{VER.REVISION}}, #sids)
  redis.call('PEXPIRE', KEYS[version], ttl_ms)
  logged(log, sids, revision, fresh, ttl_ms)
  redis.call('SPUBLISH', KEYS[channel], table.concat(sids, ',') .. ' ' .. revision .. ' ' .. generation)
end
local function changed(version, channel, log, sid, ttl_ms)
  changed_all(version, channel, log, {sid}, ttl_ms)
end
