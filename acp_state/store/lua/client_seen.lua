-- CLIENT_SEEN: a client's heartbeat on a live session. A registered client's presence then
-- lasts the TTL from now (Redis's clock); a client that stops heartbeating is removed from
-- the session by PRUNE_CLIENTS once it lapses. A client that never heartbeats keeps no
-- presence entry and stays registered until it detaches, as in the reference.
--   KEYS: 1 session hash, 2 the workspace's presence ZSET
--   ARGV: 1 session id, 2 client id ('' for none), 3 presence TTL ms
--   -> {1, now ms} seen | {0, ''} no live session | {-1, ''} the client is not registered
if not redis.call('HGET', KEYS[1], {{F.OWNER}}) then return {0, ''} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] ~= '' then
  if redis.call('HEXISTS', KEYS[1], {{F.CLIENT}} .. ARGV[2]) == 0 then return {-1, ''} end
  local ttl = tonumber(ARGV[3])
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[1] .. ' ' .. ARGV[2])
  -- Outlives its newest member by a TTL, so PRUNE_CLIENTS still finds every lapsed one.
  if redis.call('PTTL', KEYS[2]) < 2 * ttl then redis.call('PEXPIRE', KEYS[2], 2 * ttl) end
end
return {1, string.format('%d', now)}
