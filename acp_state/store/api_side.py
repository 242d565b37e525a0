"""The API's hand-overs on `RedisStore` (the writing half of `ReaderStore`): commands handed
to a session's owner (a prompt, a cancel, a close, a vote, an attach) or to a worker (a
create, a drain), the replies awaited for them, a create's idempotency record, and the
claims on a workspace's single-scope slot and on a session's load.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable

import orjson

from .. import commands, tracing
from ..commands import CANCEL_SENTINEL, Attach, Command, Create, Drain, Reply, Vote
from ..turns import TurnRecord
from . import keys, scripts
from .batching import PerLoopTurn, Script, pipelined
from .codec import pack_create_record, unpack_create_record
from .keys import F
from .side import INBOX_MAXLEN, INBOX_TTL_MS, REPLY_TTL_S, RedisSide
from .types import (
    ABANDONED, GIVEN, Admission, AdmissionStatus, CreateKey, CreateRecord, DeleteOutcome, IdClaim, LoadClaim, VoteOutcome,
)

# One BLPOP must end well inside the client's socket read timeout (5 s by default since
# redis-py 8), or the read fails with TimeoutError instead of returning nil.
REPLY_WAIT_STEP_S = 1
# The first outcome of a command sent with an idempotency key is kept this long.
IDEMPOTENCY_TTL_MS = 24 * 3600 * 1000


class ApiSide(RedisSide):
    """An API process's hand-overs (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._send = Script(self.redis, scripts.SEND)
        self._vote = Script(self.redis, scripts.VOTE)
        self._attach = Script(self.redis, scripts.ATTACH)
        self._told = Script(self.redis, scripts.TOLD)
        self._take = Script(self.redis, scripts.TAKE)
        self._abandon = Script(self.redis, scripts.ABANDON)
        self._release_single = Script(self.redis, scripts.RELEASE_SINGLE)
        self._claim_sid = Script(self.redis, scripts.CLAIM_SID)
        self._claim_load = Script(self.redis, scripts.CLAIM_LOAD)
        self._delete_listed = Script(self.redis, scripts.DELETE_LISTED)
        self._controls = PerLoopTurn(self._send_controls)
        self._tellings = PerLoopTurn(self._send_tellings)

    # ---- commands and their replies ---------------------------------------------------

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
        inbox = keys.inbox(ws, incarnation)
        key_list = [keys.session(ws, command.sid), inbox, keys.turns(ws, command.sid), keys.parked(ws, command.sid)]
        if idempotency_key is not None:
            key_list.append(keys.idempotency(ws, command.sid, idempotency_key))
        if not isinstance(command, commands.Prompt):
            return await self._sent(key_list, incarnation, command, admit_limit)
        # A prompt takes its trace along (the send span's context), for the worker to go on with.
        with tracing.sending(command.TYPE, command.sid, command.prompt_id, inbox) as trace:
            if trace:
                command = dataclasses.replace(command, trace=trace)
            return await self._sent(key_list, incarnation, command, admit_limit)

    async def _sent(self, key_list: list[str], incarnation: str, command: Command, admit_limit: int | None) -> Admission:
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
            keys.attention(ws), keys.attention_details(ws), *self.attention_all_keys(ws), keys.change_log(ws),
        ]
        if idempotency_key is not None:
            key_list.append(keys.idempotency(ws, command.sid, idempotency_key))
        args = [
            incarnation, commands.encode(command), INBOX_TTL_MS, INBOX_MAXLEN, CANCEL_SENTINEL, IDEMPOTENCY_TTL_MS,
            self.retention.catalog_ms,
        ]
        return VoteOutcome(await self._vote(key_list, args))

    async def attach(self, ws: str, incarnation: str, command: Attach) -> bool:
        """Register a client on a live session (and tell its owner); False if it is gone.
        (scripts.ATTACH reads the client and the session from the command it enqueues.)"""
        key_list = [
            keys.session(ws, command.sid), keys.inbox(ws, incarnation), keys.invalidations(ws), keys.catalog_version(ws),
            keys.change_log(ws),
        ]
        args = [incarnation, commands.encode(command), INBOX_TTL_MS, INBOX_MAXLEN, self.retention.catalog_ms]
        return bool(await self._attach(key_list, args))

    # ---- creates ------------------------------------------------------------------------

    async def claim_create(
        self, idempotency_key: CreateKey, sid: str, client_id: str, ttl_ms: int = IDEMPOTENCY_TTL_MS
    ) -> CreateRecord | None:
        """Record a create under its idempotency key (scoped to its workspace and principal)
        for `ttl_ms` (the create's own time limit, until its outcome is kept); returns the
        first one's record if there is one."""
        record = CreateRecord(sid, client_id, False, None, kept=False)
        first = await self.redis.set(_create_key(idempotency_key), pack_create_record(record), nx=True, px=ttl_ms, get=True)
        return None if first is None else unpack_create_record(first)

    async def note_create_request(self, idempotency_key: CreateKey, sid: str, client_id: str, request: str) -> None:
        """Before a create is sent to a worker: the request whose answer a retry may take or
        abandon."""
        record = CreateRecord(sid, client_id, False, request, kept=False)
        await self.redis.set(_create_key(idempotency_key), pack_create_record(record), xx=True, keepttl=True)

    async def keep_create(self, idempotency_key: CreateKey, sid: str, client_id: str, attached: bool) -> None:
        """The create succeeded (or attached to the workspace's shared session), and its
        creator is told: its key answers with that outcome for a day."""
        record = CreateRecord(sid, client_id, attached, None, kept=True)
        await self.redis.set(_create_key(idempotency_key), pack_create_record(record), px=IDEMPOTENCY_TTL_MS)

    async def forget_create(self, idempotency_key: CreateKey, sid: str) -> None:
        """A create that failed: its key may be used again (if it is still this create's)."""
        key = _create_key(idempotency_key)
        first = await self.redis.get(key)
        if first is not None and first.partition(" ")[0] == sid:
            await self.redis.delete(key)

    async def create_record(self, idempotency_key: CreateKey) -> CreateRecord | None:
        value = await self.redis.get(_create_key(idempotency_key))
        return None if value is None else unpack_create_record(value)

    async def claim_session_id(self, ws: str, sid: str) -> IdClaim:
        """Claim session id `sid` for workspace `ws` (scripts.CLAIM_SID, in the locator's
        slot): FOREIGN if another workspace holds it (nothing written)."""
        return IdClaim(int(await self._claim_sid([keys.locator(sid)], [ws, self.locator_ttl_ms])))

    async def mark_told(self, ws: str, sid: str) -> None:
        """A create's answer was taken: its creator knows the session (F.REQUEST goes, and
        readers are told that it now shows)."""
        await self._tellings((ws, sid))

    async def _send_tellings(self, tellings: list[tuple[str, str]]) -> list[Any]:
        return await pipelined(self.redis, self._told, [
            (
                [keys.session(ws, sid), keys.invalidations(ws), keys.catalog_version(ws), keys.change_log(ws)],
                [sid, self.retention.catalog_ms],
            )
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

    # ---- claims ---------------------------------------------------------------------------

    async def claim_single(self, ws: str, sid: str, ttl_ms: int) -> str | None:
        """Claim the workspace's single-scope slot; returns the existing holder if any."""
        return await self.redis.set(keys.single(ws), sid, nx=True, px=ttl_ms, get=True)

    async def spend_ticket(self, nonce: str, ttl_ms: int) -> bool:
        """Mark a stream ticket used; False: it was used already (on any API process)."""
        return bool(await self.redis.set(keys.stream_ticket(nonce), b"1", nx=True, px=ttl_ms))

    async def release_single(self, ws: str, sid: str) -> None:
        """Drop a claim that did not turn into a live session (compare-and-delete)."""
        await self._release_single([keys.single(ws)], [sid])

    async def claim_load(self, ws: str, sid: str, request: str, ttl_ms: int) -> LoadClaim:
        """Claim the one load that resumes a session that is not live (scripts.CLAIM_LOAD):
        OK claimed here, HELD by a load under way, GONE its catalog row is not there (a
        delete won)."""
        result = await self._claim_load([keys.load_claim(ws, sid), keys.catalog(ws)], [sid, request, ttl_ms])
        return LoadClaim(result[0])

    async def delete_listed(self, ws: str, sid: str, idempotency_key: str | None = None) -> DeleteOutcome:
        """Delete a listed session that is not live (scripts.DELETE_LISTED): its catalog row,
        turn records, transcript and replay log, unless a load claimed or resumed it."""
        key_list = [
            keys.session(ws, sid), keys.load_claim(ws, sid), keys.live(ws), keys.catalog(ws), keys.catalog_order(ws),
            keys.turns(ws, sid), keys.turns_ended(ws, sid), keys.transcript(ws, sid), keys.events(ws, sid),
            keys.invalidations(ws), keys.catalog_version(ws), keys.change_log(ws),
        ]
        if idempotency_key is not None:
            key_list.append(keys.idempotency(ws, sid, idempotency_key))
        result = await self._delete_listed(key_list, [sid, self.retention.catalog_ms, IDEMPOTENCY_TTL_MS])
        return DeleteOutcome(result)

    async def release_load(self, ws: str, sid: str, request: str) -> None:
        """End our load's claim (kept if another load's claim replaced a lapsed one)."""
        if await self.redis.get(keys.load_claim(ws, sid)) == request:
            await self.redis.delete(keys.load_claim(ws, sid))


def _create_key(key: CreateKey) -> str:
    return keys.create_idempotency(key.ws, key.principal, key.key)
