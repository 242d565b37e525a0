"""Every Lua script of acp-state, in one place.

Each script touches the keys of one workspace slot only (see keys.py), so each state
transition is one atomic round trip on a single Redis and on a cluster alike. Live messages
go out with SPUBLISH (sharded pub/sub, Redis >= 7.0): on a cluster they stay on the slot's
shard instead of being broadcast to every node, and a single Redis treats them as ordinary
pub/sub. Numbers that must survive Lua's float formatting (timestamps) travel as strings.
"""

# A worker's state transition: update the session hash, append each event to the replay
# log and publish it, and keep the listing set and the catalog in step, all or nothing.
# Readers' caches are told first (the workspace's change channel), so that a process never
# delivers an event and then serves a cached status from before it.
# Every write is fenced by the owner's incarnation, so a worker that lost its lease (and
# was swept) can no longer resurrect or modify a session.
#   KEYS: 1 session hash, 2 event stream (also the pub/sub channel), 3 live set,
#         4 catalog hash, 5 catalog order zset, 6 single-scope key, 7 transcript stream
#   ARGV: 1 incarnation, 2 ops JSON (see RedisStore.apply), 3 the workspace's change channel
#   -> {applied (1, 0 fenced, -1 owned by another), last event id, epoch}
APPLY = """
local inc = ARGV[1]
local ops = cjson.decode(ARGV[2])
local owner = redis.call('HGET', KEYS[1], 'inc')
if ops.mode == 'create' then
  if owner and owner ~= inc then return {-1, 0, ''} end
  -- A whole snapshot (first publish, or a rewrite under a new epoch): start clean.
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], 'inc', inc)
  redis.call('SADD', KEYS[3], ops.sid)
  if ops.single then redis.call('SET', KEYS[6], ops.sid) end
elseif owner ~= inc then
  return {0, 0, ''}
end
if ops.set then
  local args = {}
  for k, v in pairs(ops.set) do args[#args + 1] = k; args[#args + 1] = v end
  if #args > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
end
if ops.del and #ops.del > 0 then redis.call('HDEL', KEYS[1], unpack(ops.del)) end
if ops.incr then
  for k, n in pairs(ops.incr) do redis.call('HINCRBY', KEYS[1], k, n) end
end
redis.call('SPUBLISH', ARGV[3], ops.sid)
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local epoch = redis.call('HGET', KEYS[1], 'epoch') or ''
if ops.events and #ops.events > 0 then
  local transcript = {}
  for _, i in ipairs(ops.tr or {}) do transcript[i] = true end
  for i, body in ipairs(ops.events) do
    seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    local envelope = '{"id":' .. seq .. ',' .. body .. '}'
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ops.evmax, seq .. '-0', 'e', envelope)
    redis.call('SPUBLISH', KEYS[2], envelope)
    if ops.tev == i then redis.call('HSET', KEYS[1], 'tev', envelope) end
    if transcript[i] then
      redis.call('XADD', KEYS[7], 'MAXLEN', '~', ops.trmax, '*', 'e', envelope)
    end
  end
  redis.call('PEXPIRE', KEYS[2], ops.evttl)
  if ops.tr and #ops.tr > 0 then redis.call('PEXPIRE', KEYS[7], ops.trttl) end
end
if ops.catalog then
  redis.call('HSET', KEYS[4], ops.sid, ops.catalog)
  redis.call('ZADD', KEYS[5], ops.score, ops.sid)
  redis.call('PEXPIRE', KEYS[4], ops.retention)
  redis.call('PEXPIRE', KEYS[5], ops.retention)
  local stale = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. ops.cutoff, 'LIMIT', 0, 64)
  for _, id in ipairs(stale) do
    if redis.call('SISMEMBER', KEYS[3], id) == 0 then
      redis.call('HDEL', KEYS[4], id)
      redis.call('ZREM', KEYS[5], id)
    end
  end
end
if ops.mode == 'delete' then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ops.sid)
  if redis.call('GET', KEYS[6]) == ops.sid then redis.call('DEL', KEYS[6]) end
end
return {1, seq, epoch}
"""

# An API process hands a command to the session's owner: fenced by the owner's incarnation,
# and for prompts also admission-controlled (running + queued < limit) in the same step.
#   KEYS: 1 session hash, 2 inbox stream
#   ARGV: 1 incarnation, 2 command JSON, 3 admission limit ('' = no admission),
#         4 inbox TTL ms, 5 inbox max length
#   -> {'ok', last event id, epoch} | {'gone'} | {'full'}
SEND = """
if redis.call('HGET', KEYS[1], 'inc') ~= ARGV[1] then return {'gone'} end
if ARGV[3] ~= '' then
  local admitted = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
  if admitted >= tonumber(ARGV[3]) then return {'full'} end
  redis.call('HINCRBY', KEYS[1], 'n', 1)
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {'ok', redis.call('HGET', KEYS[1], 'seq') or '0', redis.call('HGET', KEYS[1], 'epoch') or ''}
"""

# A permission vote: exactly one vote wins a request, across every API process. Checks run
# in the reference's order (spec §1.4): unknown request, client id, sentinel, offered option.
#   KEYS: 1 session hash, 2 inbox stream
#   ARGV: 1 incarnation, 2 requestId, 3 'selected'|'cancelled', 4 optionId, 5 clientId or '',
#         6 command JSON, 7 inbox TTL ms, 8 inbox max length, 9 cancel sentinel,
#         10 the workspace's change channel, 11 sessionId
# The status changed without an event of its own, so readers' caches are told on the
# workspace's change channel.
#   -> 'ok' | 'gone' | 'unknown' | 'client' | 'option'
VOTE = """
if redis.call('HGET', KEYS[1], 'inc') ~= ARGV[1] then return 'gone' end
local votable = redis.call('HGET', KEYS[1], 'pv:' .. ARGV[2])
if not votable then return 'unknown' end
if ARGV[5] ~= '' and redis.call('HEXISTS', KEYS[1], 'c:' .. ARGV[5]) == 0 then return 'client' end
if ARGV[3] == 'selected' then
  if ARGV[4] == ARGV[9] then return 'option' end
  local offered = false
  for _, id in ipairs(cjson.decode(votable)[2]) do
    if id == ARGV[4] then offered = true break end
  end
  if not offered then return 'option' end
end
redis.call('HDEL', KEYS[1], 'pi:' .. ARGV[2], 'pv:' .. ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'c', ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
redis.call('SPUBLISH', ARGV[10], ARGV[11])
return 'ok'
"""

# Register a client id on a live session (attach) and tell the owner, fenced by the owner.
#   KEYS: 1 session hash, 2 inbox stream
#   ARGV: 1 incarnation, 2 clientId, 3 command JSON, 4 inbox TTL ms, 5 inbox max length,
#         6 the workspace's change channel, 7 sessionId
#   -> 1 | 0 (gone)
ATTACH = """
if redis.call('HGET', KEYS[1], 'inc') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'c:' .. ARGV[2], '1')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SPUBLISH', ARGV[6], ARGV[7])
return 1
"""

# One page of a workspace listing in one round trip: catalog rows newest first, each with
# its live session hash when the session is live. The session hashes share the workspace's
# hash tag, so the script stays inside one slot.
#   KEYS: 1 live set, 2 catalog hash, 3 catalog order
#   ARGV: 1 session key prefix, 2 offset, 3 page size
#   -> flat list: id, row JSON or '', session hash (flat HGETALL) or {} ... (size + 1 ids at most)
LIST = """
local first = tonumber(ARGV[2])
local ids = redis.call('ZREVRANGE', KEYS[3], first, first + tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
  if redis.call('SISMEMBER', KEYS[1], id) == 1 then
    out[#out + 1] = redis.call('HGETALL', ARGV[1] .. id)
  else
    out[#out + 1] = {}
  end
end
return out
"""
