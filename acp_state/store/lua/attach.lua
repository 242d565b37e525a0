-- ATTACH: register a client id on a live session and tell the owner, fenced by the owner.
--   KEYS: 1 session hash, 2 inbox stream, 3 the workspace's change channel,
--         4 the workspace's catalog version
--   ARGV: 1 incarnation, 2 clientId, 3 command JSON, 4 inbox TTL ms, 5 inbox max length,
--         6 sessionId, 7 the catalog version's TTL ms
--   -> 1 | 0 (gone)
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], {{F.CLIENT}} .. ARGV[2], '1')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
changed(4, 3, ARGV[6], ARGV[7])
return 1
