"""`GET /health` (liveness), `GET /health/ready` (readiness) and `GET /capabilities`."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import Response

from acp_state.placement import offers

from .. import limits, workspace_ref
from ..responses import OrjsonResponse
from ..state import app_state

log = logging.getLogger("api.discovery")
READY_TIMEOUT_S = 2.0

# Only what this API really serves: the reference's feature names for its routes and
# behaviours acp-state has, then acp-state's own additions (names the reference lacks).
FEATURES = [
    "health",
    "capabilities",
    "session_create",
    "session_id_override",
    "session_scope_override",
    "session_load",
    "session_resume",  # POST /session/:id/resume (session_resume), and its alias
    "unstable_session_resume",
    "session_list",
    "session_catalog_batch",
    "workspace_session_live_state",
    "session_prompt",
    "session_turn_status",
    "session_cancel",
    "session_events",
    "client_identity",
    "client_heartbeat",
    "session_permission_vote",
    "permission_vote",
    "session_status",
    "session_close",
    "session_transcript",
    "session_transcript_pagination",
    "session_supported_commands",
    "session_context",  # GET /session/:id/context and /context-usage (session_context)
    "session_context_usage",
    "session_approval_mode_control",
    "session_source_metadata",  # sourceType/sourceId on create, listed and filtered (session_source)
    # acp-state's own
    "health_ready",
    "idempotency_key",
    "pending_interactions",
    "turn_error_status",
    "sessions_live_state_batch",
    "workspace_live_state_events",
    "attention_inbox",
    "attention_events",
    "deployment_workers",
    "named_agents",
]
# The reference's poll interval for live state, and the one version of its protocol.
LIVE_STATE_POLL_INTERVAL_MS = 5000
PROTOCOL_VERSIONS = {"current": "v1", "supported": ["v1"]}


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


async def agents_on_offer(request: Request) -> list[dict[str, object]]:
    """Every agent name a worker offered lately: how many live workers offer it now
    (`workers`; 0: a create naming it is refused with 503 until one is back), and how many
    take it as their default (a create that names no agent)."""
    state = app_state(request)
    reports = list((await state.store.worker_reports(await state.registry.live())).values())
    names = sorted(set(await state.store.known_agents()).union(*(r.agent_names for r in reports)))
    return [
        {
            "name": name,
            "workers": sum(1 for r in reports if offers(r, name)),
            "defaultOn": sum(1 for r in reports if r.default_agent == name),
        }
        for name in names
    ]


async def capabilities(request: Request) -> Response:
    """The reference's envelope; `workspaces` lists those this caller's token may see, and
    `workspaceCwd` names the first of them, primary (the first registered one, for a caller
    that sees every workspace; "" for one that sees none here): no answer names a workspace
    the caller may not see. `agents` are the agents a create may name (acp-state's own)."""
    state = app_state(request)
    seen = workspace_ref.visible(request)
    primary = next(iter(seen.values()), "")
    return OrjsonResponse(
        {
            "v": 1,
            "protocolVersions": PROTOCOL_VERSIONS,
            "mode": "http-bridge",
            "features": FEATURES,
            "sessionLiveStatePollIntervalMs": LIVE_STATE_POLL_INTERVAL_MS,
            "modelServices": [],
            "workspaceCwd": primary,
            "transports": ["rest"],
            "policy": {"permission": "first-responder"},
            "limits": {
                "maxPendingPromptsPerSession": 1 + limits.MAX_QUEUED_PROMPTS,
                # How long a create may take (the SDK's restore budget): the create timeout.
                "sessionRestoreTimeoutMs": int(state.settings.create_timeout_s * 1000),
                "maxRequestBodyBytes": limits.MAX_BODY_BYTES,
                "maxListPageSize": limits.LISTING_MAX_SIZE,
                "maxLiveStateWorkspaces": limits.LIVE_STATE_MAX_WORKSPACES,
                "maxAttentionPageSize": limits.ATTENTION_MAX_SIZE,
            },
            "workspaces": [
                {"id": ws, "cwd": cwd, "primary": cwd == primary, "trusted": True, "workflowsEnabled": False}
                for ws, cwd in seen.items()
            ],
            "agents": await agents_on_offer(request),
        }
    )
