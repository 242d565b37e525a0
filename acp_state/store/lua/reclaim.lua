-- RECLAIM: a worker, past its API's wait, takes back a create's answer that nobody took:
-- nobody was told of that session, so the worker undoes it. An answer in the given list
-- was taken (its taker told its client, or said the outcome is unknown). An answer in
-- neither was lost with its keys (Redis restarted empty, a failover): if an API gave up on
-- it since (the abandoned marker), that API said it failed, and it is undone too;
-- otherwise its API took it before the loss (an answer is taken within moments, and an API
-- that waits in vain leaves the marker).
--   KEYS: 1 reply list, 2 its given list   ARGV: 1 the answer JSON, 2 the given marker,
--   3 the abandoned marker
--   -> 1 untaken (taken back now, or given up on) | 0 taken | -1 lost, nobody gave up on it
if redis.call('LREM', KEYS[1], 0, ARGV[1]) > 0 then return 1 end
if taken_answer(2, ARGV[2]) then return 0 end
if redis.call('LINDEX', KEYS[1], 0) == ARGV[3] then return 1 end
return -1
