"""`GET /metrics`: the API process's Prometheus metrics (its request counts:
`request_metrics.py`), with the deployment's gauges set as the route is read."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from ..auth import principal_of
from ..responses import ApiError
from ..state import app_state

SSE_CLIENTS = Gauge("acp_state_sse_clients", "SSE event streams open on this process")
DEPLOYMENT_SESSIONS = Gauge(
    "acp_state_deployment_sessions",
    "Live sessions of every live worker by state, as of each worker's last heartbeat",
    ["state"],
)
LIVE_WORKERS = Gauge("acp_state_live_workers", "Workers holding a valid lease")
DRAINING_WORKERS = Gauge("acp_state_draining_workers", "Live workers that are draining (their sessions moving away)")


async def metrics(request: Request) -> Response:
    principal = principal_of(request)
    if principal.role != "admin":
        raise ApiError(403, "metrics need an admin token", "forbidden")
    if principal.workspaces is not None:  # counts of every workspace's sessions, as /workers
        raise ApiError(403, "the deployment's metrics are not for a workspace-scoped token", "deployment_scope_required")
    state = app_state(request)
    live = await state.registry.live()
    reports = await state.store.worker_reports(live)
    totals: dict[str, int] = {}
    for report in reports.values():
        for name, count in report.states.items():
            totals[name] = totals.get(name, 0) + count
    for name, count in totals.items():
        DEPLOYMENT_SESSIONS.labels(name).set(count)
    LIVE_WORKERS.set(len(reports))
    DRAINING_WORKERS.set(sum(1 for report in reports.values() if report.draining))
    SSE_CLIENTS.set(state.fanout.listeners)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
