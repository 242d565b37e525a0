-- REPLY: a worker answers a create or close, unless the API stopped waiting: then the
-- worker is told (0), and undoes what nobody was told of (a create).
--   KEYS: 1 reply list   ARGV: 1 reply JSON, 2 TTL s, 3 the abandoned marker
--   -> 1 delivered | 0 abandoned
if redis.call('LINDEX', KEYS[1], 0) == ARGV[3] then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
