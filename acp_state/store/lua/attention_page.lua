-- ATTENTION_PAGE: one workspace's part of an attention page, oldest wait first: the index
-- members after a cursor, with their details. Equal waits are ordered by member, as the
-- index orders them.
--   KEYS: 1 the workspace's attention index, 2 its details
--   ARGV: 1 the cursor's since (ms; '' from the start), 2 'gt': only members waiting since
--         later than it, 'ge': also those of the same since whose member sorts after ARGV 3,
--         3 the cursor's member, 4 how many at most
--   -> flat list: member, since, details (false if missing); ARGV 4 entries at most
local limit = tonumber(ARGV[4])
local after = ARGV[1] ~= '' and tonumber(ARGV[1]) or nil
local out, offset = {}, 0
while #out < limit * 3 do
  local batch = redis.call('ZRANGE', KEYS[1], after and after or '-inf', '+inf', 'BYSCORE', 'LIMIT', offset, limit, 'WITHSCORES')
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local member, since = batch[i], tonumber(batch[i + 1])
    if not after or since > after or (ARGV[2] == 'ge' and member > ARGV[3]) then
      if #out < limit * 3 then
        out[#out + 1] = member
        out[#out + 1] = batch[i + 1]
        out[#out + 1] = redis.call('HGET', KEYS[2], member)
      end
    end
  end
  offset = offset + #batch / 2
end
return out
