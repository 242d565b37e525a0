-- CLAIM_SID: claim a session id for a workspace, in the locator's own slot (the locator's
-- hash tag is the session id, so no script can also touch the workspace's keys: this is
-- the one place a locator is written, and it never takes an id another workspace holds).
-- A session id is unique across workspaces: the locator names the one workspace whose
-- session (live, or listed in its catalog) holds the id, and it outlives the listing row.
--   KEYS: 1 locator   ARGV: 1 workspace id, 2 TTL ms
--   -> 1 claimed now (the id was free), 2 already this workspace's (its TTL renewed),
--      0 another workspace holds it (nothing written)
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder ~= ARGV[1] then return 0 end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 2
