"""`POST /session/:id/resume` (the reference's route; features `session_resume` and its alias
`unstable_session_resume`): `POST /session/:id/load` without the history.

A live session is attached (`attached: true`); a persisted one is resumed first, as a load
resumes it (api/resume.py): its worker's agent brings it back by ACP `session/resume`,
which replays nothing, where the agent advertises `sessionCapabilities.resume`, else by
`session/load`, whose replay the worker drops. Either way the answer carries no replay
(`compactedReplay`): a client that resumes has the transcript already, or pages it from
`GET /session/:id/transcript`. `state` is the agent's session state as it reported it on
the resume (`modes`, `configOptions`), `{}` for an attach, as in the reference.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from acp_state import ids

from .auth import principal_of
from .locator import not_found
from .responses import ApiError, OrjsonResponse, json_body
from .resume import attach_or_resume
from .session_requests import client_id_header
from .state import app_state
from .summaries import live_summary


async def resume_session(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    client_id = client_id_header(request) or ids.new_client_id()
    body = await json_body(request, required=False)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request")
    ref, attached = await attach_or_resume(state, sid, principal_of(request), client_id)
    view = await state.store.session(ref.ws, sid)
    if view is None:
        raise not_found(sid)
    summary = live_summary(view)
    return OrjsonResponse({
        "sessionId": sid,
        "workspaceCwd": summary["workspaceCwd"],
        "attached": attached,
        "clientId": client_id,
        "createdAt": summary["createdAt"],
        "state": {} if attached else (view.agent_state or {}),
        "hasRunningBackgroundTasks": False,
        "hasActivePrompt": summary["hasActivePrompt"],
        "lastEventId": view.last_event_id,
        "eventEpoch": view.epoch,
    })
