-- HEARTBEAT (after the registry prelude): a worker renews its lease, at constant cost
-- whatever its session count. A tombstoned incarnation is told it is dead and renews
-- nothing: dead stays dead.
--   KEYS: the registry's (keys.REGISTRY_KEYS)
--   ARGV: 1 incarnation, 2 lease ms, 3 load report JSON, 4 registry TTL ms,
--         5 (optional) JSON array of the agent names the worker offers
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
if ARGV[5] then
  -- The names on offer, stamped now; a name no worker offered for a registry TTL is forgotten.
  for _, name in ipairs(cjson.decode(ARGV[5])) do redis.call('ZADD', KEYS[7], now, name) end
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now - tonumber(ARGV[4]))
end
keep(ARGV[4])
local held = 'new'
if deadline then held = (tonumber(deadline) < now) and 'late' or 'held' end
return {held, string.format('%d', now)}
