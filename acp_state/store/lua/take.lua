-- TAKE: a retried create takes the first create's reply, which its API stopped waiting for
-- without being able to say so.
--   KEYS: 1 reply list   ARGV: 1 the abandoned marker
--   -> the reply, the abandoned marker (left in place), or false
local reply = redis.call('LPOP', KEYS[1])
if reply == ARGV[1] then redis.call('LPUSH', KEYS[1], reply) end
return reply
