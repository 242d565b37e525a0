-- DETACH: a client leaves a live session (`POST /session/:id/detach`), fenced by the owner:
-- it is no longer counted (clientCount) nor may it vote, its presence entry goes, the owner
-- is told (commands.Detach, so a rewrite of the session does not register it again) and the
-- change is announced. A client that is not registered changes nothing.
--   KEYS: 1 session hash, 2 the workspace's presence ZSET, 3 the owner's inbox stream,
--         4 the workspace's change channel, 5 its catalog version, 6 its change log
--   ARGV: 1 incarnation, 2 the detach command's JSON ({"t": "detach", "sid", "clientId"}),
--         3 inbox TTL ms, 4 inbox max length, 5 the catalog version's TTL ms
--   -> 1 | 0 (gone)
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 0 end
local detach = cjson.decode(ARGV[2])
redis.call('ZREM', KEYS[2], detach.sid .. ' ' .. detach.clientId)
if redis.call('HDEL', KEYS[1], {{F.CLIENT}} .. detach.clientId) == 0 then return 1 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
changed(5, 4, 6, detach.sid, ARGV[5])
return 1
