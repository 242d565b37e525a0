-- ABANDON: the API stops waiting for a reply. It takes an answer that arrived meanwhile,
-- or one an earlier take of its own moved to the given list while the answer on the wire
-- was lost (a connection that failed mid-reply: the taking happened, the taker never
-- heard). Else it leaves the marker that tells the worker nobody is waiting any more.
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 TTL s, 2 the abandoned marker, 3 the given marker
--   -> the reply, or false
local head = redis.call('LINDEX', KEYS[1], 0)
if head and head ~= ARGV[2] then
  redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'LEFT')
  if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
  return head
end
local taken = redis.call('LINDEX', KEYS[2], 0)
if taken and taken ~= ARGV[3] then return taken end
if not head then redis.call('RPUSH', KEYS[1], ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return false
