-- DELETE_LISTED: `DELETE /session/:id` of a session that is listed and not live (its worker
-- died and was swept, or it was closed): its catalog row goes, with everything acp-state
-- keeps of it (turn records, transcript, replay log), in one step, so a later load finds
-- nothing to resume. It races a load (`POST /session/:id/load`) in this slot: CLAIM_LOAD
-- claims a load only while the row stands, and this deletes only while no load is claimed
-- and no session hash is there, so exactly one of them wins (a resume that outlived its
-- claim is refused by APPLY's resumed CREATE once the row is gone). The agent's own history
-- (its --state-dir) is not acp-state's and stays (docs/api.md, "Deleting a session").
-- Readers are told on the workspace's change channel, as for any change of a listing.
--   KEYS: 1 session hash, 2 load claim, 3 live set, 4 catalog hash, 5 catalog order zset,
--         6 turn records, 7 ended turn ids, 8 transcript stream, 9 event stream,
--         10 the workspace's change channel, 11 its catalog version, 12 its change log,
--         13 idempotency key (optional)
--   ARGV: 1 sessionId, 2 the catalog version's TTL ms, 3 idempotency TTL ms
--   -> 'deleted' | 'repeat' (the kept first outcome of this key) | 'live' (a session hash is
--      there: live, or its dead owner's not swept yet) | 'loading' (a load claimed it) |
--      'missing' (no row)
if KEYS[13] and redis.call('EXISTS', KEYS[13]) == 1 then return 'repeat' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'live' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'loading' end
if redis.call('HDEL', KEYS[4], ARGV[1]) == 0 then return 'missing' end
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[6], KEYS[7], KEYS[8], KEYS[9])
changed(11, 10, 12, ARGV[1], ARGV[2])
if KEYS[13] then redis.call('SET', KEYS[13], 'deleted', 'PX', ARGV[3]) end
return 'deleted'
