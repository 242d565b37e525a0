"""The prompt queue of a live session (the reference's routes): `GET
/session/:id/pending-prompts`, the prompts it accepted that have not ended, the running one
first, then the queued ones in admission order, each `{promptId, text, queuedAt, state,
originatorClientId?}`; and `DELETE /session/:id/pending-prompts/:promptId`, which takes one
out (`{removed}`): its owner ends a queued one `cancelled` without running it, or cancels
the running one, and answers whether it was still pending.

Any API process answers it from the session's turn records, which SEND writes at admission
and the owner's transitions at each step (acp_state.turns), so a prompt accepted through one
API process is in the queue every other one answers at once.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids
from acp_state.turns import TurnRecord

from ..auth import principal_of
from ..outcomes import ask_owner
from ..responses import OrjsonResponse
from ..session_requests import client_id_header
from ..state import app_state


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


async def remove_pending_prompt(request: Request) -> Response:
    state = app_state(request)
    sid, prompt_id = request.path_params["id"], request.path_params["promptId"]
    ref = await state.locator.live(sid, principal_of(request))
    client_id_header(request)
    if not ids.is_token(prompt_id):  # never a prompt id this session has
        return OrjsonResponse({"removed": False})
    command = commands.RemovePrompt(sid=sid, prompt_id=prompt_id, request_id=ids.new_id())
    reply = await ask_owner(state, sid, ref, command)
    return OrjsonResponse({"removed": reply.ok})
