"""Where a create goes: a live worker offering its agent (and, for a load, reading its
session's agent-state store) with spare capacity, the next one if it is full (`place`), by
the live workers' load reports this process keeps (`reads/worker_reports.py`). Which
workers take a session, and in which order they are asked, is `acp_state.placement`'s (a
drain's moves use it too). A worker that died since its report was read is still asked:
the create then finds it dead and tries the next one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from acp_state import commands, ids
from acp_state.commands import Reply
from acp_state.placement import accepts, ranked, runs_child
from acp_state.store import WorkerReport, is_transient

from .outcomes import outcome_unknown
from .responses import ApiError, unavailable

if TYPE_CHECKING:  # it holds this process's LiveReports
    from .state import AppState

log = logging.getLogger("api.placement")

# How often a create that found no live worker looks again.
REPORTS_WAIT_STEP_S = 0.1


async def _live_reports(state: AppState) -> list[WorkerReport]:
    """The live workers' load reports. Right after a start (or while every worker is
    between incarnations) there may be none yet: wait for one, up to the create timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.create_timeout_s
    fresh = False
    while True:
        reports = await state.reports.get(fresh)
        if reports or loop.time() >= deadline:
            return reports
        fresh = True  # none yet: read again each step, not the kept empty answer
        await asyncio.sleep(REPORTS_WAIT_STEP_S)


async def _offering(state: AppState, agent: str | None, state_store: str | None = None) -> list[WorkerReport]:
    """The live workers that can run a session of `agent` (None: any, its default agent),
    not draining, and reading `state_store` if one is named (a resume). A name no worker
    offers is 400 `unknown_agent`; a known one no live worker offers now (its workers died
    or left), or a store no live worker reads, is 503 with Retry-After."""
    if state_store is not None:
        stored = [r for r in await _live_reports(state) if accepts(r, None, state_store)]
        if not stored:  # before refusing, not the kept answer: a reader may have just started
            stored = [r for r in await state.reports.get(fresh=True) if accepts(r, None, state_store)]
        if not stored:
            raise unavailable(
                "no live worker reads the agent-state store this session's history is in",
                "no_worker_for_state_store", retry_after_s=2, stateStore=state_store,
            )
    if agent is None:
        candidates = [r for r in await _live_reports(state) if accepts(r, None, state_store)]
        if not candidates:
            raise unavailable("no worker is registered", "no_worker", retry_after_s=2)
        return candidates
    # A known name is judged at once; an unknown one only once some worker is live (right
    # after a start, the worker offering it may not have registered yet).
    known = agent in await state.store.known_agents()
    live = await state.store.worker_reports(await state.registry.live())
    candidates = list(live.values()) if known or live else await _live_reports(state)
    offering = [report for report in candidates if accepts(report, agent, state_store)]
    if offering:
        return offering
    if known:
        raise unavailable(f"no live worker offers agent {agent!r} now", "no_worker_for_agent", retry_after_s=2, agent=agent)
    raise unknown_agent(agent)


def not_resumable(sid: str) -> ApiError:
    return ApiError(409, "the session's agent cannot load sessions (no ACP loadSession); it cannot be resumed",
                    "not_resumable", sessionId=sid)


# A worker's refusal of a create whose session id another workspace holds (worker/creates.py).
SESSION_ID_CONFLICT = "session_id_conflict"


def session_id_conflict(sid: str) -> ApiError:
    """409: a session id is unique across workspaces, and this one is held by a session
    (live or listed) of a workspace other than the create's. Which one is not said: the
    caller may not see it."""
    return ApiError(409, f'Session id "{sid}" is taken; choose another', SESSION_ID_CONFLICT, sessionId=sid)


def unknown_agent(agent: Any) -> ApiError:
    return ApiError(400, f"no worker offers an agent named {agent!r} (see /capabilities)", "unknown_agent", agent=agent)


async def place(
    state: AppState,
    create: Callable[[str], commands.Create],
    before_send: Callable[[str], Awaitable[None]] | None = None,
    agent: str | None = None,
    state_store: str | None = None,
    cwd: str | None = None,
) -> Reply:
    """Send a create (`create(request id)`) to a live worker offering `agent` with spare
    capacity (and, for a load, reading `state_store`), one whose child for the agent in
    workspace `cwd` runs first; try the next one if it is full or draining.
    `before_send(request id)` runs before each create goes out."""

    def warm(report: WorkerReport) -> bool:
        return cwd is not None and runs_child(report, agent or report.default_agent or "", cwd)

    for report in ranked(await _offering(state, agent, state_store), warm=warm):
        request_id = ids.new_id()
        incarnation = report.incarnation
        if before_send is not None:
            await before_send(request_id)
        command = create(request_id)
        await state.store.send_control(incarnation, command)
        try:
            reply = await state.store.await_reply(
                request_id, state.settings.create_timeout_s, alive=lambda: state.registry.is_live(incarnation)
            )
        except Exception as error:  # the create went out: it may be under way, or done
            if is_transient(error):
                raise outcome_unknown() from error
            raise
        if reply is None and not await state.registry.is_live(incarnation):
            continue  # the worker died with the create: it was abandoned, try the next one
        if reply is None:
            raise ApiError(504, "the worker did not start the session in time", "agent_init_timeout")
        if reply.ok:
            await note_told(state, command.ws, command.sid)
            return reply
        code = reply.code or "agent_unavailable"
        if code == "not_resumable":
            raise not_resumable(command.sid)
        if code == SESSION_ID_CONFLICT:
            raise session_id_conflict(command.sid)
        if code not in ("worker_full", "agent_not_offered", "worker_draining"):
            raise ApiError(503, reply.error or "the agent could not start", code)
    raise unavailable("no live worker has spare capacity", "no_worker_capacity", retry_after_s=2)


async def note_told(state: AppState, ws: str, sid: str) -> None:
    """A create's answer was taken: its session is one somebody was told of, and keeps its
    catalog row even if its worker dies. Best effort: if this is lost, such a death also
    takes the row, and the session was gone anyway."""
    try:
        await state.store.mark_told(ws, sid)
    except Exception:  # the store is away: the create's answer stands
        log.warning("could not mark session %s as told", sid, exc_info=True)
