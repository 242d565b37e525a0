"""The worker's side of `RedisStore` (`WorkerStore`): its lease, its sessions' transitions
and their TTLs, the commands it reads, the replies it gives, its session index, and a
session's move to another worker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from redis.exceptions import NoScriptError

from .. import commands
from ..commands import Command, MalformedCommand, Moving, Reply
from ..metrics import REDIS_ROUNDTRIP
from . import keys, scripts
from .batching import PerLoopTurn, Script, pipelined
from .codec import transition_ops
from .command_streams import COMMAND_BATCH, Entry, StreamReaders, entries
from .connection import is_cluster
from .side import INBOX_MAXLEN, INBOX_TTL_MS, REGISTRY_TTL_MS, REPLY_TTL_S, RedisSide
from .types import ABANDONED, GIVEN, Applied, ApplyOutcome, IdClaim, ReplyFate, Standing, Transition, WorkerReport


class WorkerSide(RedisSide):
    """A worker's calls. Transitions from one process are auto-pipelined in order."""

    def __init__(self) -> None:
        super().__init__()
        self._apply = Script(self.redis, scripts.APPLY)
        self._move = Script(self.redis, scripts.MOVE)
        self._reply = Script(self.redis, scripts.REPLY)
        self._reclaim = Script(self.redis, scripts.RECLAIM)
        self._claim_sid = Script(self.redis, scripts.CLAIM_SID)
        self._heartbeat = Script(self.heartbeat_redis, scripts.HEARTBEAT, allow_oom=True)
        self._release = Script(self.lease_redis, scripts.RELEASE, allow_oom=True)
        self._resign = Script(self.lease_redis, scripts.RESIGN, allow_oom=True)
        self._batch: list[tuple[list[str], list[str], asyncio.Future[Applied]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._index_writes = PerLoopTurn(self._write_index)
        self._replies = PerLoopTurn(self._send_replies)
        self._readers = StreamReaders(self.redis) if is_cluster(self.redis) else None

    async def heartbeat(self, incarnation: str, report: WorkerReport, lease_ms: int) -> Standing:
        """Renew the lease on Redis's clock: one script, whatever the session count. The
        agent names the report offers are recorded as known in the same step."""
        with REDIS_ROUNDTRIP.labels("heartbeat").time():
            standing, _ = await self._heartbeat(
                keys.REGISTRY_KEYS,
                [incarnation, lease_ms, report.pack(), REGISTRY_TTL_MS, orjson.dumps(report.agent_names).decode()],
            )
        return Standing(standing)

    async def release(self, incarnation: str) -> None:
        """Give the lease back on a clean shutdown (after the worker deleted its sessions)."""
        await self._release(keys.REGISTRY_KEYS, [incarnation])
        await self.redis.delete(keys.worker_sessions(incarnation), keys.worker_control(incarnation))

    async def resign(self, incarnation: str) -> None:
        """Declare an incarnation dead ourselves, so a sweeper removes what it left."""
        await self._resign(keys.REGISTRY_KEYS, [incarnation, REGISTRY_TTL_MS])

    async def apply(self, ws: str, sid: str, incarnation: str, transition: Transition) -> Applied:
        """One atomic state transition (scripts.APPLY), fenced by `incarnation`: the session
        hash, its events (log, transcript, live channel), the listing set and the catalog
        row change together, after the workspace's change channel is told (see
        `codec.transition_ops` for the ops JSON the script reads).

        Concurrent calls from this process share one pipeline per flush, in call order.
        """
        ops = transition_ops(sid, transition, self.retention)
        key_list = [
            keys.session(ws, sid),
            keys.events(ws, sid),
            keys.live(ws),
            keys.catalog(ws),
            keys.catalog_order(ws),
            keys.single(ws),
            keys.transcript(ws, sid),
            keys.invalidations(ws),
            keys.catalog_version(ws),
            keys.turns(ws, sid),
            keys.turns_ended(ws, sid),
            keys.attention(ws),
            keys.attention_details(ws),
            *self.attention_all_keys(ws),
            keys.change_log(ws),
        ]
        future: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        args = [incarnation, orjson.dumps(ops).decode(), str(self.retention.session_ttl_ms)]
        self._batch.append((key_list, args, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        """Send queued transitions as pipelines until none are left (auto-pipelining)."""
        while self._batch:
            batch, self._batch = self._batch, []
            try:
                results = await self._run_transitions(batch)
            except Exception as error:  # connection-level failure: every caller sees it
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (*_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(Applied(ApplyOutcome(int(result[0])), int(result[1]), str(result[2])))

    async def _run_transitions(self, batch: list[tuple[list[str], list[str], Any]]) -> list[Any]:
        """One pipeline of APPLY calls (see `batching.pipelined`)."""
        with REDIS_ROUNDTRIP.labels("transitions").time():
            return await pipelined(self.redis, self._apply, [(key_list, args) for key_list, args, _ in batch])

    async def touch_sessions(self, incarnation: str, sessions: list[tuple[str, str, bool]]) -> set[tuple[str, str]]:
        """Refresh the TTL of live sessions (ws, sid, single scope) and of the worker's index;
        returns the (ws, sid) the store no longer holds."""
        ttl = self.retention.session_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        for ws, sid, single in sessions:
            pipe.pexpire(keys.session(ws, sid), ttl)
            if single:
                pipe.pexpire(keys.single(ws), ttl)
        pipe.pexpire(keys.worker_sessions(incarnation), ttl)
        with REDIS_ROUNDTRIP.labels("touch").time():
            results = iter(await pipe.execute())
        missing = set()
        for ws, sid, single in sessions:
            if not next(results):
                missing.add((ws, sid))
            if single:
                next(results)
        # Each id's locator is renewed with its session (claimed again if a failover lost
        # it), so it outlives the session's listing row (RedisSide.locator_ttl_ms).
        locator_ttl = self.locator_ttl_ms
        claims = [([keys.locator(sid)], [ws, locator_ttl]) for ws, sid, _ in sessions if (ws, sid) not in missing]
        if claims:
            with REDIS_ROUNDTRIP.labels("touch").time():
                for answer in await pipelined(self.redis, self._claim_sid, claims):
                    if isinstance(answer, Exception):
                        raise answer
        return missing

    def control_feed(self, incarnation: str) -> str:
        """The name, for read_commands, under which a worker's control commands arrive."""
        return keys.worker_control(incarnation)

    def inbox_feed(self, ws: str, incarnation: str) -> str:
        """The name, for read_commands, under which commands for a worker's sessions of one
        workspace arrive."""
        return keys.inbox(ws, incarnation)

    async def read_commands(self, cursors: dict[str, str], block_ms: int) -> list[Entry]:
        """Block until commands arrive on any of the streams; returns (stream, id, command),
        where an entry that is no command (commands.decode refused it) is its error.

        On a single Redis this is one XREAD over every stream. A cluster refuses an XREAD
        across slots, so there each stream has its own blocking reader (see StreamReaders).
        """
        if self._readers is not None:
            return await self._readers.read(cursors, block_ms)
        return entries(await self.redis.xread(cursors, block=block_ms, count=COMMAND_BATCH))

    async def forget_commands(self, cursors: dict[str, str]) -> None:
        """Drop the commands read up to each stream's cursor (their one reader handled
        them): a stream holds only what is still to be read, not a day of creates."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, cursor in cursors.items():
            pipe.xtrim(stream, minid=cursor, approximate=False)
        await pipe.execute()

    async def reply(self, request: str, answer: Reply, ttl_s: int = REPLY_TTL_S) -> bool:
        """Answer a create or close, kept `ttl_s` for its API (and longer than the worker
        may want it back, see reclaim_replies); False if the API stopped waiting (see
        abandon_reply)."""
        return bool(await self._replies((request, answer, ttl_s)))

    async def _send_replies(self, replies: list[tuple[str, Reply, int]]) -> list[Any]:
        return await pipelined(self.redis, self._reply, [
            ([keys.reply(request), keys.reply_given(request)], [answer.encode(), ttl_s, ABANDONED, GIVEN])
            for request, answer, ttl_s in replies
        ])

    async def reclaim_replies(self, answers: list[tuple[str, Reply]]) -> list[ReplyFate]:
        """Past their APIs' wait, take back the answers that nobody took: nobody was told of
        those creates (their API gave up, and perhaps could not even say so), so the worker
        undoes them. A taken answer is known by its record in the given list, not by its
        absence: an answer lost with its keys is not one somebody took."""
        calls = [([keys.reply(r), keys.reply_given(r)], [answer.encode(), GIVEN, ABANDONED]) for r, answer in answers]
        fates = await pipelined(self.redis, self._reclaim, calls)
        for fate in fates:
            if isinstance(fate, Exception):
                raise fate
        return [ReplyFate(int(fate)) for fate in fates]

    async def index_session(self, incarnation: str, ws: str, sid: str, present: bool) -> bool:
        """Add or remove `ws/sid` in the worker's session index (the sweeper's map). Adding
        also claims the session id for its workspace (scripts.CLAIM_SID, the id's locator):
        False if another workspace holds the id, and then nothing of it is indexed."""
        if not present:
            await self.redis.srem(keys.worker_sessions(incarnation), f"{ws}/{sid}")
            return True
        return await self._index_writes((incarnation, ws, sid))

    async def _write_index(self, written: list[tuple[str, str, str]]) -> list[bool]:
        """One pipeline for the index entries and the id claims of a loop turn's sessions;
        the claims a freshly restarted Redis had no script for are run again once it is
        loaded, and an entry whose id another workspace holds is taken out again."""
        ttl = self.locator_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        for incarnation, ws, sid in written:
            pipe.sadd(keys.worker_sessions(incarnation), f"{ws}/{sid}")
            self._claim_sid.queue(pipe, [keys.locator(sid)], [ws, ttl])
        for incarnation in {incarnation for incarnation, *_ in written}:
            pipe.pexpire(keys.worker_sessions(incarnation), self.retention.session_ttl_ms)
        results = await pipe.execute(raise_on_error=False)
        claims = results[1 : 2 * len(written) : 2]
        again = [i for i, claim in enumerate(claims) if isinstance(claim, NoScriptError)]
        if again:
            rerun = await pipelined(
                self.redis, self._claim_sid, [([keys.locator(written[i][2])], [written[i][1], ttl]) for i in again]
            )
            for i, claim in zip(again, rerun, strict=True):
                claims[i] = claim
        for result in [*results[0 : 2 * len(written) : 2], *claims, *results[2 * len(written) :]]:
            if isinstance(result, Exception):
                raise result
        refused = [entry for entry, claim in zip(written, claims, strict=True) if IdClaim(int(claim)) is IdClaim.FOREIGN]
        for incarnation in {incarnation for incarnation, *_ in refused}:
            await self.redis.srem(
                keys.worker_sessions(incarnation), *(f"{ws}/{sid}" for inc, ws, sid in refused if inc == incarnation)
            )
        return [IdClaim(int(claim)) is not IdClaim.FOREIGN for claim in claims]

    async def locate_request(self, rid: str, where: str | None) -> None:
        """Record (or forget) which session a pending request belongs to, for the legacy route."""
        if where is None:
            await self.redis.delete(keys.request_locator(rid))
        else:
            await self.redis.set(keys.request_locator(rid), where, px=INBOX_TTL_MS)

    async def drop_inbox(self, ws: str, incarnation: str) -> None:
        await self.redis.delete(keys.inbox(ws, incarnation))

    async def mark_moving(self, ws: str, sid: str, incarnation: str, target: str) -> bool:
        """Start (or redirect) handing a session of ours to worker `target` (scripts.MOVE):
        commands sent to it from now on are parked for the new owner, and our inbox gets
        the `moving` marker behind every command sent before. False: not ours any more."""
        marker = commands.encode(Moving(sid=sid, target=target))
        result = await self._move(
            [
                keys.session(ws, sid), keys.inbox(ws, incarnation), keys.parked(ws, sid),
                keys.invalidations(ws), keys.catalog_version(ws), keys.change_log(ws),
            ],
            [incarnation, target, marker, INBOX_TTL_MS, INBOX_MAXLEN, sid, self.retention.catalog_ms],
        )
        return bool(result)

    async def take_parked(self, ws: str, sid: str) -> list[Command | MalformedCommand]:
        """The commands parked while the session moved here, oldest first, taken (after the
        takeover nothing more is parked, so one read and delete takes them all)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xrange(keys.parked(ws, sid))
        pipe.delete(keys.parked(ws, sid))
        parked, _ = await pipe.execute()
        return [command for _, _, command in entries([[keys.parked(ws, sid), parked]])]

    async def _stop_readers(self) -> None:
        """End the cluster's stream readers, if any (the store is closing)."""
        if self._readers is not None:
            await self._readers.stop()
