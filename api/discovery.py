"""`GET /health` (liveness), `GET /health/ready` (readiness) and `GET /capabilities`."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import Response

from .auth import principal_of
from .responses import MAX_BODY_BYTES, OrjsonResponse
from .sessions import MAX_QUEUED_PROMPTS
from .state import app_state

log = logging.getLogger("api.discovery")
READY_TIMEOUT_S = 2.0

# Only what this API really serves.
FEATURES = [
    "health",
    "health_ready",
    "idempotency_key",
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
    """Liveness: this process serves requests (the reference's shape). Nothing else is
    checked, so an orchestrator never restarts an API because Redis or the workers are away."""
    return OrjsonResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness, for a load balancer: Redis answers and at least one worker holds a lease.
    A create sent while not ready waits for a worker (up to the create timeout) anyway."""
    state = app_state(request)
    try:
        live = await asyncio.wait_for(state.registry.live(), READY_TIMEOUT_S)
    except Exception as error:  # unreachable, stalled, loading: all mean not ready
        log.info("not ready: the store did not answer (%s)", type(error).__name__)
        body = {"status": "not_ready", "redis": False, "workers": 0, "code": "store_unavailable",
                "error": "the state store did not answer"}
        return OrjsonResponse(body, status_code=503)
    if not live:
        body = {"status": "not_ready", "redis": True, "workers": 0, "code": "no_worker",
                "error": "no worker holds a lease"}
        return OrjsonResponse(body, status_code=503)
    return OrjsonResponse({"status": "ready", "redis": True, "workers": len(live)})


async def capabilities(request: Request) -> Response:
    state = app_state(request)
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
