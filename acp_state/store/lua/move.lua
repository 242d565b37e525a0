-- MOVE: a draining owner starts handing a session over to another worker (`target`). From
-- this step on, the commands sent to the session wait in its parked stream (see send.lua)
-- for the new owner, and the owner's own marker (a `moving` command) closes its inbox for
-- the session: once the owner has read it, it holds every command sent before the move.
-- A second call (the first target failed) only names the new target: what waits stays.
--   KEYS: 1 session hash, 2 the owner's inbox, 3 the session's parked stream,
--         4 the workspace's change channel, 5 its catalog version, 6 its change log
--   ARGV: 1 owner incarnation, 2 target incarnation, 3 the marker command JSON,
--         4 inbox TTL ms, 5 inbox max length, 6 sessionId, 7 the catalog version's TTL ms
--   -> 1 (the marker was written), 2 (the target was changed), 0 (not the owner's)
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 0 end
local again = redis.call('HEXISTS', KEYS[1], {{F.MOVING}}) == 1
redis.call('HSET', KEYS[1], {{F.MOVING}}, ARGV[2])
changed(5, 4, 6, ARGV[6], ARGV[7])
if again then return 2 end
redis.call('DEL', KEYS[3])  -- left by a move that ended otherwise (its owner closed the session)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
