"""`GET /workers`: the deployment's live workers, for an operator (the Web Shell's deployment
view, dashboards): lease age, sessions, load, from the load report each worker stores with
its lease. Workspace-scoped tokens see only their workspaces, so not this."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state.placement import load
from acp_state.store import WorkerReport

from ..auth import principal_of
from ..responses import ApiError, OrjsonResponse
from ..state import app_state


async def workers(request: Request) -> Response:
    state = app_state(request)
    if principal_of(request).workspaces is not None:
        raise ApiError(403, "the deployment's workers are not for a workspace-scoped token", "deployment_scope_required")
    view = await state.store.lease_view()
    now = view.redis_now_ms
    live = {inc: deadline for inc, deadline in view.live_until().items() if deadline > now}
    reports = await state.store.worker_reports(sorted(live))
    listed: list[dict[str, Any]] = []
    for inc in sorted(live):
        report = reports.get(inc) or WorkerReport(inc)  # (a worker between its lease and its report)
        listed.append({
            "incarnation": inc,
            "host": report.host,
            "pid": report.pid,
            "startedAt": report.started_at,
            "leaseMs": view.leases.get(inc, report.lease_ms),
            "leaseAgeMs": max(0, now - report.renewed_at) if report.renewed_at is not None else None,
            "expiresInMs": live[inc] - now,
            "sessions": report.sessions,
            "maxSessions": report.max_sessions,
            "load": round(load(report), 4) if report.max_sessions else None,
            "agents": report.agents,
            "states": report.states,
            "draining": report.draining,
            "stateStore": report.state_store,
        })
    return OrjsonResponse({"workers": listed, "serverTime": now})
