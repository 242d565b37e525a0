-- SEND: an API process hands a command to the session's owner, fenced by the owner's
-- incarnation, and for prompts also admission-controlled (running + queued < limit) in the
-- same step. An admitted prompt is recorded (field p:<promptId>) until its terminal, so
-- whoever removes the session (its owner closing it, a sweeper) ends it even if the owner
-- never read it. With an idempotency key the first success is kept, and a retry returns it
-- unchanged.
-- An admitted prompt's turn record (queued) is written in the same step, so its turn status
-- answers on every API process as soon as the prompt is acknowledged.
-- While the owner moves the session to another worker (field mv, see move.lua), a command
-- waits in the session's parked stream instead, for the new owner to take in order.
--   KEYS: 1 session hash, 2 inbox stream, 3 the session's turn records,
--         4 the session's parked stream, 5 idempotency key (optional)
--   ARGV: 1 incarnation, 2 command JSON, 3 admission limit ('' = no admission),
--         4 inbox TTL ms, 5 inbox max length, 6 promptId ('' unless a prompt),
--         7 idempotency TTL ms, 8 the prompt's turn record JSON ('' unless a prompt),
--         9 the turn records' TTL ms
--   -> {'ok', last event id, epoch, promptId[, 'repeat' when it is the kept first outcome]}
--      | {'gone'} | {'full'}
if KEYS[5] then
  local first = redis.call('GET', KEYS[5])
  if first then
    local result = cjson.decode(first)
    result[5] = 'repeat'
    return result
  end
end
if redis.call('HGET', KEYS[1], {{F.OWNER}}) ~= ARGV[1] then return {'gone'} end
if ARGV[3] ~= '' then
  local admitted = tonumber(redis.call('HGET', KEYS[1], {{F.ADMITTED}}) or '0')
  if admitted >= tonumber(ARGV[3]) then return {'full'} end
  redis.call('HINCRBY', KEYS[1], {{F.ADMITTED}}, 1)
end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], {{F.PROMPT}} .. ARGV[6], '1') end
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[6], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[9])
end
local queue = KEYS[2]
if redis.call('HEXISTS', KEYS[1], {{F.MOVING}}) == 1 then queue = KEYS[4] end
redis.call('XADD', queue, 'MAXLEN', '~', ARGV[5], '*', 'c', ARGV[2])
redis.call('PEXPIRE', queue, ARGV[4])
local result = {'ok', redis.call('HGET', KEYS[1], {{F.SEQ}}) or '0', redis.call('HGET', KEYS[1], {{F.EPOCH}}) or '', ARGV[6]}
if KEYS[5] then redis.call('SET', KEYS[5], cjson.encode(result), 'PX', ARGV[7]) end
return result
