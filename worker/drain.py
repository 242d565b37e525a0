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

A target that fails or dies is replaced by another (MOVE again names the new one, whose
takeover alone can succeed). A turn still running when the grace runs out ends with a
`turn_error` (`worker_draining`), its pending requests cancelled. A session that finds no
target before the grace ends is closed, as a stop without a drain closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from acp_state import commands, ids
from acp_state.moves import accepts
from acp_state.registry import WorkerRegistry

if TYPE_CHECKING:
    from .session import LiveSession
    from .worker import Worker

log = logging.getLogger("worker.drain")

DRAINING = "worker_draining"
STOPPED_MESSAGE = "the worker was drained before the turn completed"
# A target's answer to a move: its agent loads the session (Qwen reads its chat file).
MOVE_WAIT_S = 60.0
# How often a session that found no target looks again while the grace lasts.
RETRY_S = 0.25


async def drain(worker: Worker, grace_s: float) -> None:
    """Move every session of `worker` to other workers within `grace_s` (see module)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    registry = WorkerRegistry(worker.store)
    log.info("draining %d sessions (grace %.1f s)", len(worker.sessions), grace_s)
    handled: set[str] = set()
    moved = 0
    # Creates already under way when the drain began still add sessions: they move too.
    while sessions := [s for s in worker.sessions.values() if s.sid not in handled]:
        handled.update(s.sid for s in sessions)
        for session in sessions:
            session.hold()
        results = await asyncio.gather(
            *(_move(worker, registry, session, deadline) for session in sessions), return_exceptions=True
        )
        moved += sum(1 for result in results if result is True)
        for session, result in zip(sessions, results, strict=True):
            if isinstance(result, BaseException):
                log.error("moving a session failed: %r", result, extra={"sessionId": session.sid})
    log.info("drained: %d of %d sessions moved", moved, len(handled))


async def _move(worker: Worker, registry: WorkerRegistry, session: LiveSession, deadline: float) -> bool:
    """Move one session; True once another worker holds it. A session that cannot move
    by the deadline is left to the shutdown, which closes it."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(session.until_idle(), max(0.0, deadline - loop.time()))
    if session.closed or session.resumable is False:
        return False  # (an agent that cannot load sessions cannot take it elsewhere: it closes)
    if session.active is not None:
        await session.stop_turn(DRAINING, STOPPED_MESSAGE)
    tried: set[str] = set()
    marked = False
    # The grace bounds the wait for a target; a hand-off under way may take its own time.
    while not session.closed:
        target = await _target(worker, registry, session, tried)
        if target is None:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(RETRY_S)
            tried.clear()  # a target that failed may serve again later
            continue
        tried.add(target)
        if not await worker.store.mark_moving(session.ws, session.sid, session.incarnation, target):
            return False  # not ours any more (we were declared dead meanwhile)
        if not marked:
            marked = True
            try:
                await asyncio.wait_for(session.wait_marker(), MOVE_WAIT_S)
            except asyncio.TimeoutError:  # the store lost it (restarted empty): closed instead
                log.warning("the move's marker never came back", extra={"sessionId": session.sid})
                return False
        await session.written()
        if await _hand_to(worker, registry, session, target):
            await session.hand_over()
            log.info("session moved to %s", target, extra={"sessionId": session.sid})
            return True
        log.warning("moving the session to %s failed", target, extra={"sessionId": session.sid})
        if loop.time() >= deadline:
            return False
    return False


async def _target(worker: Worker, registry: WorkerRegistry, session: LiveSession, tried: set[str]) -> str | None:
    """The least loaded live worker that can resume the session, other than us and those
    tried."""
    live = [inc for inc in await registry.live() if inc != worker.incarnation and inc not in tried]
    reports = await worker.store.worker_reports(live)
    agent = session.agent_name or worker.config.default_agent
    fitting = [r for r in reports.values() if accepts(r, agent, session.state_store)]
    fitting.sort(key=lambda r: r.get("sessions", 0) / max(r.get("maxSessions", 1), 1))
    return fitting[0]["incarnation"] if fitting else None


async def _hand_to(worker: Worker, registry: WorkerRegistry, session: LiveSession, target: str) -> bool:
    """Send `target` the create that loads the session; whether it holds it now."""
    request_id = ids.new_id()
    create = commands.Create(
        ws=session.ws, sid=session.sid, cwd=session.cwd, request_id=request_id, agent=session.agent_name,
        scope="single" if session.single else "thread",
        load=True, agent_sid=session.agent_sid, move_from=session.incarnation, carry=session.carry().pack(),
    )
    await commands.send_create(worker.store, target, create)
    reply = await worker.store.await_reply(request_id, MOVE_WAIT_S, alive=lambda: registry.is_live(target))
    if reply is not None and reply.get("ok"):
        return True
    # No answer (a late one would find the request abandoned): the store says who holds it.
    view = await worker.store.session(session.ws, session.sid)
    return view is not None and view.owner == target
