"""`acp_state_http_requests_total`: every request the app answers, counted by route (the
endpoint's name, never the raw path) and status; served by `GET /metrics` (`routes/metrics.py`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from acp_state.metrics import Tally

REQUESTS = Tally("acp_state_http_requests_total", "HTTP requests answered", ("route", "status"))


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
