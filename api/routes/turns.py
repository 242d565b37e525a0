"""Turn status: `GET /session/:id/turns/current` and `GET /session/:id/turns/:promptId`.

Any API process answers from the store: a prompt's record is written whole at admission
(queued), at its start (running) and at its end, in the same step as the session's own
state (see acp_state.turns). `current` is the running turn, else the oldest queued one,
else the one that ended last, else `idle`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from acp_state import turns

from ..auth import principal_of
from ..responses import ApiError, OrjsonResponse
from ..session_requests import client_id_header
from ..state import app_state


async def current(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    ref = await state.locator.live(sid, principal_of(request))
    client_id_header(request)
    record = await state.store.current_turn(ref.ws, sid)
    return OrjsonResponse(record.wire(sid) if record else turns.idle(sid))


async def by_prompt(request: Request) -> Response:
    state = app_state(request)
    sid, prompt_id = request.path_params["id"], request.path_params["promptId"]
    ref = await state.locator.live(sid, principal_of(request))
    client_id_header(request)
    record = await state.store.turn(ref.ws, sid, prompt_id)
    if record is None:
        raise ApiError(
            404, f"Prompt {prompt_id} not found in session {sid}", "prompt_not_found", sessionId=sid, promptId=prompt_id
        )
    return OrjsonResponse(record.wire(sid))
