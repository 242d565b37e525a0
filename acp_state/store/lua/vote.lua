-- VOTE: a permission vote. Exactly one vote wins a request, across every API process: the
-- request is removed in the same step that enqueues the winning vote. Checks run in the
-- reference's order (spec §1.4): unknown request, client id, sentinel, offered option.
-- With an idempotency key a won vote is kept, and its retry wins again instead of a 404.
-- The status changed without an event of its own, so readers' caches are told on the
-- workspace's change channel.
--   KEYS: 1 session hash, 2 inbox stream, 3 the workspace's change channel,
--         4 the workspace's catalog version, 5 the workspace's attention index, 6 its
--         details, 7 idempotency key (optional)
--   ARGV: 1 incarnation, 2 requestId, 3 'selected'|'cancelled', 4 optionId, 5 clientId or '',
--         6 command JSON, 7 inbox TTL ms, 8 inbox max length, 9 cancel sentinel,
--         10 sessionId, 11 idempotency TTL ms, 12 the catalog version's TTL ms
--   -> 'ok' | 'gone' | 'unknown' | 'client' | 'option'
if KEYS[7] and redis.call('GET', KEYS[7]) then return 'ok' end
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 'gone' end
local votable = redis.call('HGET', KEYS[1], {{F.VOTABLE}} .. ARGV[2])
if not votable then return 'unknown' end
if ARGV[5] ~= '' and redis.call('HEXISTS', KEYS[1], {{F.CLIENT}} .. ARGV[5]) == 0 then return 'client' end
if ARGV[3] == 'selected' then
  if ARGV[4] == ARGV[9] then return 'option' end
  local offered = false
  for _, id in ipairs(cjson.decode(votable)[2]) do
    if id == ARGV[4] then offered = true break end
  end
  if not offered then return 'option' end
end
redis.call('HDEL', KEYS[1], {{F.INTERACTION}} .. ARGV[2], {{F.VOTABLE}} .. ARGV[2])
attention_unset(5, 6, ARGV[10], {{F.INTERACTION}} .. ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'c', ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
changed(4, 3, ARGV[10], ARGV[12])
if KEYS[7] then redis.call('SET', KEYS[7], ARGV[2], 'PX', ARGV[11]) end
return 'ok'
