-- VOTE: a permission vote. Exactly one vote wins a request, across every API process: the
-- request is removed in the same step that enqueues the winning vote. Checks run in the
-- reference's order (spec §1.4): unknown request, client id, sentinel, offered option.
-- The vote is the command itself (commands.Vote's wire form): what is checked is what is
-- enqueued, and nothing of it is sent twice.
-- With an idempotency key a won vote is kept, and its retry wins again instead of a 404.
-- The status changed without an event of its own, so readers' caches are told on the
-- workspace's change channel.
--   KEYS: 1 session hash, 2 inbox stream, 3 the workspace's change channel,
--         4 the workspace's catalog version, 5 the workspace's attention index, 6 its
--         details, 7 the deployment's attention index (its part in the workspace's slot),
--         8 its details, 9 the workspace's change log, 10 idempotency key (optional)
--   ARGV: 1 incarnation, 2 the vote command's JSON ({"t": "vote", "sid", "rid", "selected",
--         "optionId", "clientId", ...}), 3 inbox TTL ms, 4 inbox max length,
--         5 cancel sentinel, 6 idempotency TTL ms, 7 the catalog version's TTL ms
--   -> 'ok' | 'gone' | 'unknown' | 'client' | 'option'
if KEYS[10] and redis.call('GET', KEYS[10]) then return 'ok' end
local vote = cjson.decode(ARGV[2])
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return 'gone' end
local votable = redis.call('HGET', KEYS[1], {{F.VOTABLE}} .. vote.rid)
if not votable then return 'unknown' end
local client = vote.clientId
if type(client) == 'string' and client ~= '' and redis.call('HEXISTS', KEYS[1], {{F.CLIENT}} .. client) == 0 then
  return 'client'
end
if vote.selected == true then
  if vote.optionId == ARGV[5] then return 'option' end
  local offered = false
  for _, id in ipairs(cjson.decode(votable)[2]) do
    if id == vote.optionId then offered = true break end
  end
  if not offered then return 'option' end
end
redis.call('HDEL', KEYS[1], {{F.INTERACTION}} .. vote.rid, {{F.VOTABLE}} .. vote.rid)
attention_unset({5, 6, 7, 8}, vote.sid, {{F.INTERACTION}} .. vote.rid)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
changed(4, 3, 9, vote.sid, ARGV[7])
if KEYS[10] then redis.call('SET', KEYS[10], vote.rid, 'PX', ARGV[6]) end
return 'ok'
