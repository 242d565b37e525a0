"""A worker's drain: its sessions move to other workers instead of ending with it.

SIGTERM (or `acp-state drain <incarnation>`) starts it. The worker's report says `draining`
at once, so placement sends it no create or load. Every session is held (no new turn starts;
prompts that arrive queue), its running turn gets the grace to finish, and then it moves:

1. The worker picks a target (`acp_state.moves.accepts`: live, not draining, the session's
   agent, the same agent-state store) and runs MOVE: the session is marked moving, commands
   sent from then on are parked for the new owner, and the worker's own inbox gets a
   `moving` marker behind every command sent before.
2. Once the marker is read (every such command is in hand) and the session's writes are in
   the store, it sends the target a `create` that loads the session (ACP `session/load`)
   and carries its state, queued prompts included (`acp_state.moves.Carry`).
3. The target takes the session over in one step (the APPLY takeover: owner, log and epoch
   kept, one `session_moved` event), then runs the carried prompts, the parked ones, and
   those sent to it since, in that order. The worker here forgets the session.

Moves spread over the targets (the one with the most room, counting the moves already sent
it), a few hand-offs at a time to each. A target that fails or dies is replaced by another
(MOVE again names the new one, whose takeover alone can succeed); a session that ended under
a target meanwhile is forgotten here, never written again. A turn still running when the
grace runs out ends with a `turn_error` (`worker_draining`), its pending requests cancelled.
A session that finds no target before the grace ends is closed, as a stop without a drain
closes it.

A stop ends within its bound whatever the store does. Until the grace ends, a store that is
away only delays the moves (they look for targets again); once it is spent, the moves
under way go on only while the store takes a renewal of the lease within STORE_SILENCE_S.
A drain that cannot hand over then ends *stranded*: its sessions stay as they are in the
store, in this incarnation's index, and nothing more is written or said for them (closing
them needs the store too); the worker stops its agents and exits non-zero, saying why in
one line. The lease lapses (or is resigned, if the store is back by then), the sweep ends
the sessions for their clients (`worker_lost`, `session_died`), and a later load resumes
them from the agent's history.

The session's own part of a move, on both workers, is `MovableSession` below (mixed into
`LiveSession`): held, its marker and writes awaited, its turn stopped, its state carried and
handed over here; resumed from that state, taken over and its carried prompts run first on
the target. The mover and the moved side by side, as rq keeps a command's sender and handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Awaitable, Callable

from acp_state import commands, events, ids, logs
from acp_state.clock import from_iso, iso, now_ms
from acp_state.moves import Carry, accepts
from acp_state.store import Applied, CatalogRow, Mode, Transition, WorkerRegistry, is_transient
from acp_state.tasks import cancel_until_done
from acp_state.turn_errors import TurnError

from .prompt import AUTOMATIC_KINDS, Prompt

if TYPE_CHECKING:
    from .agent import AgentProcess
    from .session import LiveSession
    from .worker import Worker

log = logging.getLogger("worker.drain")

DRAINING = "worker_draining"
STOPPED_MESSAGE = "the worker was drained before the turn completed"
# A target's answer to a move: its agent loads the session (Qwen reads its chat file).
MOVE_WAIT_S = 60.0
# How often a session that found no target looks again while the grace lasts.
RETRY_S = 0.25
RETRY_MAX_S = 4.0
# Hand-offs in flight to one target: a new worker's agent starts cold, and a burst of loads
# queued behind it would time out together.
HANDOFFS_PER_TARGET = 8
# The live workers' reports are read at most this often (one read serves every move).
REPORTS_FRESH_S = 0.5
# How long a drain waits for the agent to answer a turn it cancelled (see stop_turn).
CANCEL_ANSWER_S = 5.0
# Past the grace, the moves go on only while the store takes a renewal within this long
# (tried again on an error meanwhile: a connection to a server just back can fail once).
STORE_SILENCE_S = 3.0
STORE_RETRY_S = 0.25
# Past the grace, how often the store is asked while moves are still under way.
STORE_CHECK_S = 1.0
# A stranded worker's last try at resigning its lease (its sessions swept at once).
RESIGN_S = 1.0


async def drain(worker: Worker, grace_s: float) -> str | None:
    """Move every session of `worker` to other workers within `grace_s` (see module); what
    stranded the drain (the store's silence, named), or None."""
    return await Drain(worker, grace_s).run()


async def leave_stranded(worker: Worker) -> None:
    """A stranded worker's leave: its sessions stay indexed for the sweeper, so the lease is
    not released but resigned, if the store answers at once; else it lapses."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(worker.store.resign(worker.incarnation), RESIGN_S)


class Drain:
    """One drain of one worker: its moves share the targets' view, spread over them."""

    def __init__(self, worker: Worker, grace_s: float) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        # The grace bounds the turns and the wait for a target; a move that found one may
        # go on to other targets for one more hand-off's time after it.
        self.deadline = self.loop.time() + grace_s
        self.last_try = self.deadline + MOVE_WAIT_S
        self.registry = WorkerRegistry(worker.store)
        self.assigned: Counter[str] = Counter()  # moves sent to each target by this drain
        self.slots: dict[str, asyncio.Semaphore] = {}
        self._reports: list[dict] = []
        self._read_at = float("-inf")

    async def run(self) -> str | None:
        worker = self.worker
        grace_s = max(0.0, self.deadline - self.loop.time())
        log.info("draining %d sessions (grace %.1f s)", len(worker.sessions), grace_s)
        handled: set[str] = set()
        moved = 0
        stranded = None
        # Creates already under way when the drain began still add sessions: they move too.
        while sessions := [s for s in worker.sessions.values() if s.sid not in handled]:
            handled.update(s.sid for s in sessions)
            for session in sessions:
                session.hold()
            moves = asyncio.ensure_future(
                asyncio.gather(*(self._move(session) for session in sessions), return_exceptions=True)
            )
            stranded = await self._moved_or_stranded(moves)
            if stranded is not None:
                break
            results = moves.result()
            moved += sum(1 for result in results if result is True)
            for session, result in zip(sessions, results, strict=True):
                if isinstance(result, BaseException):
                    log.error("moving a session failed: %r", result, extra={"sessionId": session.sid})
        left = [s for s in worker.sessions.values() if not s.closed]
        if stranded is None and left:  # the shutdown closes them: can it?
            stranded = await self._store_silence()
        if stranded is None:
            log.info("drained: %d of %d sessions moved (to %s)", moved, len(handled), dict(self.assigned))
            return None
        for session in left:
            session.strand()
        log.error(
            "stopping with %d of %d sessions not handed over: %s once the drain's grace (%.0f s) was spent; "
            "they are left to the sweep and to a later load, the agents are stopped, the worker exits non-zero",
            len(left), len(handled), stranded, grace_s,
        )
        return stranded

    async def _moved_or_stranded(self, moves: asyncio.Future[list]) -> str | None:
        """Until the moves end: None. Within the grace they run on; after it, only while the
        store answers: else they are stopped, and what the store failed with is returned."""
        left = self.deadline - self.loop.time()
        if left > 0:
            done, _ = await asyncio.wait({moves}, timeout=left)
            if done:
                return None
        while not moves.done():
            silence = asyncio.ensure_future(self._store_silence())
            await asyncio.wait({moves, silence}, return_when=asyncio.FIRST_COMPLETED)
            if moves.done():
                await cancel_until_done([silence])
                return None
            if silence.result() is not None:
                await cancel_until_done([moves])
                return silence.result()
            await asyncio.wait({moves}, timeout=STORE_CHECK_S)
        return None

    async def _store_silence(self) -> str | None:
        """None once the store takes a renewal of our lease; after STORE_SILENCE_S without,
        what it failed with."""
        give_up = self.loop.time() + STORE_SILENCE_S
        error: BaseException = TimeoutError()
        while (left := give_up - self.loop.time()) > 0:
            try:
                await asyncio.wait_for(asyncio.shield(self.worker.check_standing()), left)
                return None
            except Exception as failed:  # (asyncio's TimeoutError included)
                error = failed
                if not isinstance(failed, TimeoutError):
                    await asyncio.sleep(min(STORE_RETRY_S, max(0.0, give_up - self.loop.time())))
        return logs.describe(error)

    async def _move(self, session: LiveSession) -> bool:
        """Move one session; True once another worker holds it. One that cannot move is
        left to the shutdown, which closes it."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(session.until_idle(), max(0.0, self.deadline - self.loop.time()))
        if session.closed or (session.resumable is False and session.has_history):
            return False  # (an agent that cannot load its history cannot take it elsewhere: it closes)
        if session.active is not None:
            await session.stop_turn(DRAINING, STOPPED_MESSAGE)
        tried: set[str] = set()
        pause = RETRY_S
        while not session.closed:
            try:
                target = await self._target(session, tried)
            except Exception as error:  # the store is away: look again while the grace lasts
                if not is_transient(error):
                    raise
                target = None
            if target is None:
                if self.loop.time() >= self.deadline:
                    return False
                await asyncio.sleep(pause)
                pause = min(2 * pause, RETRY_MAX_S)  # targets that keep failing are not hammered
                tried.clear()  # a target that failed may serve again later
                continue
            if self.loop.time() >= self.last_try:
                return False
            tried.add(target)
            if not await self.worker.store.mark_moving(session.ws, session.sid, session.incarnation, target):
                # Not ours any more: a target we gave up on took it over, or it ended (its
                # new owner died and was swept). Either way nothing of it is ours to write.
                await session.hand_over()
                return False
            if not session.moving:
                session.moving = True  # the worker's rewrites leave it to us from now on
                try:
                    await asyncio.wait_for(session.wait_marker(), MOVE_WAIT_S)
                except asyncio.TimeoutError:  # the store lost it (restarted empty): closed instead
                    log.warning("the move's marker never came back", extra={"sessionId": session.sid})
                    return False
            await session.written()
            async with self.slots.setdefault(target, asyncio.Semaphore(HANDOFFS_PER_TARGET)):
                owner = await self._hand_to(session, target)
            if owner == target:
                await session.hand_over()
                log.info("session moved to %s", target, extra={"sessionId": session.sid})
                return True
            if owner != session.incarnation:  # it ended meanwhile (swept): forget it, write nothing
                await session.hand_over()
                return False
            log.warning("moving the session to %s failed", target, extra={"sessionId": session.sid})
        return False

    async def _target(self, session: LiveSession, tried: set[str]) -> str | None:
        """The live worker that can resume the session and has the most room, counting the
        moves this drain already sent it; not us, and none tried."""
        now = self.loop.time()
        if now - self._read_at >= REPORTS_FRESH_S:
            self._read_at = now
            live = [inc for inc in await self.registry.live() if inc != self.worker.incarnation]
            self._reports = list((await self.worker.store.worker_reports(live)).values())
        agent = session.agent_name or self.worker.config.default_agent
        fitting = [
            r for r in self._reports
            if r["incarnation"] not in tried and accepts(r, agent, session.state_store)
        ]
        if not fitting:
            return None
        chosen = min(
            fitting,
            key=lambda r: (r.get("sessions", 0) + self.assigned[r["incarnation"]]) / max(r.get("maxSessions", 1), 1),
        )
        self.assigned[chosen["incarnation"]] += 1  # counted at once: concurrent moves spread
        return chosen["incarnation"]

    async def _hand_to(self, session: LiveSession, target: str) -> str | None:
        """Send `target` the create that loads the session; who holds it now (None: no one)."""
        request_id = ids.new_id()
        create = commands.Create(
            ws=session.ws, sid=session.sid, cwd=session.cwd, request_id=request_id, agent=session.agent_name,
            scope="single" if session.single else "thread",
            # A session whose agent was never sent a prompt has nothing to load: the target
            # starts a new agent session for it.
            load=session.has_history, agent_sid=session.agent_sid, move_from=session.incarnation,
            carry=session.carry().pack(), source_type=session.source[0], source_id=session.source[1],
        )
        await self.worker.store.send_control(target, create)
        reply = await self.worker.store.await_reply(
            request_id, MOVE_WAIT_S, alive=lambda: self.registry.is_live(target)
        )
        if reply is not None and reply.ok:
            return target
        # No answer (a late one would find the request abandoned): the store says who holds it.
        view = await self.worker.store.session(session.ws, session.sid)
        return view.owner if view is not None else None


class MovableSession:
    """A live session's part in a move (see the module): what the drain asks of it here,
    and how it resumes or arrives on its new owner. Mixed into `LiveSession`, whose state
    it reads and writes; it has none of its own."""

    __slots__ = ()

    if TYPE_CHECKING:  # the session's (worker/session.py)
        sid: str
        agent: AgentProcess
        agent_sid: str
        closed: bool
        active: Prompt | None
        queue: list[Prompt]
        automatic: dict[str, list[Prompt]]
        created_ms: int
        updated_ms: int
        display_name: str | None
        clients: set[str]
        abandoned: bool
        turn_error: TurnError | None
        turn_error_event: bool
        resumed: bool
        has_history: bool
        holding: bool
        arriving: list[Prompt] | None
        _marker_read: asyncio.Event | None
        _idle: asyncio.Event | None
        _in_order: asyncio.Lock
        _runner: asyncio.Task[None] | None
        _on_gone: Callable[..., Awaitable[None]]

        def _waiting(self) -> list[Prompt]: ...
        def _terminal(self, prompt: Prompt) -> Transition: ...
        def _resolve_all_pending(self, event_list: list[str]) -> list[str]: ...
        def _mark_published(self) -> None: ...
        def _track_state(self) -> None: ...
        def catalog_row(self) -> CatalogRow: ...
        async def _write(self, transition: Transition) -> Applied | None: ...
        async def _run(self) -> None: ...

    def resume_from(self, carry: Carry) -> None:
        """Go on from a resumed session's carried state (its row's times and title; on a
        move also its clients, queued prompts and turn error)."""
        self.resumed = True
        self.created_ms = from_iso(carry.created_at)
        self.updated_ms = from_iso(carry.updated_at)
        self.display_name = carry.display_name
        self.clients.update(carry.clients)
        self.has_history = carry.history
        if carry.turn_error is not None:
            view = carry.turn_error
            self.turn_error = TurnError(view.get("message", ""), view.get("code"), view.get("errorKind"))
            self.turn_error_event = carry.turn_error_event

    def carry(self) -> Carry:
        """What the new owner of a moving session goes on from (queued prompts in order)."""
        waiting = [prompt for prompt in self._waiting() if not prompt.ended]
        return Carry(
            created_at=iso(self.created_ms),
            updated_at=iso(self.updated_ms),
            display_name=self.display_name,
            clients=sorted(self.clients),
            prompts=[prompt.command for prompt in waiting],
            turn_error=self.turn_error.status_view() if self.turn_error is not None else None,
            turn_error_event=self.turn_error_event,
            history=self.has_history,
        )

    def hold(self) -> None:
        """A drain began: start no new turn here (what is admitted queues and moves)."""
        self.holding = True
        self._marker_read = asyncio.Event()

    def marker_read(self) -> None:
        if self._marker_read is not None:
            self._marker_read.set()

    async def wait_marker(self) -> None:
        """Until our inbox's `moving` marker was read: every command sent before it is ours."""
        assert self._marker_read is not None
        await self._marker_read.wait()

    async def written(self) -> None:
        """Until every transition queued so far reached the store (they are written in order)."""
        await asyncio.sleep(0)  # writes started as tasks just before reach the queue first
        async with self._in_order:
            pass

    async def until_idle(self) -> None:
        """Until no turn runs (a held session starts none)."""
        while self.active is not None and not self.closed:
            self._idle = asyncio.Event()
            await self._idle.wait()

    async def stop_turn(self, code: str, message: str) -> None:
        """End the running turn now (a drain's grace ran out): the agent is told to cancel,
        what it awaits is answered cancelled, and the turn ends with a `turn_error` that
        says why; its late answer then changes nothing."""
        prompt = self.active
        if prompt is None or self.closed:
            return
        prompt.cancel_requested = True
        if prompt.sent:
            await self.agent.cancel(self.agent_sid)
        transition = self._terminal(prompt)
        transition.interactions_removed = self._resolve_all_pending(transition.events)
        prompt.turn = prompt.turn.failed(now_ms(), message, code)
        transition.turns.append(prompt.turn)
        data = {"sessionId": self.sid, "message": message, "code": code, "promptId": prompt.prompt_id}
        transition.events.append(events.body("turn_error", data, prompt.prompt_id))
        # Kept for refresh-append, as every turn error is: a client that reloads (or whose
        # stream resumed past a gap, which reloads) still sees why the turn stopped. The
        # status's `turnError` stays unset: the session itself did not fail.
        self.turn_error_event = True
        transition.keep_turn_error_event = len(transition.events)
        await self._write(transition)
        if prompt.sent and self._runner is not None:
            # The agent answers the cancelled prompt once it has recorded the turn: the
            # session's history must be complete before another worker loads it.
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(self._runner), CANCEL_ANSWER_S)

    def _went_idle(self) -> None:
        if self._idle is not None and self.active is None:
            self._idle.set()

    async def publish_moved(self, previous: str) -> Applied | None:
        """Take the session over from `previous`, which named us its target: one event on
        its stream says it moved; its log, epoch and fields stay (scripts' takeover)."""
        data = {"sessionId": self.sid, "reason": "worker_draining"}
        transition = Transition(
            mode=Mode.TAKEOVER, takeover_from=previous, catalog=self.catalog_row(),
            events=[events.body("session_moved", data)],
        )
        try:
            return await self._write(transition)
        finally:
            self._mark_published()

    def arrive(self, carried: list[Prompt]) -> list[Prompt]:
        """The move is done: the prompts carried from the old owner (announced there as
        queued) run first. Returns those sent here meanwhile, which the caller enqueues after
        the parked commands (in the same turn of the loop: nothing comes between)."""
        since, self.arriving = self.arriving or [], None
        for prompt in carried:
            prompt.queued = True
            (self.automatic.setdefault(prompt.kind, []) if prompt.kind in AUTOMATIC_KINDS else self.queue).append(prompt)
        if self._waiting() and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._run())
        return since

    def strand(self) -> None:
        """The drain could not hand the session over, the store being away: forget it here,
        writing nothing and telling the agent nothing (the agent is stopped). It stays in
        the store and in our index for the sweeper, which ends it for its clients; a later
        load resumes it from the agent's history."""
        if self.closed:
            return
        self.closed = True
        self.abandoned = True  # a write still retrying gives up
        self._mark_published()
        self._track_state()
        for prompt in self._waiting():
            prompt.ended = True
        self.queue.clear()
        self.automatic.clear()

    async def hand_over(self) -> None:
        """The session moved to another worker: forget it here, writing nothing (the new
        owner holds it now, and the agent child here lets go of it)."""
        if self.closed:
            return
        self.closed = True
        self._mark_published()
        self._track_state()
        for prompt in self._waiting():
            prompt.ended = True  # they run on the new owner
        self.queue.clear()
        self.automatic.clear()
        try:
            await self.agent.forget(self.agent_sid)
        except Exception:  # the child may be gone already
            log.warning("could not tell the agent", extra={"sessionId": self.sid}, exc_info=True)
        await self._on_gone(self)
