-- PRUNE_CLIENTS: remove the clients whose presence lapsed (no heartbeat within its TTL) from
-- their sessions, as a DETACH would: each entry is checked again here against Redis's clock
-- (a heartbeat since the caller read it keeps it), and against the owner the caller read (a
-- session that changed hands is left to the next round).
--   KEYS: 1 the workspace's presence ZSET, 2 its change channel, 3 its catalog version,
--         4 its change log, then per entry: the session hash and its owner's inbox stream
--   ARGV: 1 inbox TTL ms, 2 inbox max length, 3 the catalog version's TTL ms, then per entry:
--         the member (`<sid> <clientId>`) and the owner's incarnation read with it
--   -> the number of clients removed
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sids, removed = {}, 0
for i = 4, #ARGV, 2 do
  local member, owner = ARGV[i], ARGV[i + 1]
  local hash, inbox = KEYS[5 + (i - 4)], KEYS[6 + (i - 4)]
  local lapses = redis.call('ZSCORE', KEYS[1], member)
  if lapses and tonumber(lapses) <= now then
    local sid, client = string.match(member, '^(%S+) (%S+)$')
    local current = redis.call('HGET', hash, {{F.OWNER}})
    if not current then
      redis.call('ZREM', KEYS[1], member)  -- the session left: nothing to tell
    elseif current == owner then
      redis.call('ZREM', KEYS[1], member)
      if redis.call('HDEL', hash, {{F.CLIENT}} .. client) == 1 then
        redis.call('XADD', inbox, 'MAXLEN', '~', ARGV[2], '*', 'c',
          cjson.encode({t = 'detach', sid = sid, clientId = client}))
        redis.call('PEXPIRE', inbox, ARGV[1])
        sids[#sids + 1] = sid
        removed = removed + 1
      end
    end
  end
end
changed_all(3, 2, 4, sids, ARGV[3])
return removed
