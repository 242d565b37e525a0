-- HEARTBEAT (after the registry prelude): a worker renews its lease, at constant cost
-- whatever its session count. A tombstoned incarnation is told it is dead and renews
-- nothing: dead stays dead.
--   KEYS: the registry's (keys.REGISTRY_KEYS)
--   ARGV: 1 incarnation, 2 lease ms, 3 load report JSON, 4 registry TTL ms
--   -> {'held' | 'late' (renewed after its deadline, before anyone declared it dead)
--       | 'new' (no lease was held: a first registration, or the store lost it)
--       | 'dead', Redis time ms}
local inc, lease = ARGV[1], tonumber(ARGV[2])
tick(lease)
if redis.call('ZSCORE', KEYS[4], inc) then return {'dead', string.format('%d', now)} end
local deadline = redis.call('ZSCORE', KEYS[1], inc)
redis.call('ZADD', KEYS[1], now + lease, inc)
redis.call('HSET', KEYS[2], inc, ARGV[3])
redis.call('ZADD', KEYS[3], lease, inc)
keep(ARGV[4])
local held = 'new'
if deadline then held = (tonumber(deadline) < now) and 'late' or 'held' end
return {held, string.format('%d', now)}
