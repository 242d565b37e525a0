-- The registry prelude, shared by HEARTBEAT, CLAIM_DEAD and RESIGN: leases judged on
-- Redis's clock. `tick` keeps the store's own record of when it last served a lease
-- decision: a silence longer than half the shortest lease means the store itself stalled
-- (DEBUG SLEEP, CLIENT PAUSE, out of memory, a restart, a failover), and the time it came
-- back is kept as `stall`. No worker is declared dead until the store has served for a
-- whole lease of that worker since then, so a healthy worker always gets to renew first.
--   KEYS (every registry script): 1 workers, 2 reports, 3 leases, 4 dead, 5 sweeps, 6 clock,
--   7 agents
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function tick(own_lease)
  local shortest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local lease = tonumber(shortest[2] or own_lease or '0')
  if own_lease and own_lease < lease then lease = own_lease end
  local last = tonumber(redis.call('HGET', KEYS[6], {{CLOCK.TICK}}) or '0')
  if lease > 0 and now - last > lease / 2 then
    redis.call('HSET', KEYS[6], {{CLOCK.STALL}}, string.format('%d', now))
  end
  if now > last then redis.call('HSET', KEYS[6], {{CLOCK.TICK}}, string.format('%d', now)) end
end
local function keep(ttl)
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl) end
end
