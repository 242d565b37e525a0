"""One live session on a bridge worker: the per-session turn state machine (spec §3).

Every transition is written to the store as one atomic step (state + events together), in
order (`StoredSession`, worker/stored_session.py). The in-memory state here is the truth;
Redis holds its projection, which the worker can rewrite whole (`snapshot`) when Redis lost
it. What the agent asks the session's clients (permissions, questions) is its
`PermissionRequests` (worker/permissions.py), made when the agent first asks. An admitted
prompt is a `Prompt` (worker/prompt.py). A move to another worker (worker/move.py) holds the
session, ends its running turn, hands it over and, on the new owner, takes it over and runs
its carried prompts first: the steps of its own state are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from acp_state import commands, events, ids, interactions, tracing
from acp_state.commands import CHANNEL, FOREGROUND, Reply, cancelled_response
from acp_state.clock import iso, now_ms
from acp_state.store import Applied, ApplyOutcome, CatalogRow, EndAdmitted, Mode, Transition, WorkerStore
from acp_state.turn_errors import LOOP_DETECTED_MESSAGE, TurnError, from_exception

from .loop_guard import LoopGuard, LoopLimits, skipped_update
from .metrics import TURN_ERRORS
from .permissions import PermissionRequests
from .prompt import AUTOMATIC_KINDS, INTERACTIVE_KINDS, Prompt
from .stored_session import StoredSession

if TYPE_CHECKING:
    from .agent import AgentProcess
    from .bring_up import BringUp

log = logging.getLogger("worker.session")

DISPLAY_NAME_MAX = 256
# How long a drain waits for the agent to answer a turn it cancelled (see stop_turn).
CANCEL_ANSWER_S = 5.0


def advertised(update: dict[str, Any]) -> dict[str, Any]:
    """What an `available_commands_update` advertises, as `GET /session/:id/supported-commands`
    answers it: its commands, and the skills Qwen Code names in its `_meta`."""
    meta = update.get("_meta")
    skills = meta.get("availableSkills") if isinstance(meta, dict) else None
    return {"availableCommands": update["availableCommands"], "availableSkills": skills if isinstance(skills, list) else []}


class LiveSession(StoredSession):
    # Slots, not a per-instance dict: a worker holds tens of thousands of idle sessions.
    __slots__ = ("cwd", "agent", "agent_sid", "single", "_on_gone", "untold_request", "_sent",
        "created_ms", "updated_ms", "display_name", "clients", "available_commands", "usage", "loop_limits", "_on_state",
        "state", "active", "queue", "automatic", "turn_error", "turn_error_event", "_runner", "permissions",
        "_guard", "_loop_stop", "agent_name", "state_store", "resumable", "resumed", "holding",
        "source", "moving", "arriving", "has_history", "_idle", "bring_up")

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
        super().__init__(store=store, incarnation=incarnation, ws=ws, sid=sid, on_fenced=on_fenced)
        self.cwd = cwd
        self.agent = agent
        self.agent_sid = agent_sid
        self.single = single
        self._on_gone = on_gone
        # The create's request id while no API is known to have taken its answer: kept in
        # the store, so that a sweep after this worker's death leaves no catalog row of a
        # session nobody was told of.
        self.untold_request: str | None = None
        self._sent: Prompt | None = None  # the prompt the agent is answering, if any
        self.created_ms = now_ms()
        self.updated_ms = self.created_ms
        self.display_name: str | None = None
        self.clients: set[str] = set()
        self.available_commands: dict[str, Any] | None = None  # the agent's last advertised (advertised())
        self.usage: dict[str, Any] | None = None  # the agent's last usage_update {used, size, cost?}
        self.loop_limits = loop_limits or LoopLimits()
        self._on_state = on_state
        self.state: str | None = None  # None until published, and again once gone
        self.active: Prompt | None = None
        # Lists, the automatic ones made on first use: an idle session should cost little.
        self.queue: list[Prompt] = []  # foreground, channel and goal prompts
        self.automatic: dict[str, list[Prompt]] = {}
        self.turn_error: TurnError | None = None
        self.turn_error_event: bool = False
        self._runner: asyncio.Task[None] | None = None
        self.permissions: PermissionRequests | None = None  # made when the agent first asks
        # Per-turn state, reset when a prompt starts.
        self._guard = LoopGuard(self.loop_limits)
        self._loop_stop: TurnError | None = None
        # Where a resume of the session must be placed (its catalog row says so).
        self.agent_name: str | None = None
        self.state_store: str | None = None
        self.resumable: bool | None = None
        self.source: tuple[str | None, str | None] = (None, None)  # (sourceType, sourceId), kept in its row
        self.resumed = False  # loaded from the agent's history (its row existed before)
        self.has_history = False  # the agent was sent a prompt of it: it has something to load
        # A drain holds the session: no new turn starts here; what is admitted queues and moves.
        self.holding = False
        # Marked moving (MOVE): another worker may own it now; only the drain decides its fate.
        self.moving = False
        # Moving here: prompts that arrive before the carried and parked ones are placed wait.
        self.arriving: list[Prompt] | None = None
        self._idle: asyncio.Event | None = None  # made while a drain waits for the turn to end
        self.bring_up: BringUp | None = None  # the agent's session still to bring up (worker/bring_up.py)

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
            source_type=self.source[0], source_id=self.source[1],
        )

    def snapshot(self, reason_event: str | None = None) -> Transition:
        """The whole state as one CREATE transition (first publish, or rewrite after loss)."""
        admitted = ([self.active] if self.active else []) + self.waiting()
        transition = Transition(
            mode=Mode.CREATE,
            meta=self._meta(),
            epoch=ids.new_id(),  # a UUID, as the reference's epochs
            updated_at=iso(self.updated_ms) if self.updated_ms != self.created_ms else None,
            active=True if self.active else None,
            admitted=len(admitted),
            prompts_admitted=[prompt.prompt_id for prompt in admitted],
            clients=list(self.clients),
            available_commands=self.available_commands,
            approval_mode=self.agent.modes.get(self.agent_sid, (None, []))[0],
            agent_state=self.agent.reported.get(self.agent_sid, {}),
            usage=self.usage,
            turn_error=self.turn_error.status_view() if self.turn_error is not None else None,
            interactions_added=self.permissions.interactions() if self.permissions else [],
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

    def current_state(self) -> str:
        """This session's state in SESSION_STATES, from memory (the summary's rules)."""
        kinds = self.pending_kinds()
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

    _settled = _track_state  # after each write, too

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
        if self.permissions is not None:
            await self.permissions.locate_all()

    # ---- prompts ------------------------------------------------------------------------

    def waiting(self) -> list[Prompt]:
        """The prompts admitted here and not started yet, in the order they will run."""
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
        if self.active is not None or self.waiting() or self.holding:
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
        if self.bring_up is not None and not await self.bring_up.wait():
            return  # (a failed bring-up ends every prompt)
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
            self._sent = prompt
            try:
                # `_meta` names the incarnation that sends the turn (the scripted agent logs its
                # history writes with it: docs/chaos.md, invariant j), over any client's claim.
                meta = {**(prompt.meta or {}), "acpState.incarnation": self.incarnation}
                prompt.trace_turn = tracing.start_turn(prompt.trace_parent, self.sid, prompt.prompt_id, prompt.kind,
                                                       self.incarnation)
                meta.update(tracing.agent_meta(prompt.trace_turn))  # the agent goes on with the turn's trace
                response = await self.agent.prompt(self.agent_sid, prompt.blocks, meta)
            except ConnectionError:
                return  # the child died; AgentProcess ends every prompt with channel_closed
            except Exception as error:  # the agent answered with a JSON-RPC error
                await self._end_with_error(prompt, from_exception(error))
            else:
                await self._end_with_stop(prompt, getattr(response, "stop_reason", None) or "end_turn")
            finally:
                self._sent = None
                tracing.end_turn(prompt.trace_turn, prompt.turn)

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
            transition.interactions_removed += self._cancel_requests(transition.events)
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
        prompts = ([self.active] if self.active else []) + self.waiting()
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
        resolved = self._cancel_requests(event_list)
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
        transition.interactions_removed = self._cancel_requests(transition.events)
        if transition.events:
            await self._write(transition)

    async def set_mode(self, mode: str, client_id: str | None) -> Reply:
        """Switch the agent's session mode (ACP `session/set_mode`): `approval_mode_changed`
        and the status's `approvalMode`, as the reference's approval mode. A mode the agent
        does not offer is refused (`mode_not_offered`, with the modes it offers)."""
        if self.bring_up is not None:
            await self.bring_up.wait()
        current, offered = self.agent.modes.get(self.agent_sid, (None, []))
        if self.closed or mode not in offered:
            return Reply(ok=False, code="mode_not_offered", modes=offered)
        try:
            await self.agent.set_mode(self.agent_sid, mode)
        except Exception as error:  # the agent refused it
            return Reply(ok=False, code="mode_failed", error=str(error)[:500])
        previous = current or mode
        data = {"sessionId": self.sid, "previous": previous, "next": mode, "persisted": False}
        prompt_id = self.active.prompt_id if self.active else None
        await self._write(Transition(approval_mode=mode, agent_state=self.agent.reported.get(self.agent_sid, {}),
                                     events=[events.body("approval_mode_changed", data, prompt_id, client_id)]))
        return Reply(ok=True, previous=previous)

    async def remove_prompt(self, prompt_id: str) -> Reply:
        """Take an accepted prompt out (`DELETE /session/:id/pending-prompts/:promptId`): a
        queued one ends `cancelled` without running, the running one is cancelled as a
        cancel would; both announce `pending_prompt_completed` (`state: removed`), as the
        reference does. False when the prompt is not pending here (unknown, or ended)."""
        if self.closed:
            return Reply(ok=False)
        removed = {"sessionId": self.sid, "promptId": prompt_id, "state": "removed"}
        running = self.active
        if running is not None and running.prompt_id == prompt_id and not running.ended:
            await self._write(Transition(events=[events.body("pending_prompt_completed", removed, prompt_id,
                                                             running.client_id)]))
            await self.cancel()
            return Reply(ok=True)
        for queue in (self.queue, *self.automatic.values()):
            prompt = next((p for p in queue if p.prompt_id == prompt_id and not p.ended), None)
            if prompt is None:
                continue
            queue.remove(prompt)
            prompt.ended = True
            prompt.turn = prompt.turn.finished(now_ms(), "cancelled", "")
            done = {"sessionId": self.sid, "stopReason": "cancelled", "promptId": prompt_id}
            await self._write(Transition(
                prompts_ended=[prompt_id], admitted_change=-1, turns=[prompt.turn],
                events=[events.body("pending_prompt_completed", removed, prompt_id, prompt.client_id),
                        events.body("turn_complete", done, prompt_id)],
            ))
            return Reply(ok=True)
        return Reply(ok=False)

    async def close(self, reason: str = "closed", publish: bool = True, uncatalog: bool = False) -> None:
        """Close the session: terminals for its prompts, pending cancelled, keys deleted."""
        if self.bring_up is not None:
            await self.bring_up.settle()
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

    async def die(self, code: str = "channel_closed", message: str = "agent channel exited before the prompt completed",
                  reason: str = "channel_closed") -> None:
        """The agent child exited (or could not resume it): prompts end `code`, then `session_died`."""
        if self.closed:
            return
        transition = self._end(code, message, "session_died", reason)
        self.closed = True
        self._track_state()
        await self._write(transition)
        await self._on_gone(self)

    async def abandon(self) -> bool:
        """Our incarnation was declared dead: its sweeper ends this session in the store (its
        prompts' terminals, its clients' `session_died`), now or soon (it stays in the dead
        incarnation's index for it). End it here as well, writing nothing: the running turn is cancelled at the agent, what the agent awaits
        is answered cancelled, and the agent forgets the session. Whether the agent is rid
        of it (closed it, or is gone): if not, its owner stops the agent (AgentProcess.forget)."""
        if self.closed:
            return True
        self.closed = True
        self.abandoned = True
        self._mark_published()
        self._track_state()
        running = self.active
        for prompt in ([running] if running else []) + self.waiting():
            prompt.ended = True
        self.queue.clear()
        for queue in self.automatic.values():
            queue.clear()
        self.active = None
        if self.permissions is not None:
            self.permissions.drop()
        rid = False
        try:
            if running is not None and running.sent:
                await self.agent.cancel(self.agent_sid)
            rid = await self.agent.forget(self.agent_sid)
        except Exception:  # the child may be gone already; nothing is left to tell it
            log.warning("could not tell the agent", extra={"sessionId": self.sid}, exc_info=True)
        await self._on_gone(self)
        return rid

    # ---- the agent's requests ----------------------------------------------------------------

    def pending_kinds(self) -> list[str]:
        """The kind of each pending request (a permission, or a question for the user)."""
        return self.permissions.pending_kinds() if self.permissions is not None else []

    async def request_permission(self, tool_call: dict[str, Any], options: list[dict[str, Any]]) -> dict[str, Any]:
        """The agent asks the session's clients (worker/permissions.py)."""
        if self.closed:
            return cancelled_response()
        if self.permissions is None:
            self.permissions = PermissionRequests(store=self.store, ws=self.ws, sid=self.sid, write=self._write)
        active = self.active
        return await self.permissions.request(tool_call, options, active and active.prompt_id, active and active.trace_turn)

    def resolve_vote(self, vote: commands.Vote) -> None:
        """A vote won in Redis reached us: hand it to the waiting agent request."""
        if self.permissions is not None:
            self.permissions.resolve_vote(vote)

    def _cancel_requests(self, event_list: list[str]) -> list[str]:
        """Resolve every pending request `cancelled` (their events added to `event_list`)."""
        return self.permissions.cancel_all(event_list) if self.permissions is not None else []

    # ---- a move to another worker (worker/move.py) --------------------------------------------

    def hold(self) -> None:
        """A drain began: start no new turn here (what is admitted queues and moves)."""
        self.holding = True

    async def until_idle(self) -> None:
        """Until no turn runs (a held session starts none)."""
        while self.active is not None and not self.closed:
            self._idle = asyncio.Event()
            await self._idle.wait()

    def _went_idle(self) -> None:
        if self._idle is not None and self.active is None:
            self._idle.set()

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
        transition.interactions_removed = self._cancel_requests(transition.events)
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

    def _let_go(self) -> bool:
        """Forget the session here, writing nothing (False: it had ended already)."""
        if self.closed:
            return False
        self.closed = True
        self._mark_published()
        self._track_state()
        for prompt in self.waiting():
            prompt.ended = True  # they run on the new owner, or are lost with the worker
        self.queue.clear()
        self.automatic.clear()
        return True

    def strand(self) -> None:
        """No handing over, the store being away: forgotten here, left in the store and our
        index for the sweeper to end; a later load resumes it from the agent's history."""
        if self._let_go():
            self.abandoned = True  # a write still retrying gives up

    async def hand_over(self) -> None:
        """The session moved to another worker: forget it here, writing nothing (the new
        owner holds it now, and the agent child here lets go of it)."""
        if self.bring_up is not None:
            await self.bring_up.settle()
        if not self._let_go():
            return
        try:
            await self.agent.forget(self.agent_sid)
        except Exception:  # the child may be gone already
            log.warning("could not tell the agent", extra={"sessionId": self.sid}, exc_info=True)
        await self._on_gone(self)

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
        if self.waiting() and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._run())
        return since

    # ---- agent updates ---------------------------------------------------------------------

    async def on_update(self, update: dict[str, Any]) -> None:
        """An ACP `session/update`: relayed as a `session_update` event, in arrival order.
        The loop guard sees every update of a running turn; newer turn content supersedes the
        kept turn-error event, so a reload no longer re-appends it. A turn a drain already
        ended (`stop_turn`) is over for every client, its `turn_error` sent: what its agent
        still says of it before answering the cancel is dropped, or it would follow the error
        that explains the turn and supersede it."""
        stopped = self._sent is not None and self._sent.ended
        if stopped and events.is_turn_content(update):
            return
        prompt_id = self.active.prompt_id if self.active else None
        if self.active is not None:
            self.active.add_result(events.message_text(update))
        transition = Transition(events=[events.body("session_update", {"sessionId": self.sid, "update": update}, prompt_id)])
        if update.get("sessionUpdate") == "available_commands_update" and isinstance(update.get("availableCommands"), list):
            self.available_commands = transition.available_commands = advertised(update)
        if update.get("sessionUpdate") == "usage_update":  # how full the agent's context window is
            self.usage = transition.usage = {k: update[k] for k in ("used", "size", "cost") if k in update}
        if self.turn_error_event and events.is_turn_content(update):
            self.turn_error_event = False
            transition.clear_turn_error_event = True
        tripped = self._guard.observe(update) if self.active is not None and self._loop_stop is None else None
        await self._write(transition)
        if tripped and self.active is not None and not self.active.cancel_requested:
            await self._stop_looping_turn(tripped)
