-- TOLD: a create's answer was taken, so its creator knows the session: the create's request
-- id goes, and the session becomes visible to listings and live state; readers are told on
-- the workspace's change channel, as for any change of what they show.
--   KEYS: 1 session hash, 2 the workspace's change channel, 3 the workspace's catalog version,
--         4 its change log
--   ARGV: 1 sessionId, 2 the catalog version's TTL ms
--   -> 1 if the session was untold until now, else 0
if redis.call('HDEL', KEYS[1], {{F.REQUEST}}) == 0 then return 0 end
changed(3, 2, 4, ARGV[1], ARGV[2])
return 1
