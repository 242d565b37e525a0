-- ABANDON: the API stops waiting for a reply. It takes an answer that arrived meanwhile,
-- or one an earlier take of its own moved to the given list while the answer on the wire
-- was lost (a connection that failed mid-reply: the taking happened, the taker never
-- heard). Else it leaves the marker that tells the worker nobody is waiting any more.
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 TTL s, 2 the abandoned marker, 3 the given marker
--   -> the reply, or false
local answer = take_answer(1, 2, ARGV[2], ARGV[3], ARGV[1])
if answer then return answer end
if not redis.call('LINDEX', KEYS[1], 0) then redis.call('RPUSH', KEYS[1], ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return false
