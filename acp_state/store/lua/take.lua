-- TAKE: a retried create takes the first create's reply: one nobody took yet (moved to the
-- given list, the record of its taking), or one taken already whose taker may never have
-- answered (its API gave up on a lost answer, or died). The abandoned marker is only read.
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 TTL s, 2 the abandoned marker, 3 the given marker
--   -> the reply, the abandoned marker (left in place), or false
if redis.call('LINDEX', KEYS[1], 0) == ARGV[2] then return ARGV[2] end
return take_answer(1, 2, ARGV[2], ARGV[3], ARGV[1]) or false
