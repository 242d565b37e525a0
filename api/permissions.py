"""Permission votes: `POST /session/:id/permission/:requestId` and the legacy route.

The vote is decided inside Redis (scripts.VOTE), so exactly one vote wins a request even
when voters reach different API processes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from acp_state import ids, votes

from .auth import principal_of
from .cache import CachedSession
from .responses import ApiError, OrjsonResponse, json_body
from .sessions import _state, client_id_header


def _parse(body: object) -> votes.Vote:
    try:
        return votes.parse(body)
    except votes.MalformedVote as error:
        raise ApiError(400, str(error)) from None


async def _cast(
    request: Request, sid: str, ref: CachedSession, rid: str, vote: votes.Vote, client_id: str | None
) -> Response:
    state = _state(request)
    command = {
        "t": "vote",
        "sid": sid,
        "rid": rid,
        "selected": vote.selected,
        "optionId": vote.option_id,
        "metadata": vote.metadata,
        "clientId": client_id,
    }
    outcome = await state.store.vote(
        ref.ws, sid, ref.owner, rid, vote.selected, vote.option_id or "", client_id or "", command
    )
    if outcome == "ok":
        return OrjsonResponse({})
    if outcome in ("unknown", "gone"):
        raise ApiError(404, "No pending permission request for session", sessionId=sid, requestId=rid)
    if outcome == "client":
        raise ApiError(400, "X-Qwen-Client-Id is not registered on this session", "invalid_client_id")
    raise ApiError(
        400, "optionId is not one of the offered options", "invalid_option_id", requestId=rid, optionId=vote.option_id
    )


async def vote_in_session(request: Request) -> Response:
    state = _state(request)
    sid, rid = request.path_params["id"], request.path_params["requestId"]
    vote = _parse(await json_body(request))
    client_id = client_id_header(request)
    ref = await state.locator.live(sid, principal_of(request))
    if not ids.is_token(rid):
        raise ApiError(404, "No pending permission request for session", sessionId=sid, requestId=rid)
    return await _cast(request, sid, ref, rid, vote, client_id)


async def vote_legacy(request: Request) -> Response:
    state = _state(request)
    rid = request.path_params["requestId"]
    vote = _parse(await json_body(request))
    client_id = client_id_header(request)
    where = await state.store.request_location(rid) if ids.is_token(rid) else None
    if where is None:
        raise ApiError(404, "No pending permission request", requestId=rid)
    ws, sid = where
    state.locator.remember(sid, ws)
    try:
        ref = await state.locator.live(sid, principal_of(request))
    except ApiError:
        raise ApiError(404, "No pending permission request", requestId=rid) from None
    return await _cast(request, sid, ref, rid, vote, client_id)
