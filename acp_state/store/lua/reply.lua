-- REPLY: a worker answers a create or close, unless the API stopped waiting: then the
-- worker is told (0), and undoes what nobody was told of (a create). The answer goes with
-- its given list: the record of its taking (an API's take moves the answer there), made
-- here so that it carries the reply's TTL. A retry of a reply that was given (its answer
-- lost on the way back) gives nothing twice: a second copy left unread would later be taken
-- back as if nobody had been told.
--   KEYS: 1 reply list, 2 its given list
--   ARGV: 1 reply JSON, 2 TTL s, 3 the abandoned marker, 4 the given marker
--   -> 1 delivered | 0 abandoned
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
if redis.call('LINDEX', KEYS[1], 0) == ARGV[3] then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
