-- TAKE: a retried create takes the first create's reply, which its API stopped waiting for
-- without being able to say so. The abandoned marker is only read: popping and pushing it
-- back would make the list anew, without its TTL.
--   KEYS: 1 reply list   ARGV: 1 the abandoned marker
--   -> the reply, the abandoned marker (left in place), or false
local head = redis.call('LINDEX', KEYS[1], 0)
if not head or head == ARGV[1] then return head end
return redis.call('LPOP', KEYS[1])
