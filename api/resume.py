"""Resume a persisted session that is not live: `POST /session/:id/load` of a session whose
worker died or left (see acp_state/moves.py and docs/architecture.md, "Resume and drain").

The session is placed as a create is, on a live worker that offers its agent and reads the
agent-state store its history is in (both from its catalog row), which loads it (ACP
`session/load`) under the same id. Concurrent loads of one session, on any API processes,
resume it once: one claims the load, the others wait for the session to be live and attach.
"""

from __future__ import annotations

import asyncio

from acp_state import commands, ids
from acp_state.moves import Carry
from acp_state.store import CatalogRow, LoadClaim

from .auth import Principal
from .cache import CachedSession
from .locator import not_found
from .outcomes import effect
from .placement import not_resumable, place
from .responses import ApiError, unavailable
from .state import AppState

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
