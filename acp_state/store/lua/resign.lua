-- RESIGN (after the registry prelude): a worker gives up an incarnation it cannot vouch
-- for (it woke past its lease and the store no longer knew it): declared dead by itself,
-- tombstoned, and claimable by a sweeper now.
--   KEYS: the registry's (keys.REGISTRY_KEYS)   ARGV: 1 incarnation, 2 registry TTL ms
--   -> 1
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('ZADD', KEYS[5], now, ARGV[1])
keep(ARGV[2])
return 1
