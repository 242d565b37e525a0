-- VERSION: the workspace's catalog version, starting a new generation at revision 0 when
-- the hash is missing (see the changes prelude); the change log of the generation before
-- goes with it (its revisions mean nothing in the new one).
--   KEYS: 1 catalog version hash, 2 the workspace's change log
--   ARGV: 1 the hash's TTL ms
--   -> {generation, revision}
if redis.call('HSETNX', KEYS[1], {{VER.GENERATION}}, new_generation()) == 1 then
  redis.call('HSET', KEYS[1], {{VER.REVISION}}, 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
end
return redis.call('HMGET', KEYS[1], {{VER.GENERATION}}, {{VER.REVISION}})
