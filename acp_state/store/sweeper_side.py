"""The sweeper's side of `RedisStore` (`SweeperStore`): declaring workers dead, and removing
what each left (its sessions, its index, its streams).
"""

from __future__ import annotations

import orjson

from ..metrics import REDIS_ROUNDTRIP
from . import keys, scripts
from .batching import Script, pipelined
from .codec import transition_ops
from .side import REGISTRY_TTL_MS, RedisSide
from .types import SESSION_ID_SLOT, ApplyOutcome, DeadClaims, Transition

# A dead incarnation's tombstone is kept this long; a worker that wakes later than that
# still knows from its own clock that it was past its lease, and gives up its incarnation.
TOMBSTONE_MS = 24 * 3600 * 1000
# A sweeper's claim on a dead worker; a claim that lapses (its sweeper died) is taken again.
SWEEP_CLAIM_MS = 30_000
SWEEP_CLAIM_LIMIT = 64
# Sessions per SWEEP call: ~15 ms of Redis each, short enough that the heartbeats queued
# behind it are not held up, long enough that a call's overhead is shared by many.
SWEEP_BATCH = 100


class SweeperSide(RedisSide):
    """A sweeper's calls (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._claim_dead = Script(self.lease_redis, scripts.CLAIM_DEAD, allow_oom=True)
        self._sweep = Script(self.redis, scripts.SWEEP)

    async def claim_dead_workers(self) -> DeadClaims:
        """Declare dead, and claim for sweeping, the workers whose lease lapsed while the
        store served (scripts.CLAIM_DEAD); each is handed to exactly one caller."""
        shortest, next_lapse, *claimed = await self._claim_dead(
            keys.REGISTRY_KEYS, [SWEEP_CLAIM_MS, TOMBSTONE_MS, REGISTRY_TTL_MS, SWEEP_CLAIM_LIMIT]
        )
        lapse = int(float(next_lapse))
        return DeadClaims(claimed, int(float(shortest)), lapse if lapse >= 0 else None)

    async def worker_index(self, incarnation: str) -> list[tuple[str, str]]:
        members = await self.redis.smembers(keys.worker_sessions(incarnation))
        return [tuple(m.split("/", 1)) for m in members]  # type: ignore[misc]

    async def has_worker_index(self, incarnation: str) -> bool:
        """Whether the worker's session index is there (one key, whatever it holds): the sweep
        of a dead worker deletes it last, once every session of its is gone."""
        return bool(await self.redis.exists(keys.worker_sessions(incarnation)))

    async def sweep(self, ws: str, incarnation: str, sids: list[str], transition: Transition) -> list[ApplyOutcome]:
        """One transition, fenced by `incarnation`, applied to each of many of its sessions
        in workspace `ws` (scripts.SWEEP, SWEEP_BATCH sessions a call, one pipeline):
        `SESSION_ID_SLOT` in the transition's events stands for each session's id. Each
        session's outcome, in `sids`' order."""
        ops = orjson.dumps(transition_ops(SESSION_ID_SLOT, transition, self.retention)).decode()
        shared = [
            keys.live(ws), keys.catalog(ws), keys.catalog_order(ws), keys.single(ws), keys.invalidations(ws),
            keys.catalog_version(ws), keys.attention(ws), keys.attention_details(ws),
            *self.attention_all_keys(ws), keys.change_log(ws),
        ]
        ttl = str(self.retention.session_ttl_ms)
        calls = []
        for first in range(0, len(sids), SWEEP_BATCH):
            batch = sids[first : first + SWEEP_BATCH]
            key_list = list(shared)
            for sid in batch:
                key_list += [
                    keys.session(ws, sid), keys.events(ws, sid), keys.transcript(ws, sid), keys.turns(ws, sid),
                    keys.turns_ended(ws, sid),
                ]
            calls.append((key_list, [incarnation, ops, ttl, *batch]))
        with REDIS_ROUNDTRIP.labels("sweep").time():
            replies = await pipelined(self.redis, self._sweep, calls)
        outcomes: list[ApplyOutcome] = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            outcomes += [ApplyOutcome(int(applied)) for applied in reply]
        return outcomes

    async def forget_worker(self, incarnation: str, workspaces: set[str]) -> None:
        """Delete every key a dead incarnation owned, then release the sweep's claim."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(keys.worker_sessions(incarnation), keys.worker_control(incarnation))
        for ws in workspaces:
            pipe.delete(keys.inbox(ws, incarnation))
        pipe.zrem(keys.SWEEPS, incarnation)  # the tombstone stays: dead stays dead
        await pipe.execute()
