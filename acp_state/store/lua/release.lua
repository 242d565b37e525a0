-- RELEASE: a worker leaves cleanly (SIGTERM, after closing its sessions): no longer
-- registered.
--   KEYS: the registry's (keys.REGISTRY_KEYS)   ARGV: 1 incarnation   -> 1
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
