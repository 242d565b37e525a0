"""The prompt queue of a live session: `GET /session/:id/pending-prompts` (the reference's
route): the prompts it accepted that have not ended, the running one first, then the queued
ones in admission order, each `{promptId, text, queuedAt, state, originatorClientId?}`.

Any API process answers it from the session's turn records, which SEND writes at admission
and the owner's transitions at each step (acp_state.turns), so a prompt accepted through one
API process is in the queue every other one answers at once.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state.turns import TurnRecord

from .auth import principal_of
from .responses import OrjsonResponse
from .session_requests import client_id_header
from .state import app_state


def pending_prompt(record: TurnRecord) -> dict[str, Any]:
    """One entry of the queue, as the reference's: absent values left out."""
    entry: dict[str, Any] = {"promptId": record.prompt_id, "text": record.prompt_text, "queuedAt": record.queued_at,
                             "state": record.state.value}
    if record.originator_client_id is not None:
        entry["originatorClientId"] = record.originator_client_id
    return entry


async def pending_prompts(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    ref = await state.locator.live(sid, principal_of(request))
    client_id_header(request)
    records = await state.store.pending_turns(ref.ws, sid)
    return OrjsonResponse({"pendingPrompts": [pending_prompt(record) for record in records]})
