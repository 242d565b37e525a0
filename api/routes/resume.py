"""`POST /session/:id/load`, with `historyReplay: "response"`: a live session is attached and
its history replayed; a persisted session that is not live is resumed first: one whose
worker died or left (see acp_state/moves.py and docs/architecture.md, "Resume and drain").

The session is placed as a create is, on a live worker that offers its agent and reads the
agent-state store its history is in (both from its catalog row), which loads it (ACP
`session/load`) under the same id. Concurrent loads of one session, on any API processes,
resume it once: one claims the load, the others wait for the session to be live and attach.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids
from acp_state.moves import Carry
from acp_state.store import CatalogRow, LoadClaim, SessionView

from ..auth import Principal, principal_of
from ..locator import not_found
from ..outcomes import effect
from ..placement import not_resumable, place
from ..reads.cache import CachedSession
from ..reads.summaries import live_summary
from ..responses import ApiError, OrjsonResponse, json_body, unavailable
from ..session_requests import client_id_header
from ..state import AppState, app_state
from ..transcript_records import asked_page_size, replayed

WAIT_STEP_S = 0.05


async def attach_or_resume(state: AppState, sid: str, principal: Principal, client_id: str) -> tuple[CachedSession, bool]:
    """What `POST /session/:id/load` and `/resume` do first: register `client_id` on the live
    session `sid`, resuming it first when it is persisted and not live (`resume`). Answers
    the session and whether it was live already (`attached`: false for the call that resumed it)."""
    attached = True
    try:
        ref = await state.locator.live(sid, principal)
    except ApiError as error:
        if error.status != 404:
            raise
        # Not live: a persisted session is resumed on a live worker (its agent's history).
        ref, resumed = await resume(state, sid, principal, client_id)
        attached = not resumed
    attach = commands.Attach(sid=sid, client_id=client_id)
    if not await state.locator.to_owner(
        sid, ref, lambda owner: state.store.attach(ref.ws, owner, attach), lambda attached: not attached
    ):
        raise not_found(sid)
    return ref, attached


async def resume(state: AppState, sid: str, principal: Principal, client_id: str) -> tuple[CachedSession, bool]:
    """Make the persisted session `sid` live again; answers it as `locator.live` does, and
    whether this call resumed it (the others attached to the session it resumed).
    404: unknown here, or deleted (before this load claimed it: a delete and a load race in
    one slot, and exactly one wins); 409 `not_resumable`: its agent cannot load sessions; 503: no live
    worker can resume it now (`no_worker_for_state_store`, `no_worker_for_agent`), or its
    dead worker's state is not swept yet (`session_not_released`)."""
    ws = await state.locator.workspace_of(sid, principal) if ids.is_token(sid) else None
    row = await state.store.catalog_row(ws, sid) if ws is not None and ws in state.workspaces else None
    if ws is None or row is None:
        raise not_found(sid)
    if row.resumable is False:
        raise not_resumable(sid)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.create_timeout_s
    claim_ms = int(state.settings.create_timeout_s * 1000) + 5000
    request = ids.new_id()
    while True:
        view = await state.store.session(ws, sid)
        if view is not None and await state.registry.is_live(view.owner):
            return await state.locator.live(sid, principal), False  # resumed elsewhere meanwhile
        claim = await state.store.claim_load(ws, sid, request, claim_ms) if view is None else None
        if claim is LoadClaim.GONE:
            raise not_found(sid)  # deleted meanwhile (DELETE /session/:id won the race)
        if claim is LoadClaim.OK:
            try:
                await _load(state, ws, sid, row, client_id)
            finally:
                await state.store.release_load(ws, sid, request)
            state.locator.remember(sid, ws)
            return await state.locator.live(sid, principal), True
        # Another load is under way, or the dead owner's state is still there (its sweeper
        # removes it once its lease lapsed): wait for either.
        if loop.time() >= deadline:
            if view is not None:
                raise unavailable("the session's last worker has not been swept yet; retry shortly",
                                  "session_not_released", retry_after_s=1, sessionId=sid)
            raise unavailable("another load of this session did not finish in time; retry",
                              "restore_in_progress", retry_after_s=2, sessionId=sid)
        await asyncio.sleep(WAIT_STEP_S)


async def _load(state: AppState, ws: str, sid: str, row: CatalogRow, client_id: str) -> None:
    carry = Carry.of_row(row.created_at, row.updated_at, row.display_name)

    def create(request_id: str) -> commands.Create:
        return commands.Create(
            ws=ws, sid=sid, cwd=state.workspaces[ws], client_id=client_id,
            wait_ms=int(state.settings.create_timeout_s * 1000), request_id=request_id, agent=row.agent,
            # (A session never prompted has no history: its agent starts it anew.)
            load=carry.history, agent_sid=row.agent_sid, carry=carry.pack(),
            source_type=row.source_type, source_id=row.source_id,  # the row keeps them
        )

    try:
        async with effect(state.store.resends):  # a load sent to a worker may have happened
            await place(state, create, agent=row.agent, state_store=row.state_store, cwd=state.workspaces[ws])
    except ApiError as error:
        # The worker's publish was refused: the session was deleted meanwhile (a delete
        # that came after this load's claim lapsed), or is another's.
        if error.body.get("code") == "session_conflict" and await state.store.catalog_row(ws, sid) is None:
            raise not_found(sid) from error
        raise


async def load(request: Request) -> Response:
    """`POST /session/:id/load`, with `historyReplay: "response"`: a live session is
    attached; a persisted one is resumed first (`resume` below), then answered alike."""
    state, sid, client_id, body = await _asked(request)
    page_size = asked_page_size(body.get("historyPageSize"))
    ref, attached = await attach_or_resume(state, sid, principal_of(request), client_id)
    snapshot = await state.store.load_snapshot(ref.ws, sid, page_size)
    view, page = snapshot.view, snapshot.page
    if view is None:
        raise not_found(sid)
    summary = live_summary(view)
    if summary["pendingInteractionCount"] or summary["hasActivePrompt"]:
        # Persisted pages cannot show pending interactions or a running turn: replay the log.
        replay = [orjson.loads(raw) for raw in snapshot.log]
        has_more = False
    else:
        replay = [replayed(entry_id, raw) for entry_id, raw in reversed(page[:page_size])]
        has_more = len(page) > page_size
        if view.turn_error_event is not None:
            replay.append(view.turn_error_event)
    answer = _answer(sid, summary, attached, client_id, {}, view)
    answer["compactedReplay"] = replay
    answer["liveJournal"] = []
    answer["lastEventId"] = answer.pop("lastEventId")  # the reference's key order
    answer["eventEpoch"] = answer.pop("eventEpoch")
    if has_more:  # as the reference: only when there is more
        answer["historyHasMore"] = True
    return OrjsonResponse(answer)


async def resume_session(request: Request) -> Response:
    """`POST /session/:id/resume` (the reference's route; features `session_resume` and its
    alias `unstable_session_resume`): `POST /session/:id/load` without the history. A live
    session is attached (`attached: true`); a persisted one is resumed first, as a load
    resumes it: its worker's agent brings it back by ACP `session/resume`, which replays
    nothing, where the agent advertises `sessionCapabilities.resume`, else by `session/load`,
    whose replay the worker drops. The answer carries no replay (`compactedReplay`): a client
    that resumes has the transcript already, or pages it from `GET /session/:id/transcript`.
    `state` is the agent's session state as it reported it on the resume (`modes`,
    `configOptions`), `{}` for an attach, as in the reference."""
    state, sid, client_id, _ = await _asked(request)
    ref, attached = await attach_or_resume(state, sid, principal_of(request), client_id)
    view = await state.store.session(ref.ws, sid)
    if view is None:
        raise not_found(sid)
    summary = live_summary(view)
    return OrjsonResponse(_answer(sid, summary, attached, client_id, {} if attached else (view.agent_state or {}), view))


async def _asked(request: Request) -> tuple[AppState, str, str, dict[str, Any]]:
    """What a load or a resume asks: the process's state, the session id, the client's id
    (a new one if it sent none) and the JSON object body (400 if it is not one)."""
    body = await json_body(request, required=False)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request")
    return app_state(request), request.path_params["id"], client_id_header(request) or ids.new_client_id(), body


def _answer(
    sid: str, summary: dict[str, Any], attached: bool, client_id: str, agent_state: dict[str, Any], view: SessionView
) -> dict[str, Any]:
    """The answer a load and a resume share, in the reference's key order."""
    return {
        "sessionId": sid,
        "workspaceCwd": summary["workspaceCwd"],
        "attached": attached,
        "clientId": client_id,
        "createdAt": summary["createdAt"],
        "state": agent_state,
        "hasRunningBackgroundTasks": False,
        "hasActivePrompt": summary["hasActivePrompt"],
        "lastEventId": view.last_event_id,
        "eventEpoch": view.epoch,
    }
