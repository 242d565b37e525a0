"""A create on this worker: its session started (a new one, a load, or a move's arrival),
published, its creator answered, and an answer nobody took taken back. A move's arrival is
taken over as worker/move.py says (`take_over`). With the eager hand-off (the default) a
move's agent session is brought up after the session is ours (worker/bring_up.py).

The worker hands each `create` command here (`Creates.start`); capacity is reserved at once,
before the agent starts. From the agent's answer on, the store is told in order, each write
retried while it is away: the sweeper's index, then the session, then the answer (a
`Reply`). An answer that no API took within the API's wait and a margin is taken back
(`reclaim_loop`), and its session undone: nobody was told of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

from acp_state import commands
from acp_state.clock import iso
from acp_state.commands import Reply
from acp_state.moves import Carry
from acp_state.store import ApplyOutcome, ReplyFate, WorkerStore
from acp_state.tasks import survive
from acp_state.turn_errors import from_exception

from .config import WorkerConfig
from .bring_up import AGENT_UP, BringUp
from .move import go_on_from, take_over, until_let_go
from .session import LiveSession
from .stored_session import until_stored

if TYPE_CHECKING:
    from .agent import AgentProcess

log = logging.getLogger("worker")

# A create's answer that no API took within the API's wait (`waitMs`) and this margin is
# taken back, and the session undone: its API gave up, perhaps without being able to say so
# (Redis was away, or restarted empty and lost the marker).
RECLAIM_MARGIN_S = 5.0
DEFAULT_REPLY_WAIT_MS = 60_000
RECLAIM_TICK_S = 1.0
# A create's answer when its session id is another workspace's (ids are unique across them).
SESSION_ID_CONFLICT = "session_id_conflict"

# An answered create, until its answer is known taken: (deadline, tie-break, request id,
# answer, session), a heap by deadline.
Answered = tuple[float, int, str, Reply, LiveSession]


class Creates:
    """The creates of one worker: those under way (their capacity reserved) and those
    answered whose answer is not yet known to be taken.

    Given what it uses of its worker: the store, the config (capacity, agents on offer), the
    sessions it hosts, whether it drains, its agent children (`agent_for`), how a started
    session is made (`new_session`) and hosted (`host`), the inboxes it reads
    (`follow_inbox(ws)`, under its current incarnation), and its command handler
    (`dispatch`, for the commands parked while a session moved here)."""

    def __init__(
        self,
        *,
        store: WorkerStore,
        config: WorkerConfig,
        sessions: Mapping[str, LiveSession],
        draining: Callable[[], bool],
        agent_for: Callable[..., Awaitable[AgentProcess]],
        new_session: Callable[[commands.Create, str, AgentProcess, str], LiveSession],
        host: Callable[[LiveSession], None],
        follow_inbox: Callable[[str], None],
        dispatch: Callable[[commands.Command], None],
    ) -> None:
        self.store = store
        self.config = config
        self.sessions = sessions
        self.draining = draining
        self.agent_for = agent_for
        self.new_session = new_session
        self.host = host
        self.follow_inbox = follow_inbox
        self.dispatch = dispatch
        self.under_way = 0  # reserved, and not yet one of the worker's sessions
        self._answered: list[Answered] = []
        self._order = itertools.count()

    def start(self, command: commands.Create) -> None:
        """Take a create on (or refuse it at once: the worker drains, or is full)."""
        draining = self.draining()
        if draining or len(self.sessions) + self.under_way >= self.config.max_sessions:
            code = "worker_draining" if draining else "worker_full"
            asyncio.ensure_future(self.store.reply(command.request_id, Reply(ok=False, code=code)))
            return
        self.under_way += 1  # capacity is reserved now, before the agent starts
        self.follow_inbox(command.ws)
        asyncio.ensure_future(self._create(command))

    async def _create(self, command: commands.Create) -> None:
        store = self.store
        sid, cwd = command.sid, command.cwd
        name = command.agent or self.config.default_agent
        if name not in self.config.agents:  # placement read an old report; the API tries another
            self.under_way -= 1
            with contextlib.suppress(Exception):
                await store.reply(command.request_id, Reply(ok=False, code="agent_not_offered"))
            return
        try:
            carry = Carry.unpack(command.carry) if command.carry is not None else None
            returning = command.load or carry is not None or command.move_from is not None
            agent = await self.agent_for(name, cwd, sid, returning=bool(returning))
            if command.load and not agent.supports_load:
                self.under_way -= 1
                with contextlib.suppress(Exception):
                    await store.reply(command.request_id, Reply(ok=False, code="not_resumable"))
                return
            # A move's session is ours first, its agent resumes it after (worker/bring_up.py). A
            # load after a death is answered with what the agent's resume said (its modes: the
            # reference's `POST /session/:id/resume` answers them), or its failure: it loads first.
            eager = bool(command.load) and command.move_from is not None and self.config.handoff == "eager"
            if eager:
                agent_sid = command.agent_sid or sid
            elif command.load:
                agent_sid = await agent.load_session(command.agent_sid or sid, cwd)
                log.info(AGENT_UP, extra={"sessionId": sid})
            else:
                agent_sid = await agent.new_session(cwd, command.mode)
        except Exception as error:
            self.under_way -= 1
            log.exception("%s the session failed", "loading" if command.load else "creating", extra={"sessionId": sid})
            code = "resume_failed" if command.load else "agent_unavailable"
            reason = from_exception(error).message  # an agent's JSON-RPC error: its details, not "Internal error"
            with contextlib.suppress(Exception):  # else the API times out and says so
                await store.reply(command.request_id, Reply(ok=False, code=code, error=reason))
            return
        session = self.new_session(command, name, agent, agent_sid)
        if eager:
            session.bring_up = BringUp(session, command.move_from)
        if carry is not None:
            go_on_from(session, carry)
        if command.move_from is not None:
            session.arriving = []  # prompts sent to us before the carried ones are placed wait
        elif carry is None:  # a new session (a resumed one's row stands whatever happens)
            session.untold_request = command.request_id
        self.host(session)
        self.under_way -= 1  # the reservation is now a session: count it once
        # From here on the store is told, retrying while it is away: the sweeper's index
        # first, then the session, then the API's answer. A session nobody was told of (the
        # answer could not be given, or the API stopped waiting) is undone.
        ours: list[bool] = []

        async def index() -> None:
            ours[:] = [await store.index_session(session.incarnation, session.ws, sid, True)]

        indexed = await until_stored(index)
        if indexed and not ours[0]:
            if command.move_from is None:  # another workspace holds the id: nothing was written
                log.warning("the session id is another workspace's; refusing the create", extra={"sessionId": sid})
                await session.close("conflict", publish=False)
                with contextlib.suppress(Exception):
                    await store.reply(command.request_id, Reply(ok=False, code=SESSION_ID_CONFLICT))
                return
            # (Only a store that lost the locator and let another workspace claim the id meanwhile.)
            log.error("a moved session's id is another workspace's; it moves all the same", extra={"sessionId": sid})
        if command.move_from is not None:
            taken = await take_over(session, command, carry, indexed, store=store, dispatch=self.dispatch)
            if taken and session.bring_up is not None:  # after the old owner let go of it
                session.bring_up.start(until_let_go(session.bring_up, command.move_from, store))
            return
        result = await session.publish_created(command.client_id) if indexed else None
        if result is None or result.applied != ApplyOutcome.APPLIED:
            # (A resumed session's row stands: only a session nobody was told of leaves none.)
            await session.close("conflict", publish=result is None and indexed)
            with contextlib.suppress(Exception):
                await store.reply(command.request_id, Reply(ok=False, code="session_conflict"))
            return
        answer = Reply(ok=True, created_at=iso(session.created_ms), incarnation=session.incarnation)
        wait_ms = command.wait_ms
        wait_s = (wait_ms if isinstance(wait_ms, int) and 0 < wait_ms <= 3_600_000 else DEFAULT_REPLY_WAIT_MS) / 1000
        kept_s = math.ceil(wait_s + 3 * RECLAIM_MARGIN_S)  # still there when taken back
        if not await until_stored(lambda: store.reply(command.request_id, answer, kept_s)):
            log.warning("the create's answer was not taken; closing the session", extra={"sessionId": sid})
            await session.close("create_abandoned", uncatalog=not session.resumed)
            return
        deadline = asyncio.get_running_loop().time() + wait_s + RECLAIM_MARGIN_S
        heapq.heappush(self._answered, (deadline, next(self._order), command.request_id, answer, session))

    async def reclaim_loop(self) -> None:
        """Undo the creates whose answer nobody took (see RECLAIM_MARGIN_S)."""
        while True:
            await asyncio.sleep(RECLAIM_TICK_S)
            now = asyncio.get_running_loop().time()
            due = []
            while self._answered and self._answered[0][0] <= now:
                due.append(heapq.heappop(self._answered))
            due = [entry for entry in due if not entry[4].closed]
            if due and not await survive("create reclaim", lambda: self._reclaim(due)):
                for entry in due:  # the store is away: ask again next time
                    heapq.heappush(self._answered, entry)

    async def _reclaim(self, due: list[Answered]) -> None:
        fates = await self.store.reclaim_replies([(request, answer) for _, _, request, answer, _ in due])
        for (_, _, _, _, session), fate in zip(due, fates, strict=True):
            if fate is ReplyFate.UNTAKEN:
                log.warning("nobody took the create's answer; closing the session", extra={"sessionId": session.sid})
                await session.close("create_abandoned", uncatalog=not session.resumed)
            else:  # taken; or lost with its keys, and no API said it gave up: taken before the loss
                if fate is ReplyFate.LOST:
                    log.warning("the create's answer was lost with the store; no API gave up on it, so it was "
                                "taken", extra={"sessionId": session.sid})
                session.untold_request = None  # its creator was told (a rewrite must not say otherwise)
                await session.mark_told()
