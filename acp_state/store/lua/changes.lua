-- The changes prelude, shared by APPLY, ATTACH and VOTE: a change of a session's live
-- state moves its workspace's catalog version and is announced on the workspace's change
-- channel, in the same step as the change itself, so every API process reads one revision
-- for one state. A missing version hash (Redis lost the workspace's state, or it was idle
-- past the hash's TTL) starts a new generation, named after Redis's clock: readers that
-- kept a revision of the old one see that it no longer counts.
local function new_generation()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end
-- `version` and `channel` are indexes in KEYS: a script touches only the keys it declares.
-- The message is `<sessionId>[,<sessionId>...] <revision> <generation>`: one change per
-- session named, the last of them at `revision` (a sweep announces a whole batch in one). A
-- follower that sees a revision skipped knows it missed a change, and one that sees another
-- generation knows that the revisions it holds no longer count.
local function changed_all(version, channel, sids, ttl_ms)
  if #sids == 0 then return end
  local generation = redis.call('HGET', KEYS[version], {{VER.GENERATION}})
  if not generation then
    generation = new_generation()
    redis.call('HSET', KEYS[version], {{VER.GENERATION}}, generation)
  end
  local revision = redis.call('HINCRBY', KEYS[version], {{VER.REVISION}}, #sids)
  redis.call('PEXPIRE', KEYS[version], ttl_ms)
  redis.call('SPUBLISH', KEYS[channel], table.concat(sids, ',') .. ' ' .. revision .. ' ' .. generation)
end
local function changed(version, channel, sid, ttl_ms)
  changed_all(version, channel, {sid}, ttl_ms)
end
