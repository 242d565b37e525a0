-- LIST: one page of a workspace listing: catalog rows newest first, each with its live
-- session hash when the session is live. A script may only touch the keys it declares, and
-- which sessions a page holds is known only once the page is read: the caller declares the
-- session hashes it expects (KEYS 4...), and a live session it did not declare is answered
-- `false`, for the caller to declare and ask again.
--   KEYS: 1 live set, 2 catalog hash, 3 catalog order, 4... session hashes of the ids in
--         ARGV 3...
--   ARGV: 1 offset, 2 page size, 3... the session ids whose hashes KEYS 4... are
--   -> flat list: id, row JSON or '', then the session hash (flat HGETALL), {} when not
--      live, or false when live and not declared; size + 1 ids at most
local declared = {}
for i = 3, #ARGV do declared[ARGV[i]] = KEYS[i + 1] end
local first = tonumber(ARGV[1])
local ids = redis.call('ZREVRANGE', KEYS[3], first, first + tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
  if redis.call('SISMEMBER', KEYS[1], id) == 0 then
    out[#out + 1] = {}
  elseif declared[id] then
    out[#out + 1] = redis.call('HGETALL', declared[id])
  else
    out[#out + 1] = false
  end
end
return out
