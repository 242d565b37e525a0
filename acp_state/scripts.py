"""Every Lua script of acp-state, in one place.

Each script touches the keys of one workspace slot only (see keys.py), so each state
transition is one atomic round trip on a single Redis and on a cluster alike. Live messages
go out with SPUBLISH (sharded pub/sub, Redis >= 7.0): on a cluster they stay on the slot's
shard instead of being broadcast to every node, and a single Redis treats them as ordinary
pub/sub. Numbers that must survive Lua's float formatting (timestamps) travel as strings.
"""

# A worker's state transition: update the session hash, append each event to the replay
# log and publish it, and keep the listing set and the catalog in step, all or nothing.
# Transitions carry the session's running number (`op`): one whose answer was lost is
# retried, and applies once.
# Readers' caches are told first (the workspace's change channel), so that a process never
# delivers an event and then serves a cached status from before it.
# Every write is fenced by the owner's incarnation, so a worker that lost its lease (and
# was swept) can no longer resurrect or modify a session.
#   KEYS: 1 session hash, 2 event stream (also the pub/sub channel), 3 live set,
#         4 catalog hash, 5 catalog order zset, 6 single-scope key, 7 transcript stream
#   ARGV: 1 incarnation, 2 ops JSON (see RedisStore.apply), 3 the workspace's change channel,
#         4 the session hash's TTL ms (refreshed by every transition)
#   -> {applied, last event id, epoch}; applied: 1, 0 the session is not in the store (data
#      loss, or swept: the worker asks the registry which), -1 another incarnation owns it,
#      2 a rewrite (`missing_only`) found the session already there
APPLY = """
local inc = ARGV[1]
local ops = cjson.decode(ARGV[2])
local owner = redis.call('HGET', KEYS[1], 'inc')
if ops.op and owner == inc and tonumber(redis.call('HGET', KEYS[1], 'op') or '0') >= ops.op then
  -- A retry of a transition that did apply (its answer was lost): nothing happens twice.
  return {1, tonumber(redis.call('HGET', KEYS[1], 'seq') or '0'), redis.call('HGET', KEYS[1], 'epoch') or ''}
end
if ops.mode == 'create' then
  if owner and owner ~= inc then return {-1, 0, ''} end
  if owner and ops.missing_only then
    -- A rewrite after a loss, but the session is here (another path rewrote it first).
    return {2, tonumber(redis.call('HGET', KEYS[1], 'seq') or '0'), redis.call('HGET', KEYS[1], 'epoch') or ''}
  end
  -- A whole snapshot (first publish, or a rewrite under a new epoch): start clean.
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], 'inc', inc)
  redis.call('SADD', KEYS[3], ops.sid)
  redis.call('PEXPIRE', KEYS[3], ops.retention or ARGV[4])
  if ops.single then redis.call('SET', KEYS[6], ops.sid) end
elseif not owner then
  return {0, 0, ''}
elseif owner ~= inc then
  return {-1, 0, ''}
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
local bodies = ops.events or {}
if ops.mode == 'delete' and ops.orphan then
  -- Prompts admitted (field p:<promptId>) that the transition does not end itself: the
  -- owner never saw them (a close raced them) or is dead. Each gets its one terminal
  -- before the session's own last event.
  local orphans = {}
  local fields = redis.call('HKEYS', KEYS[1])
  for _, name in ipairs(fields) do
    if string.sub(name, 1, 2) == 'p:' then
      local pid = string.sub(name, 3)
      orphans[#orphans + 1] = (string.gsub(ops.orphan, '@PID@', pid))
    end
  end
  if #orphans > 0 then
    for _, body in ipairs(bodies) do orphans[#orphans + 1] = body end
    bodies = orphans
  end
end
if #bodies > 0 then
  local transcript = {}
  for _, i in ipairs(ops.tr or {}) do transcript[i] = true end
  local shift = #bodies - #(ops.events or {})
  for i, body in ipairs(bodies) do
    seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    local envelope = '{"id":' .. seq .. ',' .. body .. '}'
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ops.evmax, seq .. '-0', 'e', envelope)
    redis.call('SPUBLISH', KEYS[2], envelope)
    if ops.tev == i - shift then redis.call('HSET', KEYS[1], 'tev', envelope) end
    if transcript[i - shift] then
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
  if ops.uncatalog then
    redis.call('HDEL', KEYS[4], ops.sid)
    redis.call('ZREM', KEYS[5], ops.sid)
  end
else
  if ops.op then redis.call('HSET', KEYS[1], 'op', ops.op) end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {1, seq, epoch}
"""

# An API process hands a command to the session's owner: fenced by the owner's incarnation,
# and for prompts also admission-controlled (running + queued < limit) in the same step. An
# admitted prompt is recorded (field p:<promptId>) until its terminal, so whoever removes
# the session (its owner closing it, a sweeper) ends it even if the owner never read it.
# With an idempotency key the first success is kept, and a retry returns it unchanged.
#   KEYS: 1 session hash, 2 inbox stream, 3 idempotency key (optional)
#   ARGV: 1 incarnation, 2 command JSON, 3 admission limit ('' = no admission),
#         4 inbox TTL ms, 5 inbox max length, 6 promptId ('' unless a prompt),
#         7 idempotency TTL ms
#   -> {'ok', last event id, epoch, promptId[, 'repeat' when it is the kept first outcome]}
#      | {'gone'} | {'full'}
SEND = """
if KEYS[3] then
  local first = redis.call('GET', KEYS[3])
  if first then
    local result = cjson.decode(first)
    result[5] = 'repeat'
    return result
  end
end
if redis.call('HGET', KEYS[1], 'inc') ~= ARGV[1] then return {'gone'} end
if ARGV[3] ~= '' then
  local admitted = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
  if admitted >= tonumber(ARGV[3]) then return {'full'} end
  redis.call('HINCRBY', KEYS[1], 'n', 1)
end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'p:' .. ARGV[6], '1') end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local result = {'ok', redis.call('HGET', KEYS[1], 'seq') or '0', redis.call('HGET', KEYS[1], 'epoch') or '', ARGV[6]}
if KEYS[3] then redis.call('SET', KEYS[3], cjson.encode(result), 'PX', ARGV[7]) end
return result
"""

# A permission vote: exactly one vote wins a request, across every API process. Checks run
# in the reference's order (spec §1.4): unknown request, client id, sentinel, offered option.
# With an idempotency key a won vote is kept, and its retry wins again instead of a 404.
#   KEYS: 1 session hash, 2 inbox stream, 3 idempotency key (optional)
#   ARGV: 1 incarnation, 2 requestId, 3 'selected'|'cancelled', 4 optionId, 5 clientId or '',
#         6 command JSON, 7 inbox TTL ms, 8 inbox max length, 9 cancel sentinel,
#         10 the workspace's change channel, 11 sessionId, 12 idempotency TTL ms
# The status changed without an event of its own, so readers' caches are told on the
# workspace's change channel.
#   -> 'ok' | 'gone' | 'unknown' | 'client' | 'option'
VOTE = """
if KEYS[3] and redis.call('GET', KEYS[3]) then return 'ok' end
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
if KEYS[3] then redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[12]) end
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


# ---- the registry: leases judged on Redis's clock --------------------------------------
#
# Shared by the scripts below. `tick` keeps the store's own record of when it last served
# a lease decision: a silence longer than half the shortest lease means the store itself
# stalled (DEBUG SLEEP, CLIENT PAUSE, out of memory, a restart, a failover), and the time it
# came back is kept as `stall`. No worker is declared dead until the store has served for a
# whole lease of that worker since then, so a healthy worker always gets to renew first.
#   KEYS (all scripts below): 1 workers, 2 reports, 3 leases, 4 dead, 5 sweeps, 6 clock
_REGISTRY_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function tick(own_lease)
  local shortest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local lease = tonumber(shortest[2] or own_lease or '0')
  if own_lease and own_lease < lease then lease = own_lease end
  local last = tonumber(redis.call('HGET', KEYS[6], 'tick') or '0')
  if lease > 0 and now - last > lease / 2 then
    redis.call('HSET', KEYS[6], 'stall', string.format('%d', now))
  end
  if now > last then redis.call('HSET', KEYS[6], 'tick', string.format('%d', now)) end
end
local function keep(ttl)
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl) end
end
"""

# A worker renews its lease (constant cost, whatever its session count). A tombstoned
# incarnation is told it is dead and renews nothing: dead stays dead.
#   ARGV: 1 incarnation, 2 lease ms, 3 load report JSON, 4 registry TTL ms
#   -> {'held' | 'late' (renewed after its deadline, before anyone declared it dead)
#       | 'new' (no lease was held: a first registration, or the store lost it)
#       | 'dead', Redis time ms}
HEARTBEAT = _REGISTRY_PRELUDE + """
local inc, lease = ARGV[1], tonumber(ARGV[2])
tick(lease)
if redis.call('ZSCORE', KEYS[4], inc) then return {'dead', string.format('%d', now)} end
local deadline = redis.call('ZSCORE', KEYS[1], inc)
redis.call('ZADD', KEYS[1], now + lease, inc)
redis.call('HSET', KEYS[2], inc, ARGV[3])
redis.call('ZADD', KEYS[3], lease, inc)
keep(ARGV[4])
local held = 'new'
if deadline then held = (tonumber(deadline) < now) and 'late' or 'held' end
return {held, string.format('%d', now)}
"""

# A sweeper claims dead workers: those whose deadline passed while the store was serving
# for at least their whole lease. Each is moved to the tombstones and claimed for CLAIM ms
# by exactly one caller; a claim that expires (its sweeper died) is handed out again.
# Every sweeper round is also a tick, so the shortest lease is returned for sweepers to
# keep their pace well inside half of it.
#   ARGV: 1 claim ms, 2 tombstone retention ms, 3 registry TTL ms, 4 at most this many
#   -> {the shortest registered lease ms (0: none), claimed incarnations...}
CLAIM_DEAD = _REGISTRY_PRELUDE + """
tick(nil)
local claim, limit = tonumber(ARGV[1]), tonumber(ARGV[4])
local stall = tonumber(redis.call('HGET', KEYS[6], 'stall') or '0')
local shortest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
local out = {shortest[2] or '0'}
for _, inc in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, limit)) do
  redis.call('ZADD', KEYS[5], now + claim, inc)
  out[#out + 1] = inc
end
for _, inc in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, limit)) do
  local lease = tonumber(redis.call('ZSCORE', KEYS[3], inc) or '0')
  if now - stall >= lease then
    redis.call('ZREM', KEYS[1], inc)
    redis.call('HDEL', KEYS[2], inc)
    redis.call('ZREM', KEYS[3], inc)
    redis.call('ZADD', KEYS[4], now, inc)
    redis.call('ZADD', KEYS[5], now + claim, inc)
    out[#out + 1] = inc
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - tonumber(ARGV[2])))
keep(ARGV[3])
return out
"""

# A worker leaves cleanly (SIGTERM, after closing its sessions): no longer registered.
#   ARGV: 1 incarnation
RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# A worker gives up an incarnation it cannot vouch for (it woke past its lease and the store
# no longer knew it): declared dead by itself, tombstoned, and claimable by a sweeper now.
#   ARGV: 1 incarnation, 2 registry TTL ms
RESIGN = _REGISTRY_PRELUDE + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('ZADD', KEYS[5], now, ARGV[1])
keep(ARGV[2])
return 1
"""


# A worker answers a create or close, unless the API stopped waiting: then the worker is
# told (0), and undoes what nobody was told of (a create). A retry of a reply that was given
# (its answer lost on the way back) gives nothing twice: a second copy left unread would
# later be taken back as if nobody had been told.
#   KEYS: 1 reply list, 2 its given marker   ARGV: 1 reply JSON, 2 TTL s, 3 the abandoned marker
#   -> 1 delivered | 0 abandoned
REPLY = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
if redis.call('LINDEX', KEYS[1], 0) == ARGV[3] then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# The API stops waiting for a reply: it takes one that arrived meanwhile, or leaves the
# marker that tells the worker nobody is waiting any more.
#   KEYS: 1 reply list   ARGV: 1 TTL s, 2 the abandoned marker
#   -> the reply, or false
ABANDON = """
local reply = redis.call('RPOP', KEYS[1])
if reply and reply ~= ARGV[2] then return reply end
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return false
"""


# A retried create takes the first create's reply, which its API stopped waiting for
# without being able to say so: the reply, the abandoned marker (left in place), or false.
#   KEYS: 1 reply list   ARGV: 1 the abandoned marker
TAKE = """
local reply = redis.call('LPOP', KEYS[1])
if reply == ARGV[1] then redis.call('LPUSH', KEYS[1], reply) end
return reply
"""
