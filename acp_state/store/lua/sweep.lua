-- SWEEP: the sweeper removes many sessions of one dead incarnation in one workspace in one
-- call (a dead worker may leave 25,000: one APPLY each kept its clients waiting 15 s for
-- their `session_died`). Each session gets the very transition APPLY would give it (the
-- transition prelude), fenced by the dead incarnation: every prompt it had admitted its
-- `turn_error`, then its `session_died`. `@SID@` in the ops stands for each session's id.
-- The sessions it will remove are announced first, as APPLY does, but in one message on the
-- workspace's change channel: one per session loaded every API process as much as the
-- sweep itself.
--   KEYS: 1 live set, 2 catalog hash, 3 catalog order zset, 4 single-scope key,
--         5 the workspace's change channel, 6 its catalog version, 7 its attention index,
--         8 its attention details, 9 the deployment's attention index (its part in the
--         workspace's slot), 10 its details, 11 the workspace's change log; then 5 per session, in ARGV's order: its hash, event
--         stream, transcript stream, turn records, ended turn ids
--   ARGV: 1 incarnation, 2 ops JSON, 3 the session hash's TTL ms, 4... the session ids
--   -> each session's outcome (APPLY's `applied`), in ARGV's order
local inc, template, ttl_ms = ARGV[1], ARGV[2], ARGV[3]
-- One read of each hash serves its transition; a delete applies exactly where the dead
-- incarnation still owns the session.
local flats, owned = {}, {}
for i = 4, #ARGV do
  local hash = KEYS[11 + (i - 4) * 5 + 1]
  local flat = redis.call('HGETALL', hash)
  flats[i] = flat
  for j = 1, #flat, 2 do
    if flat[j] == {{F.OWNER}} then
      if flat[j + 1] == inc then owned[#owned + 1] = ARGV[i] end
      break
    end
  end
end
local decoded = cjson.decode(template)
changed_all(6, 5, 11, owned, decoded.verttl)
-- Each session's copy of the ops (decoded once) has its id in every string that names it.
-- This runs for each of a dead worker's 25,000 sessions, so the strings are split at
-- `@SID@` once, and a session's copy shares everything that names no session.
local function template_of(value)
  if type(value) == 'string' then
    local at = string.find(value, '@SID@', 1, true)
    if not at then return nil end
    local parts, from = {}, 1
    while at do
      parts[#parts + 1] = string.sub(value, from, at - 1)
      from = at + 5
      at = string.find(value, '@SID@', from, true)
    end
    parts[#parts + 1] = string.sub(value, from)
    return {parts = parts}
  elseif type(value) == 'table' then
    local children = nil
    for k, v in pairs(value) do
      local child = template_of(v)
      if child then
        children = children or {}
        children[k] = child
      end
    end
    if children then return {value = value, children = children} end
  end
  return nil
end
local function with_sid(template, sid)
  if template.parts then return table.concat(template.parts, sid) end
  local copy = {}
  for k, v in pairs(template.value) do copy[k] = v end
  for k, child in pairs(template.children) do copy[k] = with_sid(child, sid) end
  return copy
end
local template = template_of(decoded)  -- never nil: `sid` itself is `@SID@`
local batch = {removed = {}}
local outcomes = {}
for i = 4, #ARGV do
  local sid = ARGV[i]
  local ops = with_sid(template, sid)
  local base = 11 + (i - 4) * 5
  local at = {base + 1, base + 2, 1, 2, 3, 4, base + 3, 5, 6, base + 4, base + 5, 7, 8, 9, 10, 11}
  batch.flat = flats[i]
  outcomes[#outcomes + 1] = transition(at, inc, ops, ttl_ms, batch)[1]
end
if #batch.removed > 0 then
  redis.call('SREM', KEYS[1], unpack(batch.removed))
  local single = redis.call('GET', KEYS[4])
  for _, sid in ipairs(batch.removed) do
    if sid == single then redis.call('DEL', KEYS[4]) end
  end
end
return outcomes
