"""`GET /session/:id/supported-commands` (the reference's route; feature
`session_supported_commands`): the commands the session's agent advertised last, by ACP
`available_commands_update`, as `{v: 1, sessionId, availableCommands, availableSkills}`.

The owner keeps the agent's last list in the session's state (acp_state.store: the session
hash), so any API process answers it from its cached view, with no round trip to the
worker; an agent that never advertised any answers `availableCommands: []`. ACP has no
skills: `availableSkills` are those Qwen Code names in the update's `_meta`, else `[]`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..auth import principal_of
from ..responses import OrjsonResponse
from ..state import app_state

STATUS_SCHEMA_VERSION = 1


async def supported_commands(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    ref = await state.locator.live(sid, principal_of(request))
    advertised = ref.view.available_commands or {}
    return OrjsonResponse({
        "v": STATUS_SCHEMA_VERSION, "sessionId": sid, "availableCommands": advertised.get("availableCommands", []),
        "availableSkills": advertised.get("availableSkills", []),
    })
