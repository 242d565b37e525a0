-- CLAIM_LOAD: claim the one load that resumes a listed session that is not live, only while
-- its catalog row stands (a DELETE_LISTED of it wins or loses against this, in one slot).
--   KEYS: 1 load claim, 2 catalog hash
--   ARGV: 1 sessionId, 2 request id, 3 the claim's TTL ms
--   -> {'ok'} claimed | {'held', request id of the load under way} | {'gone'} no row
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return {'gone'} end
local held = redis.call('GET', KEYS[1])
if held then return {'held', held} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'ok'}
