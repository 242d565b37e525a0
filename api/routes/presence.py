"""Who is watching a session: `POST /session/:id/heartbeat` and `POST /session/:id/detach`
(the reference's feature `client_heartbeat`), and the pruning of clients whose presence
lapsed, which every API process runs for its workspaces.

A client registered on a session (by its create or a load) that heartbeats is counted
(`clientCount`) until a presence TTL (`--client-ttl-ms`, 90 s: three of the Web Shell's 30 s
heartbeats) after its last heartbeat, or until it detaches; then it is removed from the
session on every API process (the store announces the change). One that never heartbeats
stays until it detaches or the session ends, as in the reference. What the store keeps is in
`acp_state.store.presence_side`.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands
from acp_state.store import Presence, ReaderStore
from acp_state.tasks import survive, wait_or_stop

from ..auth import principal_of
from ..locator import not_found
from ..responses import ApiError, OrjsonResponse
from ..session_requests import client_id_header
from ..state import app_state

log = logging.getLogger("api.presence")


def not_registered(sid: str, client_id: str) -> ApiError:
    """The reference's answer to a client id the session does not know (InvalidClientIdError)."""
    return ApiError(
        400, f'Client id "{client_id}" is not registered for session {sid}', "invalid_client_id",
        sessionId=sid, clientId=client_id,
    )


async def heartbeat(request: Request) -> Response:
    """`{sessionId, clientId?, lastSeenAt}`: the client (if named) is present for another TTL."""
    state = app_state(request)
    sid = request.path_params["id"]
    client_id = client_id_header(request)
    ref = await state.locator.live(sid, principal_of(request))
    seen, at = await state.store.client_seen(ref.ws, sid, client_id, state.settings.client_ttl_ms)
    if seen is Presence.GONE:
        raise not_found(sid)
    if seen is Presence.UNKNOWN_CLIENT:
        assert client_id is not None
        raise not_registered(sid, client_id)
    body: dict[str, object] = {"sessionId": sid}
    if client_id is not None:
        body["clientId"] = client_id
    body["lastSeenAt"] = at
    return OrjsonResponse(body)


async def detach(request: Request) -> Response:
    """204: the client no longer counts, nor may it vote. Without a client id, with one the
    session does not know, or for a session that is not live (unknown, ended, or of a
    workspace the caller may not see), nothing changes: 204 too, as the reference answers
    (the Web Shell detaches from sessions that may have ended meanwhile)."""
    state = app_state(request)
    sid = request.path_params["id"]
    client_id = client_id_header(request)
    try:
        ref = await state.locator.live(sid, principal_of(request))
    except ApiError as error:
        if error.status != 404:
            raise
        return Response(status_code=204)
    if client_id is not None:
        command = commands.Detach(sid=sid, client_id=client_id)
        await state.locator.to_owner(sid, ref, lambda owner: state.store.detach(ref.ws, owner, command),
                                     lambda ok: not ok)  # a session that left meanwhile: nothing to leave
    return Response(status_code=204)


async def run_pruner(store: ReaderStore, workspaces: list[str], interval_s: float, stop: asyncio.Event) -> None:
    """Every `interval_s`, remove the lapsed clients of each workspace this process serves
    (every API process does: a round that finds none is one ZRANGEBYSCORE a workspace)."""

    async def round_() -> None:
        for ws in workspaces:
            while await store.prune_clients(ws):
                pass

    while not stop.is_set():
        await survive("presence", round_)
        if await wait_or_stop(stop, interval_s):
            return
