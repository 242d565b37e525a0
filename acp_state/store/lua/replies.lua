-- The replies prelude, shared by ABANDON, TAKE and RECLAIM. A reply list holds a worker's
-- answer (or the abandoned marker an API leaves when it stops waiting); its given list
-- holds the given marker and, before it, each answer an API took: the record of the taking.
-- `reply` and `given` are indexes in KEYS.
-- The answer an API took already, or nil.
local function taken_answer(given, given_marker)
  local taken = redis.call('LINDEX', KEYS[given], 0)
  if taken and taken ~= given_marker then return taken end
  return nil
end
-- Take the answer still in the reply list (moved to the given list, which keeps its TTL),
-- else the one taken already; nil if there is neither.
local function take_answer(reply, given, abandoned, given_marker, ttl_s)
  local head = redis.call('LINDEX', KEYS[reply], 0)
  if head and head ~= abandoned then
    redis.call('LMOVE', KEYS[reply], KEYS[given], 'LEFT', 'LEFT')
    if redis.call('TTL', KEYS[given]) < 0 then redis.call('EXPIRE', KEYS[given], ttl_s) end
    return head
  end
  return taken_answer(given, given_marker)
end
