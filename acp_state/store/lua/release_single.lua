-- RELEASE_SINGLE: drop a claim on the workspace's single-scope slot that did not turn into
-- a live session, unless another session holds it by now (compare-and-delete).
--   KEYS: 1 single-scope key   ARGV: 1 sessionId   -> 1 deleted | 0
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
