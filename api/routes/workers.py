"""`GET /workers`: the deployment's live workers, for an operator (the Web Shell's deployment
view, dashboards): lease age, sessions, load, from the load report each worker stores with
its lease. Workspace-scoped tokens see only their workspaces, so not this."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

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
        report = reports.get(inc, {})
        sessions, maximum = report.get("sessions", 0), report.get("maxSessions") or 0
        listed.append({
            "incarnation": inc,
            "host": report.get("host"),
            "pid": report.get("pid"),
            "startedAt": report.get("startedAt"),
            "leaseMs": view.leases.get(inc, report.get("leaseMs")),
            "leaseAgeMs": max(0, now - report["renewedAt"]) if "renewedAt" in report else None,
            "expiresInMs": live[inc] - now,
            "sessions": sessions,
            "maxSessions": maximum,
            "load": round(sessions / maximum, 4) if maximum else None,
            "agents": report.get("agents"),
            "states": report.get("states", {}),
            "draining": bool(report.get("draining")),
            "stateStore": report.get("stateStore"),
        })
    return OrjsonResponse({"workers": listed, "serverTime": now})
