-- ABANDON: the API stops waiting for a reply: it takes one that arrived meanwhile, or
-- leaves the marker that tells the worker nobody is waiting any more.
--   KEYS: 1 reply list   ARGV: 1 TTL s, 2 the abandoned marker
--   -> the reply, or false
local reply = redis.call('RPOP', KEYS[1])
if reply and reply ~= ARGV[2] then return reply end
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return false
