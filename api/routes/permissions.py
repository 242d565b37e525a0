"""Permission votes: `POST /session/:id/permission/:requestId` and the legacy route.

The vote is decided inside the store (one script), so exactly one vote wins a request even
when voters reach different API processes. The route's vote is the `commands.Vote` the
owner answers the agent with (`votes.parse` makes it once the session is known).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids, votes
from acp_state.store import VoteOutcome

from ..outcomes import idempotency_key, to_owner
from ..reads.cache import CachedSession
from ..responses import ApiError, OrjsonResponse, json_body
from ..session_requests import client_id_header, live_or_first
from ..state import app_state


NO_REQUEST = "permission_request_not_found"


def _check(body: object) -> object:
    """The body, if it casts a vote; else the reference's 400. Judged before anything else
    of the request (the client id header, the session, the request id), as before."""
    try:
        votes.check(body)
    except votes.MalformedVote as error:
        raise ApiError(400, str(error), "invalid_vote") from None
    return body


async def _cast(
    request: Request, ref: CachedSession, vote: commands.Vote, key: str | None, legacy: bool = False
) -> Response:
    state = app_state(request)
    outcome = await to_owner(state, vote.sid, ref, lambda owner: state.store.vote(ref.ws, owner, vote, key))
    if outcome is VoteOutcome.OK:
        return OrjsonResponse({})
    if outcome in (VoteOutcome.UNKNOWN, VoteOutcome.GONE):
        raise _no_request(vote.sid, vote.rid, legacy)
    if outcome is VoteOutcome.CLIENT:
        raise ApiError(400, "X-Qwen-Client-Id is not registered on this session", "invalid_client_id")
    raise ApiError(
        400, "optionId is not one of the offered options", "invalid_option_id", requestId=vote.rid,
        optionId=vote.option_id,
    )


def _no_request(sid: str, rid: str, legacy: bool = False) -> ApiError:
    """The reference's 404 bodies, plus a `code` (every failure of acp-state carries one)."""
    if legacy:
        return ApiError(404, "No pending permission request", NO_REQUEST, requestId=rid)
    return ApiError(404, "No pending permission request for session", NO_REQUEST, sessionId=sid, requestId=rid)


async def vote_in_session(request: Request) -> Response:
    sid, rid = request.path_params["id"], request.path_params["requestId"]
    body = _check(await json_body(request))
    client_id = client_id_header(request)
    key = idempotency_key(request)
    ref, first = await live_or_first(request, sid, key)
    if first is not None:
        return OrjsonResponse({})  # the same vote again: it won the first time
    assert ref is not None
    if not ids.is_token(rid):
        raise _no_request(sid, rid)
    return await _cast(request, ref, votes.parse(body, sid=sid, rid=rid, client_id=client_id), key)


async def vote_legacy(request: Request) -> Response:
    state = app_state(request)
    rid = request.path_params["requestId"]
    body = _check(await json_body(request))
    client_id = client_id_header(request)
    key = idempotency_key(request)
    where = await state.store.request_location(rid) if ids.is_token(rid) else None
    if where is None:
        raise _no_request("", rid, legacy=True)
    ws, sid = where
    state.locator.remember(sid, ws)
    try:
        ref, first = await live_or_first(request, sid, key)
    except ApiError:
        raise _no_request("", rid, legacy=True) from None
    if first is not None:
        return OrjsonResponse({})  # the same vote again: it won the first time
    assert ref is not None
    vote = votes.parse(body, sid=sid, rid=rid, client_id=client_id)
    return await _cast(request, ref, vote, key, legacy=True)
