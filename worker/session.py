"""One live session on a bridge worker: the per-session turn state machine (spec §3).

Every transition is written to the store as one atomic step (state + events together).
The in-memory state here is the truth; Redis holds its projection, which the worker can
rewrite whole (`snapshot`) when Redis lost it. Two parts of it live beside the jobs they
serve and are mixed in: what the agent asks the session's clients (permissions, questions:
`PermissionRequests`, worker/permissions.py) and its part in a move (`MovableSession`,
worker/drain.py). An admitted prompt is a `Prompt` (worker/prompt.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from acp_state import events, ids, interactions
from acp_state.commands import CHANNEL, FOREGROUND, Reply
from acp_state.clock import iso, now_ms
from acp_state.store import (
    Applied,
    ApplyOutcome,
    CatalogRow,
    EndAdmitted,
    Mode,
    Transition,
    WorkerStore,
    is_transient,
)
from acp_state.turn_errors import LOOP_DETECTED_MESSAGE, TurnError, from_exception

from .drain import MovableSession
from .loop_guard import LoopGuard, LoopLimits, skipped_update
from .metrics import EVENTS, TRANSITIONS, TURN_ERRORS, WRITES_DROPPED
from .permissions import PermissionRequests
from .prompt import AUTOMATIC_KINDS, INTERACTIVE_KINDS, Prompt

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


def advertised(update: dict[str, Any]) -> dict[str, Any]:
    """What an `available_commands_update` advertises, as `GET /session/:id/supported-commands`
    answers it: its commands, and the skills Qwen Code names in its `_meta`."""
    meta = update.get("_meta")
    skills = meta.get("availableSkills") if isinstance(meta, dict) else None
    return {"availableCommands": update["availableCommands"], "availableSkills": skills if isinstance(skills, list) else []}


class LiveSession(PermissionRequests, MovableSession):
    # Slots, not a per-instance dict: a worker holds tens of thousands of idle sessions.
    __slots__ = ("store", "incarnation", "ws", "sid", "cwd", "agent", "agent_sid", "single",
        "_on_gone", "_on_fenced", "_published", "_publishing", "untold_request", "_in_order",
        "_op", "_unwritten", "_sent", "abandoned", "write_patience_s", "created_ms", "updated_ms",
        "display_name", "clients", "available_commands", "usage", "loop_limits", "_on_state", "state", "active",
        "queue", "automatic", "turn_error", "turn_error_event", "closed", "_runner",
        "_guard", "_loop_stop", "agent_name", "state_store", "resumable", "resumed", "holding",
        "source",
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
        super().__init__()
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
        self._sent: Prompt | None = None  # the prompt the agent is answering, if any
        self.abandoned = False
        self.write_patience_s = WRITE_PATIENCE_S
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
        # Lists, not deques, and the automatic ones made on first use: a queue holds at most
        # a few prompts (the admission limit), and an idle session should cost little.
        self.queue: list[Prompt] = []  # foreground, channel and goal prompts
        self.automatic: dict[str, list[Prompt]] = {}
        self.turn_error: TurnError | None = None
        self.turn_error_event: bool = False
        self.closed = False
        self._runner: asyncio.Task[None] | None = None
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
            source_type=self.source[0], source_id=self.source[1],
        )

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
            available_commands=self.available_commands,
            approval_mode=self.agent.modes.get(self.agent_sid, (None, []))[0],
            agent_state=self.agent.reported.get(self.agent_sid, {}),
            usage=self.usage,
            turn_error=self.turn_error.status_view() if self.turn_error is not None else None,
            interactions_added=self._pending_interactions(),
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
        await self._locate_pending()

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
            self._sent = prompt
            try:
                # `_meta` names the incarnation that sends the turn (the scripted agent logs its
                # history writes with it: docs/chaos.md, invariant j), over any client's claim.
                meta = {**(prompt.meta or {}), "acpState.incarnation": self.incarnation}
                response = await self.agent.prompt(self.agent_sid, prompt.blocks, meta)
            except ConnectionError:
                return  # the child died; AgentProcess ends every prompt with channel_closed
            except Exception as error:  # the agent answered with a JSON-RPC error
                await self._end_with_error(prompt, from_exception(error))
            else:
                await self._end_with_stop(prompt, getattr(response, "stop_reason", None) or "end_turn")
            finally:
                self._sent = None

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

    async def set_mode(self, mode: str, client_id: str | None) -> Reply:
        """Switch the agent's session mode (ACP `session/set_mode`): `approval_mode_changed`
        and the status's `approvalMode`, as the reference's approval mode. A mode the agent
        does not offer is refused (`mode_not_offered`, with the modes it offers)."""
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
        for prompt in ([running] if running else []) + self._waiting():
            prompt.ended = True
        self.queue.clear()
        for queue in self.automatic.values():
            queue.clear()
        self.active = None
        self._drop_pending()
        rid = False
        try:
            if running is not None and running.sent:
                await self.agent.cancel(self.agent_sid)
            rid = await self.agent.forget(self.agent_sid)
        except Exception:  # the child may be gone already; nothing is left to tell it
            log.warning("could not tell the agent", extra={"sessionId": self.sid}, exc_info=True)
        await self._on_gone(self)
        return rid

    # ---- agent updates ---------------------------------------------------------------------

    async def on_update(self, update: dict[str, Any]) -> None:
        """An ACP `session/update`: relayed as a `session_update` event, in arrival order.

        The loop guard sees every update of a running turn; newer turn content supersedes the
        kept turn-error event, so a reload no longer re-appends it.

        A turn a drain already ended (drain.stop_turn) is over for every client, its
        `turn_error` sent: what its agent still says of it before answering the cancel is
        dropped, or it would follow the error that explains the turn and supersede it.
        """
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
