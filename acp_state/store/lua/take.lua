-- TAKE: a retried create takes the first create's reply: one nobody took yet (moved to the
-- given list, the record of its taking), or one taken already whose taker may never have
-- answered (its API gave up on a lost answer, or died). The abandoned marker is only read.
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 the abandoned marker, 2 the given marker, 3 TTL s
--   -> the reply, the abandoned marker (left in place), or false
local head = redis.call('LINDEX', KEYS[1], 0)
if head == ARGV[1] then return head end
if head then
  redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'LEFT')
  if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
  return head
end
local taken = redis.call('LINDEX', KEYS[2], 0)
if taken and taken ~= ARGV[2] then return taken end
return false
