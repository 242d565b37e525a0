-- RECLAIM: a worker, past its API's wait, takes back a create's answer that nobody took:
-- nobody was told of that session, so the worker undoes it. An answer in the given list
-- was taken (its taker told its client, or said the outcome is unknown). An answer in
-- neither was lost with its keys (a failover, an expiry): nothing says who knows.
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 the answer JSON, 2 the given marker
--   -> 1 untaken (taken back now) | 0 taken | -1 lost
if redis.call('LREM', KEYS[1], 0, ARGV[1]) > 0 then return 1 end
local taken = redis.call('LINDEX', KEYS[2], 0)
if taken and taken ~= ARGV[2] then return 0 end
return -1
