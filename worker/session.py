"""One live session on a bridge worker: the per-session turn state machine (spec §3).

Every transition is written to the store as one atomic step (state + events together).
The in-memory state here is the truth; Redis holds its projection, which the worker can
rewrite whole (`snapshot`) when Redis lost it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from acp_state import commands, events, ids, interactions
from acp_state.commands import CHANNEL, CRON, FOREGROUND, NOTIFICATION, cancelled_response
from acp_state.clock import from_iso, iso, now_ms
from acp_state.moves import Carry
from acp_state.store import (
    Applied,
    ApplyOutcome,
    CatalogRow,
    EndAdmitted,
    Mode,
    PendingInteraction,
    Transition,
    WorkerStore,
    is_transient,
)
from acp_state.turn_errors import LOOP_DETECTED_MESSAGE, TurnError, from_exception
from acp_state.turns import TEXT_MAX_CHARS, TurnRecord

from .loop_guard import LoopGuard, LoopLimits, skipped_update
from .metrics import EVENTS, TRANSITIONS, TURN_ERRORS, WRITES_DROPPED

if TYPE_CHECKING:
    from .agent import AgentProcess

log = logging.getLogger("worker.session")

DISPLAY_NAME_MAX = 256
# A transition the store cannot take yet is retried, from RETRY_FIRST_S doubling up to
# RETRY_MAX_S, for WRITE_PATIENCE_S (a worker shutting down waits less).
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
WRITE_PATIENCE_S = 120.0
TERMINALS = ("turn_complete", "turn_error")
# How long a drain waits for the agent to answer a turn it cancelled (see stop_turn).
CANCEL_ANSWER_S = 5.0

# Automatic turns wait in their own queues and run before the next queued foreground prompt.
AUTOMATIC_KINDS = (CRON, NOTIFICATION)
# Only an interactive user prompt is rejected by loop protection and clears a turn error.
INTERACTIVE_KINDS = (FOREGROUND,)


@dataclass
class Prompt:
    """One admitted prompt here: the command that brought it, as the API sent it (carried as
    is when the session moves), and its turn's state. `ended` is the terminal latch (exactly
    one terminal event)."""

    command: commands.Prompt
    queued: bool = False  # waited behind another prompt (gets pending_prompt_started)
    started: bool = False
    sent: bool = False  # session/prompt went to the agent
    cancel_requested: bool = False
    ended: bool = False
    result: list[str] = field(default_factory=list)  # the agent's message text of this turn
    result_chars: int = 0
    turn: TurnRecord = field(init=False)

    def __post_init__(self) -> None:
        self.turn = TurnRecord.queued(self.prompt_id, self.text, self.queued_at, self.client_id)

    @classmethod
    def of(cls, command: commands.Prompt) -> Prompt:
        """The prompt a command admitted (read from an inbox, parked, or carried). One sent
        without its admission time (`queuedAt` 0: not by an API) is stamped on arrival."""
        if not command.queued_at:
            command = dataclasses.replace(command, queued_at=now_ms())
        return cls(command)

    @property
    def prompt_id(self) -> str:
        return self.command.prompt_id

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return self.command.blocks

    @property
    def text(self) -> str:
        return self.command.text

    @property
    def meta(self) -> dict[str, Any] | None:
        return self.command.meta

    @property
    def client_id(self) -> str | None:
        return self.command.client_id

    @property
    def kind(self) -> str:
        return self.command.kind

    @property
    def queued_at(self) -> int:
        return self.command.queued_at

    def add_result(self, text: str) -> None:
        """Keep the agent's text up to just past what a turn record holds."""
        if text and self.result_chars <= TEXT_MAX_CHARS:
            self.result.append(text)
            self.result_chars += len(text)

    def result_text(self) -> str:
        return "".join(self.result)


@dataclass
class Pending:
    """A permission request the agent awaits."""

    interaction: dict[str, Any]
    allowed: list[str]
    order: int
    prompt_id: str | None
    answer: asyncio.Future[commands.Vote | None]  # the vote that won it; None: cancelled here


class LiveSession:
    # Slots, not a per-instance dict: a worker holds tens of thousands of idle sessions.
    __slots__ = ("store", "incarnation", "ws", "sid", "cwd", "agent", "agent_sid", "single",
        "_on_gone", "_on_fenced", "_published", "_publishing", "untold_request", "_in_order",
        "_op", "_unwritten", "abandoned", "write_patience_s", "created_ms", "updated_ms",
        "display_name", "clients", "loop_limits", "_on_state", "state", "active", "queue",
        "automatic", "pending", "turn_error", "turn_error_event", "closed", "_order", "_runner",
        "_guard", "_loop_stop", "agent_name", "state_store", "resumable", "resumed", "holding",
        "moving", "arriving", "has_history", "_marker_read", "_idle")

    def __init__(
        self,
        *,
        store: WorkerStore,
        incarnation: str,
        ws: str,
        sid: str,
        cwd: str,
        agent: AgentProcess,
        agent_sid: str,
        single: bool,
        on_gone: Callable[[LiveSession], Awaitable[None]],
        on_fenced: Callable[[LiveSession, ApplyOutcome], Awaitable[None]] | None = None,
        loop_limits: LoopLimits | None = None,
        on_state: Callable[[str | None, str | None], None] | None = None,
    ) -> None:
        self.store = store
        self.incarnation = incarnation
        self.ws = ws
        self.sid = sid
        self.cwd = cwd
        self.agent = agent
        self.agent_sid = agent_sid
        self.single = single
        self._on_gone = on_gone
        self._on_fenced = on_fenced
        # Set once the first snapshot was written (or the session gave up): an update the
        # agent sends right after `session/new` must not reach the store before the
        # session itself, or the fence refuses it.
        self._published = False
        self._publishing: asyncio.Future[None] | None = None  # made only if a write waits for it
        # The create's request id while no API is known to have taken its answer: kept in
        # the store, so that a sweep after this worker's death leaves no catalog row of a
        # session nobody was told of.
        self.untold_request: str | None = None
        self._in_order = asyncio.Lock()  # FIFO: transitions reach the store in order
        self._op = 0  # running number of this session's transitions
        self._unwritten: list[str] = []  # terminals a fenced write carried, for the rewrite
        self.abandoned = False
        self.write_patience_s = WRITE_PATIENCE_S
        self.created_ms = now_ms()
        self.updated_ms = self.created_ms
        self.display_name: str | None = None
        self.clients: set[str] = set()
        self.loop_limits = loop_limits or LoopLimits()
        self._on_state = on_state
        self.state: str | None = None  # None until published, and again once gone
        self.active: Prompt | None = None
        # Lists, not deques, and the automatic ones made on first use: a queue holds at most
        # a few prompts (the admission limit), and an idle session should cost little.
        self.queue: list[Prompt] = []  # foreground, channel and goal prompts
        self.automatic: dict[str, list[Prompt]] = {}
        self.pending: dict[str, Pending] = {}
        self.turn_error: TurnError | None = None
        self.turn_error_event: bool = False
        self.closed = False
        self._order = itertools.count()
        self._runner: asyncio.Task[None] | None = None
        # Per-turn state, reset when a prompt starts.
        self._guard = LoopGuard(self.loop_limits)
        self._loop_stop: TurnError | None = None
        # Where a resume of the session must be placed (its catalog row says so).
        self.agent_name: str | None = None
        self.state_store: str | None = None
        self.resumable: bool | None = None
        self.resumed = False  # loaded from the agent's history (its row existed before)
        self.has_history = False  # the agent was sent a prompt of it: it has something to load
        # A drain holds the session: no new turn starts here; what is admitted waits, queued,
        # and moves with it.
        self.holding = False
        # Marked moving in the store (MOVE): another worker may own it now, so only the drain
        # decides what becomes of it; the worker never rewrites it.
        self.moving = False
        # Moving here: prompts that arrive before the carried and parked ones are placed wait.
        self.arriving: list[Prompt] | None = None
        self._marker_read: asyncio.Event | None = None  # our inbox's `moving` marker was read
        self._idle: asyncio.Event | None = None  # made while a drain waits for the turn to end

    def _mark_published(self) -> None:
        self._published = True
        if self._publishing is not None and not self._publishing.done():
            self._publishing.set_result(None)

    @property
    def published(self) -> bool:
        """The session's first snapshot has been written (or it gave up)."""
        return self._published

    # ---- projection ---------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "sessionId": self.sid,
            "workspaceCwd": self.cwd,
            "createdAt": iso(self.created_ms),
        }
        if self.display_name:
            meta["displayName"] = self.display_name
        return meta

    def catalog_row(self) -> CatalogRow:
        """The durable row; its session id is the catalog field and its cwd the workspace's.
        It also says where a later load can resume the session (see acp_state.moves)."""
        return CatalogRow(
            iso(self.created_ms), iso(self.updated_ms), self.updated_ms, self.display_name or None,
            agent=self.agent_name, state_store=self.state_store, agent_sid=self.agent_sid, resumable=self.resumable,
        )

    # ---- resumes and moves ----------------------------------------------------------------

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

    def snapshot(self, reason_event: str | None = None) -> Transition:
        """The whole state as one CREATE transition (first publish, or rewrite after loss)."""
        admitted = ([self.active] if self.active else []) + self._waiting()
        transition = Transition(
            mode=Mode.CREATE,
            meta=self._meta(),
            epoch=ids.new_id(),  # a UUID, as the reference's epochs
            updated_at=iso(self.updated_ms) if self.updated_ms != self.created_ms else None,
            active=True if self.active else None,
            admitted=len(admitted),
            prompts_admitted=[prompt.prompt_id for prompt in admitted],
            clients=list(self.clients),
            turn_error=self.turn_error.status_view() if self.turn_error is not None else None,
            interactions_added=[self._projected(rid, pending) for rid, pending in self.pending.items()],
            catalog=self.catalog_row(),
            single=self.single,
            untold_request=self.untold_request,
            turns=[prompt.turn for prompt in admitted],  # their records may be lost too
            resumed=self.resumed,
        )
        if reason_event:
            # A rewrite also carries the terminals the store lost with the rest: every
            # acknowledged prompt still gets its one terminal.
            transition.events = [events.body(reason_event, {"sessionId": self.sid}), *self._unwritten]
            transition.restore = True  # the heartbeat and a refused write may both ask
            self._unwritten = []
        return transition

    @staticmethod
    def _projected(rid: str, pending: Pending) -> PendingInteraction:
        return PendingInteraction(rid, pending.interaction, pending.order, pending.allowed)

    def current_state(self) -> str:
        """This session's state in SESSION_STATES, from memory (the summary's rules)."""
        kinds = [p.interaction["kind"] for p in self.pending.values()]
        if any(kind != interactions.USER_QUESTION for kind in kinds):
            return "waiting_permission"
        if kinds:
            return "waiting_question"
        if self.active is not None:
            return "running"
        return "failed" if self.turn_error is not None else "idle"

    def _track_state(self) -> None:
        """Keep the worker's per-state counts exact, one session at a time (no scans)."""
        new = None if self.closed else self.current_state()
        if new != self.state:
            if self._on_state is not None:
                self._on_state(self.state, new)
            self.state = new

    async def _write(self, transition: Transition | Callable[[], Transition]) -> Applied | None:
        """Apply one transition, in order, until the store has it.

        The state here is the truth and the store its projection, so a transition the store
        could not take (unreachable, stalled, out of memory) is retried, in order (one at a
        time per session), under a running number that makes a retry of one that did apply
        a no-op. A fenced write (the store has no such session of ours) is reported to the
        worker, which asks the registry whether we were declared dead or the store lost it;
        the terminals it carried are then written again with the session. `transition` may
        be a function, called in turn: a snapshot must see what the writes before it did."""
        if not callable(transition) and transition.mode not in (Mode.CREATE, Mode.TAKEOVER) and not self._published:
            if self._publishing is None:
                self._publishing = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._publishing)
        async with self._in_order:
            if callable(transition):
                transition = transition()
            if self.closed and transition.mode is not Mode.DELETE:
                return None
            TRANSITIONS.inc()
            for body in transition.events:
                EVENTS.labels(events.event_type(body)).inc()
            self._op += 1
            transition = dataclasses.replace(transition, op=self._op)
            try:
                result = await self._apply_until_taken(transition)
            finally:
                self._track_state()
            if result is not None and result.applied not in (ApplyOutcome.APPLIED, ApplyOutcome.PRESENT):
                self._unwritten += [body for body in transition.events if events.event_type(body) in TERMINALS]
                # (A refused takeover is the mover's to handle: the session is not ours.)
                if not self.closed and self._on_fenced is not None and transition.mode is not Mode.TAKEOVER:
                    log.warning("the store refused a write (%d); checking our lease", result.applied, extra={"sessionId": self.sid})
                    asyncio.ensure_future(self._on_fenced(self, result.applied))
        return result

    async def _apply_until_taken(self, transition: Transition) -> Applied | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.write_patience_s
        pause = RETRY_FIRST_S
        while True:
            try:
                return await self.store.apply(self.ws, self.sid, self.incarnation, transition)
            except Exception as error:
                # Retried whatever the error: the running number makes a retry of a write
                # that did apply a no-op, and redis-py can fail oddly on a connection torn
                # mid-reply. An error that is not the store's being away is logged in full.
                if self.abandoned or loop.time() + pause > deadline:
                    WRITES_DROPPED.inc()
                    log.error("a transition could not be written; dropped (%r)", error, extra={"sessionId": self.sid})
                    return None
                log.warning(
                    "a transition could not be written yet (%r); retrying", error,
                    exc_info=not is_transient(error), extra={"sessionId": self.sid},
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def mark_told(self) -> None:
        """The create's answer was taken. Its API says so in the store itself; this makes it
        so even if that API could not (the session would stay out of listings)."""
        await self._write(Transition(told=True))

    async def publish_created(self, client_id: str | None) -> Applied | None:
        if client_id:
            self.clients.add(client_id)
        # No event: an idle session then costs no replay log (a stream's first node alone
        # takes ~4 KB of Redis memory); the log starts with the session's first event.
        try:
            return await self._write(self.snapshot)
        finally:
            self._mark_published()

    async def republish(self) -> None:
        """Redis lost our state (restart, failover): write it again under a new epoch."""
        if self.closed:
            return
        await self._write(lambda: self.snapshot("session_restored"))
        for rid in list(self.pending):
            await self._locate_request(rid, True)

    # ---- prompts ------------------------------------------------------------------------

    def _waiting(self) -> list[Prompt]:
        return [*self.queue, *(p for kind in AUTOMATIC_KINDS for p in self.automatic.get(kind, ()))]

    def enqueue(self, prompt: Prompt) -> None:
        """Accept an admitted prompt: start it now or queue it behind the running one (or,
        held by a drain, queue it to move with the session)."""
        if self.closed:
            return
        if self.arriving is not None:
            self.arriving.append(prompt)
            return
        transition = Transition()
        if self.display_name is None and prompt.kind == FOREGROUND and prompt.text.strip():
            self.display_name = prompt.text.strip()[:DISPLAY_NAME_MAX]
            transition.meta = self._meta()
            transition.catalog = self.catalog_row()
        if self.active is not None or self._waiting() or self.holding:
            prompt.queued = True
            data = {"sessionId": self.sid, "promptId": prompt.prompt_id, "text": prompt.text, "queuedAt": prompt.queued_at}
            transition.events.append(events.body("pending_prompt_added", data, prompt.prompt_id, prompt.client_id))
            (self.automatic.setdefault(prompt.kind, []) if prompt.kind in AUTOMATIC_KINDS else self.queue).append(prompt)
        else:
            self.active = prompt  # reserved now, so a cancel right behind it finds it
        if transition.events or transition.meta is not None:
            asyncio.ensure_future(self._write(transition))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())

    def _next(self) -> Prompt | None:
        """Automatic work drains first: a rejected turn never strands queued cron or
        notification prompts."""
        for kind in AUTOMATIC_KINDS:
            if self.automatic.get(kind):
                return self.automatic[kind].pop(0)
        return self.queue.pop(0) if self.queue else None

    async def _run(self) -> None:
        while not self.closed:
            reserved = self.active is not None and not self.active.started
            prompt = self.active if reserved else None if self.holding else self._next()
            if prompt is None:
                return
            await self._start(prompt)
            if prompt.cancel_requested:  # cancelled before it reached the agent
                await self._complete(prompt, "cancelled")
                continue
            prompt.sent = True
            self.has_history = True
            try:
                response = await self.agent.prompt(self.agent_sid, prompt.blocks, prompt.meta)
            except ConnectionError:
                return  # the child died; AgentProcess ends every prompt with channel_closed
            except Exception as error:  # the agent answered with a JSON-RPC error
                await self._end_with_error(prompt, from_exception(error))
            else:
                await self._end_with_stop(prompt, getattr(response, "stop_reason", None) or "end_turn")

    async def _start(self, prompt: Prompt) -> None:
        """The prompt actually starts. Any start supersedes the kept turn-error event; only an
        interactive prompt's start clears the stored turnError (the one place it is cleared)."""
        self.active = prompt
        prompt.started = True
        self._guard = LoopGuard(self.loop_limits)
        self._loop_stop = None
        self.turn_error_event = False
        prompt.turn = prompt.turn.started(now_ms())
        transition = Transition(active=True, clear_turn_error_event=True, turns=[prompt.turn])
        if prompt.kind in INTERACTIVE_KINDS or prompt.kind == CHANNEL:
            self.turn_error = None
            transition.clear_turn_error = True
        if prompt.queued:
            data = {"sessionId": self.sid, "promptId": prompt.prompt_id, "text": prompt.text}
            transition.events.append(events.body("pending_prompt_started", data, prompt.prompt_id, prompt.client_id))
        for block in prompt.blocks:
            update = {"sessionUpdate": "user_message_chunk", "content": block}
            transition.events.append(
                events.body("session_update", {"sessionId": self.sid, "update": update}, prompt.prompt_id, prompt.client_id)
            )
        await self._write(transition)

    async def _end_with_stop(self, prompt: Prompt, stop_reason: str) -> None:
        """The agent answered a stop reason. A user's cancel wins over a loop stop; a loop
        stop rejects an interactive prompt and ends any other turn `end_turn`."""
        if prompt.cancel_requested:
            await self._complete(prompt, "cancelled")
        elif self._loop_stop is not None and prompt.kind in INTERACTIVE_KINDS:
            await self._fail(prompt, self._loop_stop)
        elif self._loop_stop is not None:
            await self._complete(prompt, "end_turn")
        else:
            await self._complete(prompt, stop_reason)

    async def _end_with_error(self, prompt: Prompt, error: TurnError) -> None:
        """The agent answered an error: its own structured loop error wins over our guard;
        non-interactive turns end `end_turn` on loop detection, as the reference's do."""
        if prompt.cancel_requested:
            await self._complete(prompt, "cancelled")
        elif error.error_kind == "loop_detected" and prompt.kind not in INTERACTIVE_KINDS:
            await self._complete(prompt, "end_turn")
        else:
            await self._fail(prompt, error)

    def _terminal(self, prompt: Prompt) -> Transition:
        """Common part of a running prompt's terminal transition."""
        prompt.ended = True
        if self.active is prompt:
            self.active = None
            asyncio.get_running_loop().call_soon(self._went_idle)  # once its terminal's write is queued
        self.updated_ms = now_ms()
        return Transition(
            active=False,
            updated_at=iso(self.updated_ms),
            prompts_ended=[prompt.prompt_id],
            admitted_change=-1,
            catalog=self.catalog_row(),
        )

    async def _complete(self, prompt: Prompt, stop_reason: str) -> None:
        if prompt.ended:
            return
        transition = self._terminal(prompt)
        prompt.turn = prompt.turn.finished(now_ms(), stop_reason, prompt.result_text())
        transition.turns.append(prompt.turn)
        data = {"sessionId": self.sid, "stopReason": stop_reason, "promptId": prompt.prompt_id}
        transition.events.append(events.body("turn_complete", data, prompt.prompt_id))
        await self._write(transition)

    async def _fail(self, prompt: Prompt, error: TurnError) -> None:
        """A running prompt failed: publish `turn_error` and keep it as the status error."""
        if prompt.ended:
            return
        transition = self._terminal(prompt)
        prompt.turn = prompt.turn.failed(now_ms(), error.message, error.code)
        transition.turns.append(prompt.turn)
        if error.structured:
            # A structured rejection cancels pending interactions first, without prompt_cancelled.
            transition.interactions_removed += self._resolve_all_pending(transition.events)
        self.turn_error = error
        self.turn_error_event = True
        TURN_ERRORS.labels(error.error_kind or "none").inc()
        transition.turn_error = error.status_view()
        transition.events.append(events.body("turn_error", error.event_data(self.sid, prompt.prompt_id), prompt.prompt_id))
        transition.keep_turn_error_event = len(transition.events)
        await self._write(transition)

    async def _stop_looping_turn(self, loop_type: str) -> None:
        """The guard tripped: cancel the turn at the agent, fail its unfinished tool calls.
        The terminal follows when the agent answers (see _end_with_stop)."""
        self._loop_stop = TurnError(
            LOOP_DETECTED_MESSAGE, "LOOP_DETECTED", "loop_detected", loop_type, structured=True
        )
        prompt_id = self.active.prompt_id if self.active else None
        log.warning("loop protection stopped the turn (%s)", loop_type, extra={"sessionId": self.sid, "promptId": prompt_id})
        await self.agent.cancel(self.agent_sid)
        skipped = [
            events.body("session_update", {"sessionId": self.sid, "update": skipped_update(call_id)}, prompt_id)
            for call_id in self._guard.unfinished()
        ]
        if skipped:
            await self._write(Transition(events=skipped))

    def _end(self, code: str, message: str, last_event: str, reason: str) -> Transition:
        """The session's last transition (close, child exit): every prompt it admitted ends
        with a `turn_error` (those still running or queued here, and those admitted in the
        store that never reached us), pending requests resolve cancelled, then `last_event`."""
        event_list: list[str] = []
        ended: list[str] = []
        prompts = ([self.active] if self.active else []) + self._waiting()
        self.queue.clear()
        for queue in self.automatic.values():
            queue.clear()
        for prompt in prompts:
            if prompt.ended:
                continue
            prompt.ended = True
            ended.append(prompt.prompt_id)
            data = {"sessionId": self.sid, "message": message, "code": code, "promptId": prompt.prompt_id}
            event_list.append(events.body("turn_error", data, prompt.prompt_id))
        self.active = None
        resolved = self._resolve_all_pending(event_list)
        event_list.append(events.body(last_event, {"sessionId": self.sid, "reason": reason}))
        return Transition(
            mode=Mode.DELETE,
            prompts_ended=ended,
            interactions_removed=resolved,
            events=event_list,
            end_admitted=EndAdmitted(code, message),
            catalog=self.catalog_row(),
            # Still untold (no API took the create's answer) when it ends, however it ends (a
            # shutdown, the agent's exit): nobody was told of it, so it leaves no row.
            uncatalog_untold=True,
        )

    # ---- cancel, close, death -------------------------------------------------------------

    async def cancel(self) -> None:
        """Cancel the running prompt: pending requests resolve cancelled, the agent stops."""
        prompt = self.active
        if prompt is None or self.closed:
            return
        prompt.cancel_requested = True
        if not prompt.sent:
            return  # the runner ends it `cancelled` instead of sending it
        # ACP order: session/cancel first, then answer what the agent still awaits, so the
        # agent reads the cancel before the cancelled outcomes and ends `cancelled`.
        await self.agent.cancel(self.agent_sid)
        transition = Transition()
        transition.interactions_removed = self._resolve_all_pending(transition.events)
        if transition.events:
            await self._write(transition)

    async def close(self, reason: str = "closed", publish: bool = True, uncatalog: bool = False) -> None:
        """Close the session: terminals for its prompts, pending cancelled, keys deleted."""
        if self.closed:
            return
        transition = self._end("session_closed", "session closed before the prompt completed", "session_closed", reason)
        if uncatalog:  # nobody was told it existed: it leaves no row behind
            transition.catalog = None
            transition.uncatalog = True
        self.closed = True
        self._track_state()
        if publish:
            await self._write(transition)
        await self.agent.forget(self.agent_sid)
        await self._on_gone(self)

    async def die(self) -> None:
        """The agent child exited: prompts end with channel_closed, then `session_died`."""
        if self.closed:
            return
        transition = self._end("channel_closed", "agent channel exited before the prompt completed", "session_died", "channel_closed")
        self.closed = True
        self._track_state()
        await self._write(transition)
        await self._on_gone(self)

    async def abandon(self) -> None:
        """Our incarnation was declared dead: the store has ended this session already (its
        prompts got their terminals, its clients `session_died`). End it here as well,
        writing nothing: the running turn is cancelled at the agent, what the agent awaits
        is answered cancelled, and the agent forgets the session."""
        if self.closed:
            return
        self.closed = True
        self.abandoned = True
        self._mark_published()
        self._track_state()
        running = self.active
        for prompt in ([running] if running else []) + self._waiting():
            prompt.ended = True
        self.queue.clear()
        for queue in self.automatic.values():
            queue.clear()
        self.active = None
        for pending in list(self.pending.values()):
            if not pending.answer.done():
                pending.answer.set_result(None)
        self.pending.clear()
        try:
            if running is not None and running.sent:
                await self.agent.cancel(self.agent_sid)
            await self.agent.forget(self.agent_sid)
        except Exception:  # the child may be gone already; nothing is left to tell it
            log.warning("could not tell the agent", extra={"sessionId": self.sid}, exc_info=True)
        await self._on_gone(self)

    # ---- permission requests --------------------------------------------------------------

    def _resolve_all_pending(self, event_list: list[str]) -> list[str]:
        """Resolve every pending request `cancelled`; returns their request ids."""
        resolved: list[str] = []
        for rid, pending in list(self.pending.items()):
            if not pending.answer.done():
                pending.answer.set_result(None)
            outcome = cancelled_response()["outcome"]
            event_list.append(events.body("permission_resolved", {"requestId": rid, "outcome": outcome}, pending.prompt_id))
            resolved.append(rid)
            del self.pending[rid]
        return resolved

    async def _locate_request(self, rid: str, present: bool) -> None:
        """Index (or drop) a pending request for the legacy vote route. Best effort: a Redis
        hiccup here must not fail the agent's request; a lost index is rewritten with the
        session (republish), and a stale one expires."""
        try:
            await self.store.locate_request(rid, f"{self.ws}/{self.sid}" if present else None)
        except Exception:
            log.warning("could not %s request %s", "index" if present else "unindex", rid, extra={"sessionId": self.sid})

    def resolve_vote(self, vote: commands.Vote) -> None:
        """A vote won in Redis reached us: hand it to the waiting agent request."""
        pending = self.pending.get(vote.rid)
        if pending is not None and not pending.answer.done():
            pending.answer.set_result(vote)

    async def request_permission(self, tool_call: dict[str, Any], options: list[dict[str, Any]]) -> dict[str, Any]:
        """The agent asks: publish the request, register it, await the winning vote (spec §4.1)."""
        if self.closed:
            return cancelled_response()
        if len(self.pending) >= interactions.MAX_PENDING_PER_SESSION:
            log.warning("%d pending requests, refusing another", len(self.pending), extra={"sessionId": self.sid})
            return cancelled_response()
        mapped = interactions.map_options(options)
        interactions.check_sentinel(mapped)
        rid = ids.new_id()
        prompt_id = self.active.prompt_id if self.active else None
        interaction = interactions.normalize(rid, tool_call, options, iso())
        pending = Pending(
            interaction=interaction,
            allowed=interactions.allowed_option_ids(mapped),
            order=next(self._order),
            prompt_id=prompt_id,
            answer=asyncio.get_running_loop().create_future(),
        )
        self.pending[rid] = pending
        data = {"requestId": rid, "sessionId": self.sid, "toolCall": tool_call, "options": options}
        result = await self._write(
            Transition(
                interactions_added=[self._projected(rid, pending)],
                events=[events.body("permission_request", data, prompt_id)],
            )
        )
        if result is None or result.applied != ApplyOutcome.APPLIED:
            self.pending.pop(rid, None)
            return cancelled_response()
        await self._locate_request(rid, True)
        try:
            vote = await pending.answer
        finally:
            # The request's index stays until it expires: a vote repeated with the same
            # Idempotency-Key on the legacy route must still find the session.
            still_ours = self.pending.pop(rid, None) is not None
        response = vote.acp_response() if vote is not None else cancelled_response()
        voter = vote.client_id if vote is not None else None
        if still_ours:
            # Resolved by a vote: the vote script already removed the fields.
            data = {"requestId": rid, "outcome": response["outcome"]}
            if voter:
                data["voterClientId"] = voter
            await self._write(
                Transition(
                    interactions_removed=[rid],
                    events=[events.body("permission_resolved", data, prompt_id, voter)],
                )
            )
        return response

    # ---- agent updates ---------------------------------------------------------------------

    async def on_update(self, update: dict[str, Any]) -> None:
        """An ACP `session/update`: relayed as a `session_update` event, in arrival order.

        The loop guard sees every update of a running turn; newer turn content supersedes the
        kept turn-error event, so a reload no longer re-appends it.
        """
        prompt_id = self.active.prompt_id if self.active else None
        if self.active is not None:
            self.active.add_result(events.message_text(update))
        transition = Transition(events=[events.body("session_update", {"sessionId": self.sid, "update": update}, prompt_id)])
        if self.turn_error_event and events.is_turn_content(update):
            self.turn_error_event = False
            transition.clear_turn_error_event = True
        tripped = self._guard.observe(update) if self.active is not None and self._loop_stop is None else None
        await self._write(transition)
        if tripped and self.active is not None and not self.active.cancel_requested:
            await self._stop_looping_turn(tripped)
