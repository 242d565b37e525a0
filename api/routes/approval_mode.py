"""The agent's session mode as the reference's approval mode: `POST
/session/:id/approval-mode` (`{mode, persist?, planMode?}`, feature
`session_approval_mode_control`) and `approvalMode` on create.

acp-state serves any ACP agent, so the mode is the agent's ACP session mode (`session/set_mode`,
among the `modes` its `session/new` offered): the reference's mode names are checked as the
reference checks them, then the session's owner refuses one its agent does not offer with the
reference's error, naming the modes it does offer. A switch is announced as the reference's
`approval_mode_changed` event, and the status carries the current mode as `approvalMode`.
Nothing is persisted to workspace settings (`persisted: false`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids

from ..approval_modes import APPROVAL_MODES, invalid_mode
from ..auth import principal_of
from ..outcomes import ask_owner
from ..responses import ApiError, OrjsonResponse, json_body
from ..session_requests import client_id_header
from ..state import app_state

async def set_approval_mode(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    ref = await state.locator.live(sid, principal_of(request))
    body = await json_body(request, required=False)
    body = body if isinstance(body, dict) else {}
    mode, persist, plan_mode = body.get("mode"), body.get("persist"), body.get("planMode")
    if not isinstance(mode, str) or mode not in APPROVAL_MODES:
        raise invalid_mode(APPROVAL_MODES)
    if persist is not None and not isinstance(persist, bool):
        raise ApiError(400, "`persist` must be a boolean when provided", "invalid_persist_flag")
    if plan_mode is not None and (not isinstance(plan_mode, bool) or mode == "plan"):
        raise ApiError(400, "`planMode` must be a boolean with a non-plan execution mode", "invalid_plan_mode")
    client_id = client_id_header(request)
    command = commands.SetMode(sid=sid, mode=mode, request_id=ids.new_id(), client_id=client_id)
    reply = await ask_owner(state, sid, ref, command)
    if reply.code == "mode_not_offered":
        raise invalid_mode(reply.modes or [])
    if not reply.ok:
        raise ApiError(502, f"the agent refused the mode: {reply.error or 'no reason given'}", "agent_error",
                       sessionId=sid)
    return OrjsonResponse({"sessionId": sid, "mode": mode, "previous": reply.previous or mode, "persisted": False})
