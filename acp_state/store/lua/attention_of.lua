-- ATTENTION_OF: what one session waits for, as its workspace's attention index holds it.
--   KEYS: 1 the session hash, 2 the workspace's attention index, 3 its details
--   ARGV: 1 the session id
--   -> flat list: member, since, details, for each pending interaction and turn error
local out = {}
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  local member = attention_member(ARGV[1], field)
  if member then
    local since = redis.call('ZSCORE', KEYS[2], member)
    if since then
      out[#out + 1] = member
      out[#out + 1] = since
      out[#out + 1] = redis.call('HGET', KEYS[3], member)
    end
  end
end
return out
