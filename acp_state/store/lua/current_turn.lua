-- CURRENT_TURN: the turn `GET /session/:id/turns/current` answers, in one read: the running
-- one, else the oldest queued one (of the prompts admitted and not yet ended: the session's
-- p:<promptId> fields), else the one that ended last.
--   KEYS: 1 session hash, 2 the session's turn records, 3 the ids of its ended turns
--   -> the record JSON, or false when the session never had a turn
local prefix = {{F.PROMPT}}
local oldest, oldest_at = nil, nil
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(name, 1, #prefix) == prefix then
    local packed = redis.call('HGET', KEYS[2], string.sub(name, #prefix + 1))
    if packed then
      local turn = cjson.decode(packed)
      if turn.state == 'running' then return packed end
      if turn.state == 'queued' and (oldest == nil or turn.queued_at < oldest_at) then
        oldest, oldest_at = packed, turn.queued_at
      end
    end
  end
end
if oldest then return oldest end
local last = redis.call('LINDEX', KEYS[3], -1)
if last then return redis.call('HGET', KEYS[2], last) end
return false
