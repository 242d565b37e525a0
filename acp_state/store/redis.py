"""`Store` over redis-py: a single server, a Redis Cluster, or the embedded fakeredis default.

The only code that knows the key schema (`keys`), the session hash's fields and the Lua
(`scripts`): it packs each typed `Transition` into the APPLY script's ops JSON and unpacks
each session hash into a `SessionView`, one pair. Every method is one Redis round trip
unless its docstring says otherwise (on a cluster, a pipeline that spans shards is one
round trip per shard, sent concurrently).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Awaitable, Callable, Generic, TypeVar

import orjson
from redis.cluster import key_slot
from redis.exceptions import NoScriptError

from .. import commands, events
from ..clock import now_ms
from ..commands import CANCEL_SENTINEL, Attach, Command, Create, Drain, MalformedCommand, Moving, Reply, Vote
from ..metrics import REDIS_ROUNDTRIP
from ..turns import KEPT_ENDED_TURNS, TurnRecord
from ..tasks import cancel_until_done
from . import keys, scripts
from .connection import MEMORY, Client, connect, is_cluster
from .fanout import Fanout
from .keys import F, VersionField
from .types import (
    ABANDONED,
    GIVEN,
    SESSION_ID_SLOT,
    Admission,
    AdmissionStatus,
    Applied,
    ApplyOutcome,
    AttentionCursor,
    AttentionEntry,
    CatalogRow,
    CatalogVersion,
    CreateRecord,
    DeadClaims,
    LeaseView,
    ListedSession,
    LoadSnapshot,
    Mode,
    ReplyFate,
    Retention,
    SessionView,
    Standing,
    Transition,
    VoteOutcome,
)

log = logging.getLogger("acp_state.store")

COMMAND_BATCH = 256
# Inbox streams outlive neither their worker nor a day of silence.
INBOX_TTL_MS = 24 * 3600 * 1000
INBOX_MAXLEN = 10_000
REPLY_TTL_S = 60
# One BLPOP must end well inside the client's socket read timeout (5 s by default since
# redis-py 8), or the read fails with TimeoutError instead of returning nil.
REPLY_WAIT_STEP_S = 1
# The first outcome of a command sent with an idempotency key is kept this long.
IDEMPOTENCY_TTL_MS = 24 * 3600 * 1000
# Registry keys outlive a day without any process of the deployment.
REGISTRY_TTL_MS = 24 * 3600 * 1000
# A dead incarnation's tombstone is kept this long; a worker that wakes later than that
# still knows from its own clock that it was past its lease, and gives up its incarnation.
TOMBSTONE_MS = 24 * 3600 * 1000
# A sweeper's claim on a dead worker; a claim that lapses (its sweeper died) is taken again.
SWEEP_CLAIM_MS = 30_000
SWEEP_CLAIM_LIMIT = 64
# A lease script answers in well under a millisecond. A master that stalls keeps its
# connections open and silent, and on a cluster its replica may take the registry's slot
# over meanwhile: a renewal waiting on the stalled master past this gives up, and the next
# one (the cluster client having refreshed its slot map) reaches the new master within the
# lease, instead of after the 5 s default. A worker's lease clients wait up to three
# quarters of its lease (`lease_socket_timeout`): a network that adds half a lease to every
# round trip must not fail every renewal (at half the lease they all timed out, and the
# sessions' refreshes with them: tests/test_partitions.py), and a renewal lost on a dead
# connection costs nothing since renewals overlap (worker/worker.py, `_heartbeat_loop`).
LEASE_SOCKET_TIMEOUT_S = 1.0
# Workspaces whose last listing's live sessions are remembered (see RedisStore.list_page).
LIST_HINTS = 4096
# Stands for each admitted prompt's id in the terminal APPLY gives the prompts left (orphan).
PROMPT_ID_SLOT = "@PID@"
# Sessions per SWEEP call: ~15 ms of Redis each, short enough that the heartbeats queued
# behind it are not held up, long enough that a call's overhead is shared by many.
SWEEP_BATCH = 100


def lease_socket_timeout(lease_ms: int | None) -> float:
    """How long a lease client waits for a reply: three quarters of the lease, at least 1 s."""
    return max(LEASE_SOCKET_TIMEOUT_S, 0.75 * (lease_ms or 0) / 1000)


T = TypeVar("T")
R = TypeVar("R")


class PerLoopTurn(Generic[T, R]):
    """The calls made in one turn of the event loop, sent together at its end by `send`
    (one pipeline, one write): a burst of creates otherwise paid a round trip each for its
    index entry and its reply, a fifth of a worker's CPU per create. `send` answers each
    call's result or exception, in order; if it fails as a whole, every call fails with it."""

    def __init__(self, send: Callable[[list[T]], Awaitable[list[R | Exception]]]) -> None:
        self._send = send
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    async def __call__(self, call: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._start)
        self._pending.append((call, future))
        return await future

    def _start(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._run(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._send([call for call, _ in batch])
        except BaseException as error:  # every caller sees it (a worker's `_stored` retries)
            for _, future in batch:
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else ConnectionError("cancelled"))
            if not isinstance(error, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)


class Script:
    """One Lua script, run by EVALSHA and loaded on NOSCRIPT (a Redis that restarted empty).

    redis-py's own script helper cannot queue into a cluster pipeline; this one can, so the
    same call works on a single Redis and on a cluster, alone or pipelined.
    """

    def __init__(self, redis: Client, source: str, *, allow_oom: bool = False) -> None:
        self.redis = redis
        if allow_oom and not type(redis).__module__.startswith("fakeredis"):
            # Runs when Redis is out of memory (its writes are a few small fields): a full
            # Redis must not keep healthy workers from renewing. (The embedded fakeredis
            # never runs out of memory, and does not read script flags.)
            source = "#!lua flags=allow-oom\n" + source
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def load(self) -> None:
        await self.redis.script_load(self.source)  # on a cluster: on every primary

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return await self.redis.execute_command(*command)
        except NoScriptError:
            await self.load()
            return await self.redis.execute_command(*command)


class RedisStore:
    """`Store` over redis-py. Transitions from one process are auto-pipelined in order."""

    def __init__(
        self,
        redis: Client,
        retention: Retention | None = None,
        lease_redis: Client | None = None,
        heartbeat_redis: Client | None = None,
    ) -> None:
        self.redis = redis
        # Lease decisions go out on a client of their own: a shard that stalls must not hold
        # up a heartbeat to the registry's shard behind the main client's connections and
        # slot-map refreshes.
        self.lease_redis = lease_redis or redis
        # The heartbeat has a connection of its own, kept open: were it to share the lease
        # client with the sweeper, a renewal that came while a CLAIM_DEAD was out would open
        # a second connection, and under latency a new connection's handshake is what costs
        # a lease.
        self.heartbeat_redis = heartbeat_redis or self.lease_redis
        # redis-py's cluster client resends a command whose connection broke (up to 10
        # times, also while it refreshes its slot map: it masks its own races that way). A
        # command may then have run on an attempt before the error it reports, so no error
        # proves that a command did not run (see api/outcomes.py).
        self.resends = is_cluster(redis)
        self.retention = retention or Retention()
        self._apply = Script(redis, scripts.APPLY)
        self._sweep = Script(redis, scripts.SWEEP)
        self._send = Script(redis, scripts.SEND)
        self._move = Script(redis, scripts.MOVE)
        self._vote = Script(redis, scripts.VOTE)
        self._attach = Script(redis, scripts.ATTACH)
        self._version = Script(redis, scripts.VERSION)
        self._told = Script(redis, scripts.TOLD)
        self._current_turn = Script(redis, scripts.CURRENT_TURN)
        self._list = Script(redis, scripts.LIST)
        self._release_single = Script(redis, scripts.RELEASE_SINGLE)
        self._attention_page = Script(redis, scripts.ATTENTION_PAGE)
        self._attention_of = Script(redis, scripts.ATTENTION_OF)
        self._heartbeat = Script(self.heartbeat_redis, scripts.HEARTBEAT, allow_oom=True)
        self._claim_dead = Script(self.lease_redis, scripts.CLAIM_DEAD, allow_oom=True)
        self._release = Script(self.lease_redis, scripts.RELEASE, allow_oom=True)
        self._resign = Script(self.lease_redis, scripts.RESIGN, allow_oom=True)
        self._reply = Script(redis, scripts.REPLY)
        self._abandon = Script(redis, scripts.ABANDON)
        self._take = Script(redis, scripts.TAKE)
        self._reclaim = Script(redis, scripts.RECLAIM)
        self._batch: list[tuple[list[str], list[str], asyncio.Future[Applied]]] = []
        self._index_writes = PerLoopTurn(self._write_index)
        self._replies = PerLoopTurn(self._send_replies)
        self._controls = PerLoopTurn(self._send_controls)
        self._tellings = PerLoopTurn(self._send_tellings)
        self._flushing: asyncio.Task[None] | None = None
        self._readers = _StreamReaders(redis) if is_cluster(redis) else None
        self._live_on_page: dict[str, list[str]] = {}  # ws -> live ids its last listing found
        self._live_in_workspace: dict[str, list[str]] = {}  # ws -> live ids its last live-state read found

    @classmethod
    def from_url(cls, url: str, retention: Retention | None = None, lease_ms: int | None = None) -> RedisStore:
        """A store on `url` (see acp_state.store.connection), with its own clients for leases
        and for the heartbeat; `lease_ms`: the lease of the worker that uses it, if any."""
        if url.startswith(MEMORY):
            return cls(connect(url), retention)
        timeout = lease_socket_timeout(lease_ms)
        return cls(connect(url), retention, connect(url, socket_timeout=timeout), connect(url, socket_timeout=timeout))

    async def close(self) -> None:
        if self._readers is not None:
            await self._readers.stop()
        await self.redis.aclose()
        if self.lease_redis is not self.redis:
            await self.lease_redis.aclose()
        if self.heartbeat_redis is not self.lease_redis and self.heartbeat_redis is not self.redis:
            await self.heartbeat_redis.aclose()

    # ---- worker side -------------------------------------------------------------------

    async def heartbeat(self, incarnation: str, report: dict[str, Any], lease_ms: int) -> Standing:
        """Renew the lease on Redis's clock: one script, whatever the session count. The
        agent names the report offers (`agentNames`) are recorded as known in the same step."""
        offered = report.get("agentNames") or []
        with REDIS_ROUNDTRIP.labels("heartbeat").time():
            standing, _ = await self._heartbeat(
                keys.REGISTRY_KEYS,
                [incarnation, lease_ms, orjson.dumps(report).decode(), REGISTRY_TTL_MS, orjson.dumps(offered).decode()],
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
        row change together, after the workspace's change channel is told (see `_ops` for
        the ops JSON the script reads).

        Concurrent calls from this process share one pipeline per flush, in call order.
        """
        ops = self._ops(sid, transition)
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
        ]
        future: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        args = [incarnation, orjson.dumps(ops).decode(), str(self.retention.session_ttl_ms)]
        self._batch.append((key_list, args, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return await future

    async def sweep(self, ws: str, incarnation: str, sids: list[str], transition: Transition) -> list[ApplyOutcome]:
        """One transition, fenced by `incarnation`, applied to each of many of its sessions
        in workspace `ws` (scripts.SWEEP, SWEEP_BATCH sessions a call, one pipeline):
        `SESSION_ID_SLOT` in the transition's events stands for each session's id. Each
        session's outcome, in `sids`' order."""
        ops = orjson.dumps(self._ops(SESSION_ID_SLOT, transition)).decode()
        shared = [
            keys.live(ws), keys.catalog(ws), keys.catalog_order(ws), keys.single(ws), keys.invalidations(ws),
            keys.catalog_version(ws), keys.attention(ws), keys.attention_details(ws),
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
            replies = await self._pipelined(self._sweep, calls)
        outcomes: list[ApplyOutcome] = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            outcomes += [ApplyOutcome(int(applied)) for applied in reply]
        return outcomes

    def _ops(self, sid: str, t: Transition) -> dict[str, Any]:
        """The APPLY script's ops JSON for a transition (see apply.lua): mode, set {field:
        str}, del [field], incr {field: int}, events [envelope bodies], tev (1-based index of
        the event to keep as the turn-error event), catalog (row JSON) with its score,
        single, missing_only, uncatalog, orphan (the terminal body for each admitted prompt
        left, `@PID@` standing for its id), op; with the retention each needs."""
        fields: dict[str, str] = {}
        if t.meta is not None:
            for name, value in ((F.CREATED, t.meta.get("createdAt")), (F.CWD, t.meta.get("workspaceCwd")),
                                (F.TITLE, t.meta.get("displayName"))):
                if value:
                    fields[name] = value
        if t.epoch is not None:
            fields[F.EPOCH] = t.epoch
        if t.updated_at is not None:
            fields[F.UPDATED] = t.updated_at
        if t.active is not None:
            fields[F.ACTIVE] = "1" if t.active else "0"
        if t.admitted:
            fields[F.ADMITTED] = str(t.admitted)
        for prompt_id in t.prompts_admitted:
            fields[F.PROMPT + prompt_id] = "1"
        for client_id in t.clients:
            fields[F.CLIENT + client_id] = "1"
        if t.turn_error is not None:
            fields[F.TURN_ERROR] = orjson.dumps(t.turn_error).decode()
        for pending in t.interactions_added:
            fields[F.INTERACTION + pending.rid] = orjson.dumps(pending.interaction).decode()
            fields[F.VOTABLE + pending.rid] = orjson.dumps([pending.order, pending.allowed]).decode()
        if t.untold_request is not None:
            fields[F.REQUEST] = t.untold_request
        removed = [F.PROMPT + prompt_id for prompt_id in t.prompts_ended]
        for rid in t.interactions_removed:
            removed += [F.INTERACTION + rid, F.VOTABLE + rid]
        if t.clear_turn_error_event:
            removed.append(F.TURN_ERROR_EVENT)
        if t.clear_turn_error:
            removed.append(F.TURN_ERROR)
        if t.told:
            removed.append(F.REQUEST)

        ops: dict[str, Any] = {"mode": t.mode.value, "sid": sid, "verttl": self.retention.catalog_ms}
        if t.turns:
            ops["turns"] = [[turn.prompt_id, turn.pack(), 1 if turn.ended else 0] for turn in t.turns]
            ops["turnkeep"] = KEPT_ENDED_TURNS
            ops["turnttl"] = self.retention.catalog_ms
        if fields:
            ops["set"] = fields
        if removed:
            ops["del"] = removed
        if t.admitted_change:
            ops["incr"] = {F.ADMITTED: t.admitted_change}
        if t.mode is Mode.CREATE and t.single:
            ops["single"] = True
        if t.restore:
            ops["missing_only"] = True
        if t.resumed:
            ops["resumed"] = True
        if t.takeover_from is not None:
            ops["from"] = t.takeover_from
        if t.uncatalog:
            ops["uncatalog"] = True
        if t.uncatalog_untold:
            ops["uncatalog_untold"] = True
        if t.op is not None:
            ops["op"] = t.op
        if t.end_admitted is not None:
            data = {"sessionId": sid, "message": t.end_admitted.message, "code": t.end_admitted.code,
                    "promptId": PROMPT_ID_SLOT}
            ops["orphan"] = events.body("turn_error", data, PROMPT_ID_SLOT)
        ops["events"] = list(t.events)
        if t.keep_turn_error_event is not None:
            ops["tev"] = t.keep_turn_error_event
        if t.events or t.end_admitted is not None:
            ops["evmax"] = self.retention.events_max
            ops["evttl"] = self.retention.events_ms
            ops["tr"] = [i + 1 for i, body in enumerate(t.events) if events.in_transcript(body)]
            ops["trmax"] = self.retention.transcript_max
            ops["trttl"] = self.retention.transcript_ms
        if t.catalog is not None:
            now = now_ms()
            ops["score"] = str(t.catalog.updated_ms)
            ops["catalog"] = orjson.dumps(_catalog_json(t.catalog)).decode()
            ops["retention"] = self.retention.catalog_ms
            ops["cutoff"] = str(now - self.retention.catalog_ms)
        return ops

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
        """One pipeline of APPLY calls (see `_pipelined`)."""
        with REDIS_ROUNDTRIP.labels("transitions").time():
            return await self._pipelined(self._apply, [(key_list, args) for key_list, args, _ in batch])

    async def _pipelined(self, script: Script, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run one script for each (keys, args) in one pipeline, answers (or errors) in call
        order; the calls a freshly restarted Redis did not know the script for are run
        again, in their order, once it is loaded."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                script.queue(pipe, *calls[i])
            replies = await pipe.execute(raise_on_error=False)
            for i, reply in zip(todo, replies, strict=True):
                results[i] = reply
            todo = [i for i in todo if isinstance(results[i], NoScriptError)]
            if not todo or attempt:
                break
            await script.load()
        return results

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
        return missing

    async def read_commands(
        self, cursors: dict[str, str], block_ms: int
    ) -> list[tuple[str, str, Command | MalformedCommand]]:
        """Block until commands arrive on any of the streams; returns (stream, id, command),
        where an entry that is no command (commands.decode refused it) is its error.

        On a single Redis this is one XREAD over every stream. A cluster refuses an XREAD
        across slots, so there each stream has its own blocking reader (see _StreamReaders).
        """
        if self._readers is not None:
            return await self._readers.read(cursors, block_ms)
        return _commands(await self.redis.xread(cursors, block=block_ms, count=COMMAND_BATCH))

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
        return await self._pipelined(self._reply, [
            ([keys.reply(request), keys.reply_given(request)], [answer.encode(), ttl_s, ABANDONED, GIVEN])
            for request, answer, ttl_s in replies
        ])

    async def reclaim_replies(self, answers: list[tuple[str, Reply]]) -> list[ReplyFate]:
        """Past their APIs' wait, take back the answers that nobody took: nobody was told of
        those creates (their API gave up, and perhaps could not even say so), so the worker
        undoes them. A taken answer is known by its record in the given list, not by its
        absence: an answer lost with its keys is not one somebody took."""
        calls = [([keys.reply(r), keys.reply_given(r)], [answer.encode(), GIVEN, ABANDONED]) for r, answer in answers]
        fates = await self._pipelined(self._reclaim, calls)
        for fate in fates:
            if isinstance(fate, Exception):
                raise fate
        return [ReplyFate(int(fate)) for fate in fates]

    async def index_session(self, incarnation: str, ws: str, sid: str, present: bool) -> None:
        """Add or remove `ws/sid` in the worker's session index (the sweeper's map)."""
        if not present:
            await self.redis.srem(keys.worker_sessions(incarnation), f"{ws}/{sid}")
            return
        await self._index_writes((incarnation, ws, sid))

    async def _write_index(self, entries: list[tuple[str, str, str]]) -> list[None]:
        pipe = self.redis.pipeline(transaction=False)
        for incarnation, ws, sid in entries:
            pipe.sadd(keys.worker_sessions(incarnation), f"{ws}/{sid}")
            pipe.set(keys.locator(sid), ws, px=self.retention.catalog_ms)
        for incarnation in {incarnation for incarnation, *_ in entries}:
            pipe.pexpire(keys.worker_sessions(incarnation), self.retention.session_ttl_ms)
        await pipe.execute()
        return [None] * len(entries)

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
                keys.invalidations(ws), keys.catalog_version(ws),
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
        entries, _ = await pipe.execute()
        return [command for _, _, command in _commands([[keys.parked(ws, sid), entries]])]

    def control_feed(self, incarnation: str) -> str:
        """The name, for read_commands, under which a worker's control commands arrive."""
        return keys.worker_control(incarnation)

    def inbox_feed(self, ws: str, incarnation: str) -> str:
        """The name, for read_commands, under which commands for a worker's sessions of one
        workspace arrive."""
        return keys.inbox(ws, incarnation)

    # ---- API side ----------------------------------------------------------------------

    def fanout(self) -> Fanout:
        """This process's live delivery and change feed, on the store's own client."""
        return Fanout(self.redis)

    async def lease_view(self) -> LeaseView:
        """The registry's deadlines, leases and clock, with Redis's time to judge them by."""
        if is_cluster(self.redis):
            # The registry's keys share one slot; TIME names no key, so it goes to any node,
            # and the nodes' clocks agree to within what NTP keeps (far below a lease).
            members, leases, (tick, stall), now = await asyncio.gather(
                self.redis.zrange(keys.WORKERS, 0, -1, withscores=True),
                self.redis.zrange(keys.LEASES, 0, -1, withscores=True),
                self.redis.hmget(keys.CLOCK, [keys.ClockField.TICK, keys.ClockField.STALL]),
                self.redis.time(),
            )
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrange(keys.WORKERS, 0, -1, withscores=True)
            pipe.zrange(keys.LEASES, 0, -1, withscores=True)
            pipe.hmget(keys.CLOCK, [keys.ClockField.TICK, keys.ClockField.STALL])
            pipe.time()
            members, leases, (tick, stall), now = await pipe.execute()
        seconds, micros = now
        return LeaseView(
            deadlines={m: int(score) for m, score in members},
            leases={m: int(score) for m, score in leases},
            redis_now_ms=int(seconds) * 1000 + int(micros) // 1000,
            tick_ms=int(tick or 0),
            stall_ms=int(stall or 0),
        )

    async def worker_reports(self, incarnations: list[str]) -> dict[str, dict[str, Any]]:
        """The load report each live worker stored with its lease (one round trip)."""
        if not incarnations:
            return {}
        values = await self.redis.hmget(keys.REPORTS, incarnations)
        return {inc: orjson.loads(v) for inc, v in zip(incarnations, values, strict=True) if v}

    async def known_agents(self) -> list[str]:
        """Every agent name a worker offered within the registry's TTL (live or not)."""
        return sorted(await self.redis.zrange(keys.AGENTS, 0, -1))

    async def send_control(self, incarnation: str, command: Create | Drain) -> None:
        """Hand a create (or a drain) to a worker (its control stream); the commands of one
        loop turn go out in one pipeline."""
        await self._controls((incarnation, command))

    async def _send_controls(self, controls: list[tuple[str, Create | Drain]]) -> list[Exception | None]:
        pipe = self.redis.pipeline(transaction=False)
        for incarnation, command in controls:
            stream = keys.worker_control(incarnation)
            pipe.xadd(stream, {"c": commands.encode(command)}, maxlen=INBOX_MAXLEN, approximate=True)
            pipe.pexpire(stream, INBOX_TTL_MS)
        results = await pipe.execute(raise_on_error=False)
        return [next((r for r in pair if isinstance(r, Exception)), None) for pair in zip(results[::2], results[1::2])]

    async def await_reply(
        self, request: str, timeout_s: float, alive: Callable[[], Awaitable[bool]] | None = None
    ) -> Reply | None:
        """The worker's reply; None once `timeout_s` passed or `alive()` says the worker is
        gone, and then the worker is told that nobody waits any more (a create it finishes
        later is undone, not left behind).

        The take moves the answer to the reply's given list rather than popping it: an
        answer whose way back failed (the connection dropped while Redis sent it) is still
        there for this API's abandon_reply, or a retry's take_reply, and the worker knows
        it was taken."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        source, given = keys.reply(request), keys.reply_given(request)
        while True:
            reply = await self.redis.blmove(source, given, REPLY_WAIT_STEP_S, "LEFT", "LEFT")
            if reply == ABANDONED:  # a retry gave up on this request first: the marker stays
                await self._put_back_marker(source, given)
                return None
            if reply:
                return Reply.decode(reply)
            if loop.time() >= deadline or (alive is not None and not await alive()):
                return await self.abandon_reply(request)

    async def _put_back_marker(self, source: str, given: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrem(given, 1, ABANDONED)
        pipe.rpush(source, ABANDONED)
        pipe.expire(source, REPLY_TTL_S)
        await pipe.execute()

    async def take_reply(self, request: str) -> Reply | str | None:
        """Take a reply without waiting: the reply (one still there, or one taken already
        whose taker may never have answered), ABANDONED if an API gave up on it (the marker
        stays), or None if there is none yet."""
        reply = await self._take([keys.reply(request), keys.reply_given(request)], [REPLY_TTL_S, ABANDONED, GIVEN])
        if not reply:
            return None
        return ABANDONED if reply == ABANDONED else Reply.decode(reply)

    async def abandon_reply(self, request: str) -> Reply | None:
        """Stop waiting for a reply: the one that arrived meanwhile (or that this API's own
        take moved but never heard), or None, and then the worker is told nobody waits (it
        undoes a create it finishes later)."""
        late = await self._abandon([keys.reply(request), keys.reply_given(request)], [REPLY_TTL_S, ABANDONED, GIVEN])
        return Reply.decode(late) if late else None

    async def locate(self, sid: str) -> str | None:
        return await self.redis.get(keys.locator(sid))

    async def request_location(self, rid: str) -> tuple[str, str] | None:
        where = await self.redis.get(keys.request_locator(rid))
        if not where:
            return None
        ws, _, sid = where.partition("/")
        return ws, sid

    async def session(self, ws: str, sid: str) -> SessionView | None:
        """The live session's state, or None if the store holds none (closed, swept, lost)."""
        with REDIS_ROUNDTRIP.labels("session_read").time():
            return view_of(await self.redis.hgetall(keys.session(ws, sid)), sid)

    async def send(
        self,
        ws: str,
        incarnation: str,
        command: Command,
        admit_limit: int | None = None,
        idempotency_key: str | None = None,
    ) -> Admission:
        """Hand a command to the session's owner (scripts.SEND); prompts pass `admit_limit`.

        With `idempotency_key`, the first success is kept and a repeat returns it."""
        key_list = [
            keys.session(ws, command.sid), keys.inbox(ws, incarnation), keys.turns(ws, command.sid),
            keys.parked(ws, command.sid),
        ]
        if idempotency_key is not None:
            key_list.append(keys.idempotency(ws, command.sid, idempotency_key))
        turn = ""
        if isinstance(command, commands.Prompt):
            turn = TurnRecord.queued(command.prompt_id, command.text, command.queued_at, command.client_id).pack()
        result = await self._send(
            key_list,
            [
                incarnation,
                commands.encode(command),
                "" if admit_limit is None else admit_limit,
                INBOX_TTL_MS,
                INBOX_MAXLEN,
                command.prompt_id if isinstance(command, commands.Prompt) else "",
                IDEMPOTENCY_TTL_MS,
                turn,
                self.retention.catalog_ms,
            ],
        )
        if result[0] != "ok":
            return Admission(AdmissionStatus(result[0]))
        return Admission(AdmissionStatus.OK, int(result[1]), result[2], result[3], len(result) > 4)

    async def first_outcome(self, ws: str, sid: str, idempotency_key: str) -> Admission | None:
        """The kept first success of a command sent with this key, if any (a repeat)."""
        first = await self.redis.get(keys.idempotency(ws, sid, idempotency_key))
        if first is None:
            return None
        if not first.startswith("["):  # a vote keeps the request id it won
            return Admission(AdmissionStatus.OK, repeated=True)
        result = orjson.loads(first)
        return Admission(AdmissionStatus.OK, int(result[1]), result[2], result[3], True)

    async def vote(self, ws: str, incarnation: str, command: Vote, idempotency_key: str | None = None) -> VoteOutcome:
        """Decide a vote and enqueue it to the owner in one step (scripts.VOTE, which reads
        the vote from the command it enqueues)."""
        key_list = [
            keys.session(ws, command.sid), keys.inbox(ws, incarnation), keys.invalidations(ws), keys.catalog_version(ws),
            keys.attention(ws), keys.attention_details(ws),
        ]
        if idempotency_key is not None:
            key_list.append(keys.idempotency(ws, command.sid, idempotency_key))
        args = [
            incarnation, commands.encode(command), INBOX_TTL_MS, INBOX_MAXLEN, CANCEL_SENTINEL, IDEMPOTENCY_TTL_MS,
            self.retention.catalog_ms,
        ]
        return VoteOutcome(await self._vote(key_list, args))

    async def keep_create(self, idempotency_key: str, sid: str, client_id: str, attached: bool) -> None:
        """The create succeeded (or attached to the workspace's shared session), and its
        creator is told: its key answers with that outcome for a day."""
        record = CreateRecord(sid, client_id, attached, None, kept=True)
        await self.redis.set(keys.create_idempotency(idempotency_key), _pack_record(record), px=IDEMPOTENCY_TTL_MS)

    async def note_create_request(self, idempotency_key: str, sid: str, client_id: str, request: str) -> None:
        """Before a create is sent to a worker: the request whose answer a retry may take or
        abandon."""
        record = CreateRecord(sid, client_id, False, request, kept=False)
        await self.redis.set(keys.create_idempotency(idempotency_key), _pack_record(record), xx=True, keepttl=True)

    async def forget_create(self, idempotency_key: str, sid: str) -> None:
        """A create that failed: its key may be used again (if it is still this create's)."""
        key = keys.create_idempotency(idempotency_key)
        first = await self.redis.get(key)
        if first is not None and first.partition(" ")[0] == sid:
            await self.redis.delete(key)

    async def claim_create(
        self, idempotency_key: str, sid: str, client_id: str, ttl_ms: int = IDEMPOTENCY_TTL_MS
    ) -> CreateRecord | None:
        """Record a create under its idempotency key for `ttl_ms` (the create's own time
        limit, until its outcome is kept); returns the first one's record if there is one."""
        record = CreateRecord(sid, client_id, False, None, kept=False)
        first = await self.redis.set(
            keys.create_idempotency(idempotency_key), _pack_record(record), nx=True, px=ttl_ms, get=True
        )
        return None if first is None else _unpack_record(first)

    async def mark_told(self, ws: str, sid: str) -> None:
        """A create's answer was taken: its creator knows the session (F.REQUEST goes, and
        readers are told that it now shows)."""
        await self._tellings((ws, sid))

    async def _send_tellings(self, tellings: list[tuple[str, str]]) -> list[Any]:
        return await self._pipelined(self._told, [
            ([keys.session(ws, sid), keys.invalidations(ws), keys.catalog_version(ws)], [sid, self.retention.catalog_ms])
            for ws, sid in tellings
        ])

    async def was_told(self, ws: str, sid: str) -> bool:
        """Whether a create's answer was taken: its catalog row stands, and its session (if
        still live) no longer carries the create's request id (see mark_told)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hexists(keys.catalog(ws), sid)
        pipe.hexists(keys.session(ws, sid), F.REQUEST)
        listed, untold = await pipe.execute()
        return bool(listed) and not untold

    async def create_record(self, idempotency_key: str) -> CreateRecord | None:
        value = await self.redis.get(keys.create_idempotency(idempotency_key))
        return None if value is None else _unpack_record(value)

    async def catalog_row(self, ws: str, sid: str) -> dict[str, Any] | None:
        """A session's durable catalog row (written with its first snapshot), if kept."""
        row = await self.redis.hget(keys.catalog(ws), sid)
        return orjson.loads(row) if row else None

    async def attach(self, ws: str, incarnation: str, command: Attach) -> bool:
        """Register a client on a live session (and tell its owner); False if it is gone."""
        return bool(
            await self._attach(
                [
                    keys.session(ws, command.sid), keys.inbox(ws, incarnation), keys.invalidations(ws),
                    keys.catalog_version(ws),
                ],
                [
                    incarnation, command.client_id, commands.encode(command), INBOX_TTL_MS, INBOX_MAXLEN, command.sid,
                    self.retention.catalog_ms,
                ],
            )
        )

    async def claim_single(self, ws: str, sid: str, ttl_ms: int) -> str | None:
        """Claim the workspace's single-scope slot; returns the existing holder if any."""
        return await self.redis.set(keys.single(ws), sid, nx=True, px=ttl_ms, get=True)

    async def release_single(self, ws: str, sid: str) -> None:
        """Drop a claim that did not turn into a live session (compare-and-delete)."""
        await self._release_single([keys.single(ws)], [sid])

    async def claim_load(self, ws: str, sid: str, request: str, ttl_ms: int) -> str | None:
        """Claim the one load that resumes a session that is not live; None if claimed
        here, else the request id of the load under way."""
        return await self.redis.set(keys.load_claim(ws, sid), request, nx=True, px=ttl_ms, get=True)

    async def release_load(self, ws: str, sid: str, request: str) -> None:
        """End our load's claim (kept if another load's claim replaced a lapsed one)."""
        if await self.redis.get(keys.load_claim(ws, sid)) == request:
            await self.redis.delete(keys.load_claim(ws, sid))

    async def list_page(
        self, ws: str, offset: int, size: int
    ) -> list[ListedSession]:
        """Up to size + 1 catalog rows from `offset`, newest first, each with its live state.

        scripts.LIST reads only the session hashes it is given: it is given those the last
        listing of the workspace found live, so a listing is one round trip unless the page
        gained a live session since (then one more, declaring it)."""
        declared = list(self._live_on_page.get(ws, ()))
        while True:
            flat = await self._list(
                [keys.live(ws), keys.catalog(ws), keys.catalog_order(ws), *(keys.session(ws, s) for s in declared)],
                [offset, size, *declared],
            )
            undeclared = [flat[i] for i in range(0, len(flat), 3) if flat[i + 2] is None]
            if not undeclared:
                break
            declared += undeclared
        rows, live = [], []
        for i in range(0, len(flat), 3):
            sid, row, pairs = flat[i], flat[i + 1], flat[i + 2]
            fields = dict(zip(pairs[::2], pairs[1::2], strict=True))
            rows.append(ListedSession(sid, orjson.loads(row) if row else None, view_of(fields, sid)))
            if fields:
                live.append(sid)
        _remember(self._live_on_page, ws, live)
        return rows

    async def live_states(self, workspaces: list[str]) -> dict[str, tuple[CatalogVersion, list[SessionView]]]:
        """Each workspace's catalog version and its live sessions' views, the version read
        first (a reader may then see a newer state than the version says, never an older).

        One pipeline asks every workspace's version, live set and the session hashes its
        last read found live: one round trip per shard, unless a workspace gained a live
        session since (one more for those) or lost its version (one more to start anew)."""
        pipe = self.redis.pipeline(transaction=False)
        for ws in workspaces:
            pipe.hmget(keys.catalog_version(ws), [VersionField.GENERATION, VersionField.REVISION])
            pipe.smembers(keys.live(ws))
            for sid in self._live_in_workspace.get(ws, ()):
                pipe.hgetall(keys.session(ws, sid))
        replies = iter(await pipe.execute())
        found: dict[str, tuple[list[Any], set[str], dict[str, dict[str, str]]]] = {}
        for ws in workspaces:
            version, members = next(replies), set(next(replies))
            hashes = {sid: next(replies) for sid in self._live_in_workspace.get(ws, ())}
            found[ws] = (version, members, hashes)
        missing = [(ws, sid) for ws, (_, members, hashes) in found.items() for sid in members - hashes.keys()]
        if missing:
            pipe = self.redis.pipeline(transaction=False)
            for ws, sid in missing:
                pipe.hgetall(keys.session(ws, sid))
            for (ws, sid), fields in zip(missing, await pipe.execute(), strict=True):
                found[ws][2][sid] = fields
        result: dict[str, tuple[CatalogVersion, list[SessionView]]] = {}
        for ws, (version, members, hashes) in found.items():
            generation, revision = version
            current = (
                CatalogVersion(generation, int(revision)) if generation is not None else await self.catalog_version(ws)
            )
            views = [view for sid in sorted(members) if (view := view_of(hashes.get(sid) or {}, sid)) is not None]
            _remember(self._live_in_workspace, ws, [view.meta["sessionId"] for view in views])
            result[ws] = (current, views)
        return result

    async def catalog_version(self, ws: str) -> CatalogVersion:
        """The workspace's catalog version (a new generation at revision 0 if it had none)."""
        generation, revision = await self._version([keys.catalog_version(ws)], [self.retention.catalog_ms])
        return CatalogVersion(generation, int(revision))

    async def attention_page(
        self, workspaces: list[str], after: AttentionCursor | None, limit: int
    ) -> list[AttentionEntry]:
        """Up to `limit` entries of each workspace's attention index that come after `after`
        in the attention order (`AttentionCursor.order`), all of them in that order. One
        pipeline: one round trip per shard."""
        calls = []
        for ws in workspaces:
            if after is None:
                bound = ["", "gt", ""]
            else:
                # Equal waits are ordered by workspace, then by member (the index's order).
                tie = "ge" if ws >= after.ws else "gt"
                bound = [str(after.since_ms), tie, after.member if ws == after.ws else ""]
            calls.append(([keys.attention(ws), keys.attention_details(ws)], [*bound, limit]))
        replies = await self._pipelined(self._attention_page, calls)
        failed = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failed is not None:
            raise failed
        entries = [entry for ws, flat in zip(workspaces, replies, strict=True) for entry in _attention_entries(ws, flat)]
        entries.sort(key=lambda e: e.order)
        return entries

    async def attention_of(self, ws: str, sid: str) -> list[AttentionEntry]:
        """What one live session waits for (its entries of the attention index)."""
        key_list = [keys.session(ws, sid), keys.attention(ws), keys.attention_details(ws)]
        return _attention_entries(ws, await self._attention_of(key_list, [sid]))

    async def turn(self, ws: str, sid: str, prompt_id: str) -> TurnRecord | None:
        """One turn's record, while it is among the session's kept turns."""
        packed = await self.redis.hget(keys.turns(ws, sid), prompt_id)
        return None if packed is None else TurnRecord.unpack(packed)

    async def current_turn(self, ws: str, sid: str) -> TurnRecord | None:
        """The running turn, else the oldest queued one, else the one that ended last."""
        packed = await self._current_turn([keys.session(ws, sid), keys.turns(ws, sid), keys.turns_ended(ws, sid)], [])
        return TurnRecord.unpack(packed) if packed else None

    async def replay(self, ws: str, sid: str, after: int, upto: int | None = None) -> tuple[list[str], int | None]:
        """Envelopes with ids in (after, upto] from the replay log, plus the first id it holds."""
        stream = keys.events(ws, sid)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(stream, "-", "+", count=1)
        pipe.xrange(stream, f"({after}-0", "+" if upto is None else f"{upto}-0")
        first, entries = await pipe.execute()
        first_id = int(first[0][0].split("-")[0]) if first else None
        return [fields["e"] for _, fields in entries], first_id

    async def transcript_page(
        self, ws: str, sid: str, before: str | None, limit: int
    ) -> tuple[list[tuple[str, str]], dict[str, Any] | None]:
        """Up to limit + 1 transcript entries older than `before`, newest first, and the catalog row."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(keys.transcript(ws, sid), f"({before}" if before else "+", "-", count=limit + 1)
        pipe.hget(keys.catalog(ws), sid)
        entries, row = await pipe.execute()
        return [(entry_id, fields["e"]) for entry_id, fields in entries], orjson.loads(row) if row else None

    async def load_snapshot(
        self, ws: str, sid: str, page_size: int
    ) -> LoadSnapshot:
        """One consistent read (MULTI, one slot): the session hash, the newest transcript page
        (limit + 1 entries, newest first) and the replay log."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(keys.session(ws, sid))
        pipe.xrevrange(keys.transcript(ws, sid), "+", "-", count=page_size + 1)
        pipe.xrange(keys.events(ws, sid), "-", "+")
        fields, page, log_entries = await pipe.execute()
        return LoadSnapshot(
            view_of(fields, sid),
            [(entry_id, f["e"]) for entry_id, f in page],
            [f["e"] for _, f in log_entries],
        )

    # ---- sweeper -----------------------------------------------------------------------

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

    async def forget_worker(self, incarnation: str, workspaces: set[str]) -> None:
        """Delete every key a dead incarnation owned, then release the sweep's claim."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(keys.worker_sessions(incarnation), keys.worker_control(incarnation))
        for ws in workspaces:
            pipe.delete(keys.inbox(ws, incarnation))
        pipe.zrem(keys.SWEEPS, incarnation)  # the tombstone stays: dead stays dead
        await pipe.execute()

    # ---- audit -------------------------------------------------------------------------

    async def key_expiries(self) -> list[tuple[str, str, int]]:
        """Every key of the store's on its server (every master's, on a cluster), with its
        type and its TTL in ms (-1: none, -2: gone meanwhile): nothing of the runtime state
        may outlive its TTL (the chaos run's invariant h reads this after a run)."""
        found = []
        async for key in self.redis.scan_iter(match=f"{keys.PREFIX}:*", count=1000):
            pipe = self.redis.pipeline(transaction=False)
            pipe.type(key)
            pipe.pttl(key)
            key_type, pttl = await pipe.execute()
            found.append((key, key_type, pttl))
        return found


def _commands(reply: Any) -> list[tuple[str, str, Command | MalformedCommand]]:
    return [(stream, entry_id, _decoded(fields)) for stream, entries in reply or [] for entry_id, fields in entries]


def _decoded(fields: dict[str, str]) -> Command | MalformedCommand:
    """An entry's command, or why it is none (the reader skips it and reads on)."""
    if "c" not in fields:
        return MalformedCommand("stream entry has no command field 'c'")
    try:
        return commands.decode(fields["c"])
    except MalformedCommand as error:
        return error


class _StreamReaders:
    """Command streams read on a cluster: one blocking XREAD loop per slot, all feeding one
    queue. A worker's streams span as many slots as it has workspaces (plus its own control
    stream), so this costs one connection per hosted workspace while it waits."""

    def __init__(self, redis: Client) -> None:
        self.redis = redis
        self.queue: asyncio.Queue[tuple[str, str, Command | MalformedCommand]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, dict[str, str]] = {}  # slot -> {stream: cursor}

    async def read(self, cursors: dict[str, str], block_ms: int) -> list[tuple[str, str, Command | MalformedCommand]]:
        wanted: dict[int, dict[str, str]] = {}
        for stream, cursor in cursors.items():
            wanted.setdefault(key_slot(stream.encode()), {})[stream] = cursor
        for slot in [s for s in self._tasks if s not in wanted or wanted[s].keys() != self._streams[s].keys()]:
            self._tasks.pop(slot).cancel()
        for slot, streams in wanted.items():
            if slot not in self._tasks:
                # A reader keeps its own cursors from here on: the caller's are never ahead.
                mine = {s: self._streams.get(slot, {}).get(s, c) for s, c in streams.items()}
                self._streams[slot] = mine
                self._tasks[slot] = asyncio.ensure_future(self._loop(mine, block_ms))
        for slot in [s for s in self._streams if s not in wanted]:
            del self._streams[slot]
        try:
            first = await asyncio.wait_for(self.queue.get(), block_ms / 1000)
        except asyncio.TimeoutError:
            return []
        commands = [first]
        while not self.queue.empty():
            commands.append(self.queue.get_nowait())
        return commands

    async def _loop(self, cursors: dict[str, str], block_ms: int) -> None:
        while True:
            try:
                reply = await self.redis.xread(cursors, block=block_ms, count=COMMAND_BATCH)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away or a slot moving: try again shortly
                log.warning("reading commands from %s failed", list(cursors), exc_info=True)
                await asyncio.sleep(0.5)
                continue
            for command in _commands(reply):
                cursors[command[0]] = command[1]
                self.queue.put_nowait(command)

    async def stop(self) -> None:
        await cancel_until_done(self._tasks.values())
        self._tasks.clear()


# ---- packing ------------------------------------------------------------------------------


def _remember(hints: dict[str, list[str]], ws: str, live: list[str]) -> None:
    """Keep the live ids a workspace's last read found, for the next one to declare (a
    bounded number of workspaces, the oldest forgotten first)."""
    hints.pop(ws, None)
    if live:
        hints[ws] = live
        if len(hints) > LIST_HINTS:
            del hints[next(iter(hints))]


def view_of(fields: dict[str, str], sid: str) -> SessionView | None:
    """Session `sid`'s hash (HGETALL) as readers see it; None unless it is a live session's
    (an owner and its meta). Fields at their zero value are absent (see keys.F)."""
    owner, created = fields.get(F.OWNER), fields.get(F.CREATED)
    if not owner:
        return None
    if created is not None:
        meta = {"sessionId": sid, "workspaceCwd": fields.get(F.CWD, ""), "createdAt": created}
        if F.TITLE in fields:
            meta["displayName"] = fields[F.TITLE]
    elif F.META in fields:
        meta = orjson.loads(fields[F.META])
    else:
        return None
    ordered: list[tuple[float, str]] = []
    client_count = 0
    for name, value in fields.items():
        if name.startswith(F.VOTABLE):
            ordered.append((orjson.loads(value)[0], name[len(F.VOTABLE):]))
        elif name.startswith(F.CLIENT):
            client_count += 1
    ordered.sort()
    pending = [orjson.loads(fields[F.INTERACTION + rid]) for _, rid in ordered if F.INTERACTION + rid in fields]
    turn_error, turn_error_event = fields.get(F.TURN_ERROR), fields.get(F.TURN_ERROR_EVENT)
    return SessionView(
        owner=owner,
        meta=meta,
        updated_at=fields.get(F.UPDATED, meta["createdAt"]),
        active=fields.get(F.ACTIVE) == "1",
        admitted=int(fields.get(F.ADMITTED, "0")),
        client_count=client_count,
        turn_error=orjson.loads(turn_error) if turn_error is not None else None,
        turn_error_event=orjson.loads(turn_error_event) if turn_error_event is not None else None,
        pending=pending,
        last_event_id=int(fields.get(F.SEQ, "0")),
        epoch=fields.get(F.EPOCH, ""),
        told=F.REQUEST not in fields,
        moving=F.MOVING in fields,
    )


def _catalog_json(row: CatalogRow) -> dict[str, Any]:
    """The catalog hash's value for a session (its id is the field, its cwd the workspace's)."""
    value: dict[str, Any] = {"createdAt": row.created_at, "updatedAt": row.updated_at}
    if row.display_name:
        value["displayName"] = row.display_name
    for name, field_value in (("agent", row.agent), ("stateStore", row.state_store),
                              ("agentSessionId", row.agent_sid), ("resumable", row.resumable)):
        if field_value is not None:
            value[name] = field_value
    return value


def _pack_record(record: CreateRecord) -> str:
    """`<sid> <clientId> <attached 0/1> <state>`: state `-` claimed, `<request>` sent, `+` told."""
    state = "+" if record.kept else record.request or "-"
    return f"{record.sid} {record.client_id} {int(record.attached)} {state}"


def _unpack_record(value: str) -> CreateRecord:
    sid, client_id, attached, request = value.split(" ")
    return CreateRecord(sid, client_id, attached == "1", request if request not in ("+", "-") else None, request == "+")


def _attention_entries(ws: str, flat: list[Any]) -> list[AttentionEntry]:
    """ATTENTION_PAGE / ATTENTION_OF replies -> entries (`<sid>/<requestId>` members, `!`
    for a turn error; one without details is skipped, never fails a page)."""
    entries = []
    for i in range(0, len(flat), 3):
        member, since, details = flat[i], flat[i + 1], flat[i + 2]
        if not details:
            continue
        sid, _, rid = member.partition("/")
        owner, _, value = details.partition("\n")
        entries.append(AttentionEntry(ws, sid, None if rid == "!" else rid, int(since), owner, value))
    return entries
