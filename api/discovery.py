"""`GET /health` and `GET /capabilities`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .auth import principal_of
from .responses import MAX_BODY_BYTES, OrjsonResponse
from .sessions import MAX_QUEUED_PROMPTS, _state

# Only what this API really serves.
FEATURES = [
    "health",
    "capabilities",
    "session_create",
    "session_close",
    "session_prompt",
    "session_cancel",
    "session_status",
    "workspace_sessions",
    "permission_vote",
    "permission_vote_legacy",
    "pending_interactions",
    "turn_error_status",
]


async def health(_: Request) -> Response:
    return OrjsonResponse({"status": "ok"})


async def capabilities(request: Request) -> Response:
    state = _state(request)
    principal = principal_of(request)
    return OrjsonResponse(
        {
            "v": 1,
            "protocolVersions": {"acp": 1},
            "features": FEATURES,
            "limits": {
                "maxQueuedPromptsPerSession": MAX_QUEUED_PROMPTS,
                "maxPendingInteractionsPerSession": 64,
                "maxRequestBodyBytes": MAX_BODY_BYTES,
                "maxListPageSize": 100,
            },
            "polling": {"statusIntervalMs": 1000},
            "workspaces": [
                {"workspaceId": ws, "cwd": cwd} for ws, cwd in state.workspaces.items() if principal.may(ws)
            ],
        }
    )
