-- CLAIM_DEAD (after the registry prelude): a sweeper claims dead workers, those whose
-- deadline passed while the store was serving for at least their whole lease. Each is moved
-- to the tombstones and claimed for CLAIM ms by exactly one caller; a claim that expires
-- (its sweeper died) is handed out again. Every sweeper round is also a tick, so the
-- shortest lease is returned for sweepers to keep their pace well inside half of it.
--   KEYS: the registry's (keys.REGISTRY_KEYS)
--   ARGV: 1 claim ms, 2 tombstone retention ms, 3 registry TTL ms, 4 at most this many
--   -> {the shortest registered lease ms (0: none), ms until the soonest deadline still ahead
--      (-1: none; a sweeper may wait for it rather than poll), claimed incarnations...}
tick(nil)
local claim, limit = tonumber(ARGV[1]), tonumber(ARGV[4])
local stall = tonumber(redis.call('HGET', KEYS[6], {{CLOCK.STALL}}) or '0')
local shortest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
local soonest = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local out = {shortest[2] or '0', soonest[2] and string.format('%d', tonumber(soonest[2]) - now) or '-1'}
for _, inc in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, limit)) do
  redis.call('ZADD', KEYS[5], now + claim, inc)
  out[#out + 1] = inc
end
for _, inc in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, limit)) do
  local lease = tonumber(redis.call('ZSCORE', KEYS[3], inc) or '0')
  if now - stall >= lease then
    redis.call('ZREM', KEYS[1], inc)
    redis.call('HDEL', KEYS[2], inc)
    redis.call('ZREM', KEYS[3], inc)
    redis.call('ZADD', KEYS[4], now, inc)
    redis.call('ZADD', KEYS[5], now + claim, inc)
    out[#out + 1] = inc
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - tonumber(ARGV[2])))
keep(ARGV[3])
return out
