"""The API process's Prometheus metrics and its `GET /metrics` route."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from acp_state.metrics import Tally

from .auth import principal_of
from .responses import ApiError
from .state import app_state

REQUESTS = Tally("acp_state_http_requests_total", "HTTP requests answered", ("route", "status"))
SSE_CLIENTS = Gauge("acp_state_sse_clients", "SSE event streams open on this process")
DEPLOYMENT_SESSIONS = Gauge(
    "acp_state_deployment_sessions",
    "Live sessions of every live worker by state, as of each worker's last heartbeat",
    ["state"],
)
LIVE_WORKERS = Gauge("acp_state_live_workers", "Workers holding a valid lease")
DRAINING_WORKERS = Gauge("acp_state_draining_workers", "Live workers that are draining (their sessions moving away)")


class RequestCounts:
    """`acp_state_http_requests_total` of one app, by route (the endpoint's name, never the
    raw path) and status."""

    def add(self, route: str, status: int) -> None:
        REQUESTS.inc(route, status)


class RequestMetrics:
    """Counts every request the app's routes answer."""

    def __init__(self, app: ASGIApp, counts: RequestCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            counted = True
            self.counts.add(getattr(scope.get("endpoint"), "__name__", "unmatched"), status)

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start" and not counted:
                count(message["status"])  # before the client can have the answer and scrape
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            if not counted:  # it raised before answering: the server's 500
                count(500)


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
