-- ATTACH: register a client id on a live session and tell the owner, fenced by the owner.
-- The attach is the command itself (commands.Attach's wire form): the client registered is
-- the one the owner is told of, and nothing of it is sent twice.
--   KEYS: 1 session hash, 2 inbox stream, 3 the workspace's change channel,
--         4 the workspace's catalog version, 5 its change log
--   ARGV: 1 incarnation, 2 the attach command's JSON ({"t": "attach", "sid", "clientId"}),
--         3 inbox TTL ms, 4 inbox max length, 5 the catalog version's TTL ms
--   -> 1 | 0 (gone)
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 0 end
local attach = cjson.decode(ARGV[2])
redis.call('HSET', KEYS[1], {{F.CLIENT}} .. attach.clientId, '1')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
changed(4, 3, 5, attach.sid, ARGV[5])
return 1
