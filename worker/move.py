"""A session's move from a draining worker to another, on both sides: handing it off here
(`Drain`) and taking it over there (`take_over`).

SIGTERM (or `acp-state drain <incarnation>`) starts a drain. The worker's report says
`draining` at once, so placement sends it no create or load. Every session is held (no new
turn starts; prompts that arrive queue), its running turn gets the grace to finish, and
then it moves:

1. The worker picks a target (`acp_state.placement`: live, not draining, the session's
   agent, the same agent-state store, the least loaded) and runs MOVE: the session is
   marked moving, commands sent from then on are parked for the new owner, and the
   worker's own inbox gets a `moving` marker behind every command sent before.
2. Once the marker is read (every such command is in hand) and the session's writes are in
   the store, it sends the target a `create` that loads the session (ACP `session/load`)
   and carries its state, queued prompts included (`carry_of`, `acp_state.moves.Carry`).
3. The target takes the session over in one step (`take_over`: the APPLY takeover, owner,
   log and epoch kept, one `session_moved` event) and answers, then queues the carried
   prompts, the parked ones, and those sent to it since, in that order. The worker here
   forgets the session (its agent closes it) and says so to the target (`Released`).
4. The eager hand-off (the default, `--handoff eager`): the target's agent resumes the
   session only now, in the background (worker/bring_up.py), once the old owner said it let
   go (or its lease lapsed: `until_let_go`); the queued prompts wait for it. The paced one
   (`--handoff paced`, as before): the target's agent loads the session before step 3, and
   the client's stream waits for that load.

A drain first tells its targets the agent children to start (`Warm`, per agent and
workspace as many targets as it has sessions of it, least loaded first), and sends a
workspace's sessions to targets whose child for it runs (their reports say so) while those
are not much fuller than the others: they wait for no cold start.

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

The mover and the moved side by side, as rq keeps a command's sender and handler; the steps
of the session's own state (held, its turn stopped, handed over; resumed, taken over, its
carried prompts run first) are `LiveSession`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

from acp_state import commands, ids, logs
from acp_state.clock import from_iso, iso
from acp_state.commands import Reply
from acp_state.moves import Carry
from acp_state.placement import accepts, ranked, runs_child
from acp_state.store import ApplyOutcome, WorkerRegistry, WorkerReport, WorkerStore, is_transient
from acp_state.tasks import cancel_until_done
from acp_state.turn_errors import TurnError

from .prompt import Prompt
from .stored_session import until_stored

if TYPE_CHECKING:
    from .bring_up import BringUp
    from .session import LiveSession

log = logging.getLogger("worker.drain")

DRAINING = "worker_draining"
STOPPED_MESSAGE = "the worker was drained before the turn completed"
# A target's answer to a move: its agent loads the session (Qwen reads its chat file).
MOVE_WAIT_S = 60.0
# How often a session that found no target looks again while the grace lasts.
RETRY_S = 0.25
RETRY_MAX_S = 4.0
# Hand-offs in flight to one target: a new worker's agent starts cold, and a burst of loads
# queued behind it would time out together (an eager hand-off waits for no load: more).
HANDOFFS_PER_TARGET = 8
EAGER_HANDOFFS_PER_TARGET = 64
# How often a target waiting for the old owner's release asks whether its lease still runs.
RELEASE_CHECK_S = 0.5
# The live workers' reports are read at most this often (one read serves every move).
REPORTS_FRESH_S = 0.5
# Past the grace, the moves go on only while the store takes a renewal within this long
# (tried again on an error meanwhile: a connection to a server just back can fail once).
STORE_SILENCE_S = 3.0
STORE_RETRY_S = 0.25
# Past the grace, how often the store is asked while moves are still under way.
STORE_CHECK_S = 1.0
# A stranded worker's last try at resigning its lease (its sessions swept at once).
RESIGN_S = 1.0


def carry_of(session: LiveSession) -> Carry:
    """What the new owner of a moving session goes on from (queued prompts in order)."""
    waiting = [prompt for prompt in session.waiting() if not prompt.ended]
    return Carry(
        created_at=iso(session.created_ms),
        updated_at=iso(session.updated_ms),
        display_name=session.display_name,
        clients=sorted(session.clients),
        prompts=[prompt.command for prompt in waiting],
        turn_error=session.turn_error.status_view() if session.turn_error is not None else None,
        turn_error_event=session.turn_error_event,
        history=session.has_history,
    )


def go_on_from(session: LiveSession, carry: Carry) -> None:
    """A resumed session goes on from its carried state (`carry_of` on the old owner for a
    move; the catalog row's times and title for a load): on a move also its clients, queued
    prompts and turn error."""
    session.resumed = True
    session.created_ms = from_iso(carry.created_at)
    session.updated_ms = from_iso(carry.updated_at)
    session.display_name = carry.display_name
    session.clients.update(carry.clients)
    session.has_history = carry.history
    if carry.turn_error is not None:
        view = carry.turn_error
        session.turn_error = TurnError(view.get("message", ""), view.get("code"), view.get("errorKind"))
        session.turn_error_event = carry.turn_error_event


async def leave_stranded(store: WorkerStore, incarnation: str) -> None:
    """A stranded worker's leave: its sessions stay indexed for the sweeper, so the lease is
    not released but resigned, if the store answers at once; else it lapses."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(store.resign(incarnation), RESIGN_S)


class Drain:
    """One drain of one worker: its moves share the targets' view, spread over them. Given
    the worker's store, its sessions (it moves those there now, and those creates under way
    add), its own incarnation (`own()`: never a target), and the agent a session that names
    none runs."""

    def __init__(
        self,
        *,
        store: WorkerStore,
        sessions: Mapping[str, LiveSession],
        own: Callable[[], str],
        default_agent: str,
        grace_s: float,
        check_standing: Callable[[], Awaitable[None]],
        eager: bool = True,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.own = own
        self.default_agent = default_agent
        self.check_standing = check_standing  # a renewal of the lease: is the store there?
        self.eager = eager  # the deployment's hand-off (its targets load after taking over)
        self.loop = asyncio.get_running_loop()
        # The grace bounds the turns and the wait for a target; a move that found one may
        # go on to other targets for one more hand-off's time after it.
        self.deadline = self.loop.time() + grace_s
        self.last_try = self.deadline + MOVE_WAIT_S
        self.registry = WorkerRegistry(store)
        self.assigned: Counter[str] = Counter()  # moves sent to each target by this drain
        self.slots: dict[str, asyncio.Semaphore] = {}
        self._reports: list[WorkerReport] = []
        self._read_at = float("-inf")
        # Our inbox's `moving` marker of each held session was read: every command sent to
        # it before its MOVE is in hand (the worker hands each marker to `marker_read`).
        self._markers: dict[str, asyncio.Event] = {}
        self.warmed: dict[tuple[str, str], set[str]] = {}  # (agent, workspace) -> the targets told to start it

    def marker_read(self, sid: str) -> None:
        marker = self._markers.get(sid)
        if marker is not None:
            marker.set()

    async def run(self) -> str | None:
        """Move every session (see module); what stranded the drain (the store's silence,
        named), or None."""
        grace_s = max(0.0, self.deadline - self.loop.time())
        log.info("draining %d sessions (grace %.1f s)", len(self.sessions), grace_s)
        handled: set[str] = set()
        moved = 0
        stranded = None
        # Creates already under way when the drain began still add sessions: they move too.
        while sessions := [s for s in self.sessions.values() if s.sid not in handled]:
            handled.update(s.sid for s in sessions)
            for session in sessions:
                session.hold()
                self._markers[session.sid] = asyncio.Event()
            with contextlib.suppress(Exception):  # (only a head start: the moves go on without)
                await self._warm(sessions)
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
        left = [s for s in self.sessions.values() if not s.closed]
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
                await asyncio.wait_for(asyncio.shield(self.check_standing()), left)
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
            if not await self.store.mark_moving(session.ws, session.sid, session.incarnation, target):
                # Not ours any more: a target we gave up on took it over, or it ended (its
                # new owner died and was swept). Either way nothing of it is ours to write.
                await session.hand_over()
                return False
            if not session.moving:
                session.moving = True  # the worker's rewrites leave it to us from now on
                try:
                    await asyncio.wait_for(self._markers[session.sid].wait(), MOVE_WAIT_S)
                except asyncio.TimeoutError:  # the store lost it (restarted empty): closed instead
                    log.warning("the move's marker never came back", extra={"sessionId": session.sid})
                    return False
            await session.written()
            async with self.slots.setdefault(target, asyncio.Semaphore(self._handoffs_per_target)):
                owner = await self._hand_to(session, target)
            if owner == target:
                await session.hand_over()
                with contextlib.suppress(Exception):  # else the target waits for our lease to lapse
                    await self.store.send_control(target, commands.Released(sid=session.sid, owner=session.incarnation))
                log.info("session moved to %s", target, extra={"sessionId": session.sid})
                return True
            if owner != session.incarnation:  # it ended meanwhile (swept): forget it, write nothing
                await session.hand_over()
                return False
            log.warning("moving the session to %s failed", target, extra={"sessionId": session.sid})
        return False

    @property
    def _handoffs_per_target(self) -> int:
        return EAGER_HANDOFFS_PER_TARGET if self.eager else HANDOFFS_PER_TARGET

    async def _warm(self, sessions: list[LiveSession]) -> None:
        """Tell the targets of each agent and workspace to start that child now (`Warm`):
        as many as it has sessions to move, at most every target, least loaded first (a
        workspace's sessions spread over them; one left cold would hold its share of the
        moves for a cold start)."""
        await self._read_reports()
        coming: Counter[tuple[str, str]] = Counter()
        named: dict[tuple[str, str], LiveSession] = {}
        for session in sessions:
            key = (session.agent_name or self.default_agent, session.cwd)
            if key not in self.warmed and not session.closed:
                coming[key] += 1
                named.setdefault(key, session)
        spread: Counter[str] = Counter()
        for key, count in coming.most_common():
            session = named[key]
            fitting = [r for r in self._reports if accepts(r, key[0], session.state_store)]
            targets = ranked(fitting, spread, lambda r, key=key: runs_child(r, *key))[:count]
            self.warmed[key] = {target.incarnation for target in targets}
            for target in targets:
                spread[target.incarnation] += -(-count // len(targets))  # (its share, rounded up)
                if not runs_child(target, *key):
                    await self.store.send_control(target.incarnation, commands.Warm(cwd=session.cwd, agent=session.agent_name))

    async def _read_reports(self) -> None:
        now = self.loop.time()
        if now - self._read_at >= REPORTS_FRESH_S:
            self._read_at = now
            live = [inc for inc in await self.registry.live() if inc != self.own()]
            self._reports = list((await self.store.worker_reports(live)).values())

    async def _target(self, session: LiveSession, tried: set[str]) -> str | None:
        """The live worker that can resume the session and has the most room, counting the
        moves this drain already sent it (one told to start the session's agent child, or
        that runs it, first while it is not much fuller: `acp_state.placement`); not us,
        and none tried."""
        await self._read_reports()
        agent = session.agent_name or self.default_agent
        fitting = [r for r in self._reports if r.incarnation not in tried and accepts(r, agent, session.state_store)]
        if not fitting:
            return None
        def warm(report: WorkerReport) -> bool:
            # Its report says the child runs (started: one told to warm says so at its next
            # renewal, once the child answered `initialize`, and is preferred from then on).
            return runs_child(report, agent, session.cwd)

        chosen = ranked(fitting, self.assigned, warm)[0].incarnation
        self.assigned[chosen] += 1  # counted at once: concurrent moves spread
        return chosen

    async def _hand_to(self, session: LiveSession, target: str) -> str | None:
        """Send `target` the create that loads the session; who holds it now (None: no one)."""
        request_id = ids.new_id()
        create = commands.Create(
            ws=session.ws, sid=session.sid, cwd=session.cwd, request_id=request_id, agent=session.agent_name,
            scope="single" if session.single else "thread",
            # A session whose agent was never sent a prompt has nothing to load: the target
            # starts a new agent session for it.
            load=session.has_history, agent_sid=session.agent_sid, move_from=session.incarnation,
            carry=carry_of(session).pack(), source_type=session.source[0], source_id=session.source[1],
        )
        await self.store.send_control(target, create)
        reply = await self.store.await_reply(
            request_id, MOVE_WAIT_S, alive=lambda: self.registry.is_live(target)
        )
        if reply is not None and reply.ok:
            return target
        # No answer (a late one would find the request abandoned): the store says who holds it.
        view = await self.store.session(session.ws, session.sid)
        return view.owner if view is not None else None


async def take_over(
    session: LiveSession,
    command: commands.Create,
    carry: Carry | None,
    indexed: bool,
    *,
    store: WorkerStore,
    dispatch: Callable[[commands.Command], None],
) -> bool:
    """Take over a session a draining worker moves here (`command.move_from` named us its
    target), then run what waited for the move: the carried prompts, the parked commands
    (handed to `dispatch`, in the order they were sent, as from an inbox), those sent here
    since. `indexed`: the sweeper's index holds the session. Whether it is ours now."""
    result = await session.publish_moved(command.move_from or "") if indexed else None
    if result is None or result.applied != ApplyOutcome.APPLIED:
        # The mover named another target, or the session ended: it is not ours.
        await session.close("conflict", publish=False)
        with contextlib.suppress(Exception):
            await store.reply(command.request_id, Reply(ok=False, code="session_conflict"))
        return False
    log.info("took the session over from %s", command.move_from, extra={"sessionId": session.sid})
    parked: list[commands.Command | commands.MalformedCommand] = []

    async def take_parked() -> None:
        parked[:] = await store.take_parked(session.ws, session.sid)

    await until_stored(take_parked)
    since = session.arrive([Prompt.of(p) for p in carry.prompts] if carry else [])
    for parked_command in parked:
        if isinstance(parked_command, commands.MalformedCommand):
            log.error("dropping a parked command that could not be handled: %s", parked_command)
        else:
            dispatch(parked_command)
    for prompt in since:
        session.enqueue(prompt)
    answer = Reply(ok=True, created_at=iso(session.created_ms), incarnation=session.incarnation)
    with contextlib.suppress(Exception):  # the mover reads the owner from the store if this is lost
        await store.reply(command.request_id, answer)
    return True


async def until_let_go(bring_up: BringUp, previous: str, store: WorkerStore) -> None:
    """Until the old owner let go of the agent's session: its `Released` came, or its lease
    no longer runs (it exited, or was declared dead: its self-fence stopped its agents
    first). A store that is away meanwhile only delays the answer."""
    registry = WorkerRegistry(store)
    while not bring_up.released.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(bring_up.released.wait(), RELEASE_CHECK_S)
        if bring_up.released.is_set():
            return
        with contextlib.suppress(Exception):
            if not await registry.is_live(previous):
                return
