"""The Starlette application of one API process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount, Route
from starlette.types import Receive, Scope, Send

from acp_state.store import STORE_ERRORS, Change, RedisStore, WorkerRegistry, run_sweeper

from . import hot_reads, stream_tickets
from .auth import TICKET_PRINCIPAL, Authenticator, AuthMiddleware
from .locator import SessionLocator
from .origins import Edge, cors_send
from .reads.cache import StateCache
from .reads.etag import ETagMiddleware
from .reads.worker_reports import LiveReports
from .reference_shell import ReferenceShell
from .request_metrics import RequestCounts, RequestMetrics
from .responses import (
    ApiError,
    api_error_handler,
    internal_error_handler,
    store_error_handler,
)
from .routes import (
    approval_mode,
    attention,
    catalog,
    discovery,
    events,
    history,
    live_feed,
    live_state,
    metrics,
    openapi,
    pending_prompts,
    permissions,
    presence,
    resume,
    session_context,
    sessions,
    supported_commands,
    tickets,
    turns,
    unconfigured,
    web,
    workers,
    workspaces,
)
from .settings import Settings
from .state import AppState
from .stream_tickets import TicketError, Tickets
from .streams.attention_hub import AttentionFeeds
from .streams.live_state_hub import LiveFeeds
from .streams.response import DIRECT_SEND

log = logging.getLogger("api")

# The routes dashboards poll all day come first: Starlette tries the routes in order, and
# matching was a tenth of a status request's time in a profile (py-spy, 8 s under wrk).
ROUTES = [
    Route("/session/{id}/status", sessions.status, methods=["GET"]),
    Route("/workspace/{id:path}/sessions", workspaces.list_sessions, methods=["GET"]),
    Route("/workspaces/{workspace:path}/sessions/live-state", live_state.workspace_live_state, methods=["GET"]),
    Route("/sessions/live-state", live_state.many_live_states, methods=["POST"]),
    Route("/workspaces/{workspace:path}/sessions/live-state/events", live_feed.live_state_events, methods=["GET"]),
    Route("/attention", attention.attention_page, methods=["GET"]),
    Route("/attention/events", attention.attention_events, methods=["GET"]),
    Route("/workers", workers.workers, methods=["GET"]),
    Route("/sessions/catalog", catalog.batch_catalog, methods=["POST"]),
    Route("/session/{id}/turns/current", turns.current, methods=["GET"]),
    Route("/session/{id}/turns/{promptId}", turns.by_prompt, methods=["GET"]),
    Route("/health", discovery.health, methods=["GET"]),
    Route("/health/ready", discovery.ready, methods=["GET"]),
    Route("/capabilities", discovery.capabilities, methods=["GET"]),
    Route("/session", sessions.create_session, methods=["POST"]),
    Route("/session/{id}", sessions.close, methods=["DELETE"]),
    Route("/session/{id}/prompt", sessions.prompt, methods=["POST"]),
    Route("/session/{id}/cancel", sessions.cancel, methods=["POST"]),
    Route("/session/{id}/heartbeat", presence.heartbeat, methods=["POST"]),
    Route("/session/{id}/detach", presence.detach, methods=["POST"]),
    Route("/session/{id}/pending-prompts", pending_prompts.pending_prompts, methods=["GET"]),
    Route("/session/{id}/supported-commands", supported_commands.supported_commands, methods=["GET"]),
    Route("/session/{id}/approval-mode", approval_mode.set_approval_mode, methods=["POST"]),
    Route("/session/{id}/pending-prompts/{promptId}", pending_prompts.remove_pending_prompt, methods=["DELETE"]),
    Route("/session/{id}/events", events.stream_events, methods=["GET"]),
    Route("/session/{id}/transcript", history.transcript, methods=["GET"]),
    Route("/session/{id}/load", resume.load, methods=["POST"]),
    Route("/session/{id}/resume", resume.resume_session, methods=["POST"]),
    Route("/session/{id}/context", session_context.context, methods=["GET"]),
    Route("/session/{id}/context-usage", session_context.context_usage, methods=["GET"]),
    Route("/session/{id}/goal", unconfigured.session_goal, methods=["GET"]),
    Route("/session/{id}/permission/{requestId}", permissions.vote_in_session, methods=["POST"]),
    Route("/permission/{requestId}", permissions.vote_legacy, methods=["POST"]),
    Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
    Route("/metrics", metrics.metrics, methods=["GET"]),
    Route("/stream-tickets", tickets.create_ticket, methods=["POST"]),
    Route("/brand", unconfigured.brand, methods=["GET"]),
    Route("/goals", unconfigured.goals, methods=["GET"]),
    Route("/workspace/settings", unconfigured.settings, methods=["GET"]),
    Route("/workspace/extensions", unconfigured.extensions, methods=["GET"]),
    Route("/workspace/extensions/operations", unconfigured.extension_operations, methods=["GET"]),
]
# The event streams whose routes open them below Starlette's stack (`ApiApp.opened_stream`):
# each is held for hours, and would hold the stack's frames with it.
BELOW_THE_STACK = (events.stream_events, live_feed.live_state_events)
# acp-state's own Web Shell, unless `--web-shell` names another build (`reference_shell`).
OWN_SHELL = [
    Route("/", web.index, methods=["GET"]),
    Mount("/static", web.static_files, name="static"),
]


def end_streams(app: Starlette) -> None:
    """Shutdown begins (SIGTERM): end every event stream now, cleanly, rather than have the
    server cancel it after its grace period; clients resume on another API process with
    `Last-Event-ID` and miss nothing."""
    state = getattr(app.state, "acp", None)
    if state is not None:
        state.fanout.end_listeners()
        state.feeds.end()
        state.attention.end()


class ApiApp(Starlette):
    """The API's Starlette app, whose hottest reads skip its stack while they are current in
    this process's cache (`hot_reads`), and whose session streams and live feeds are opened
    by their routes below it (`opened_stream`); every other request goes through the stack."""

    def __init__(self, authenticator: Authenticator, counts: RequestCounts, edge: Edge, tickets: Tickets,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The table's own routes of the streams served below the stack (`opened_stream`).
        self.below_the_stack = [r for r in self.routes if isinstance(r, Route) and r.endpoint in BELOW_THE_STACK]
        self.authenticator = authenticator
        self.counts = counts
        self.edge = edge  # the Host and Origin checks, and the CORS answers (`origins`)
        self.tickets = tickets  # the event streams' single-use tickets (`stream_tickets`)
        # What the lifespan set up (also `state.acp`, for the routes), read here without
        # Starlette's `State.__getattr__`, which raises and catches an AttributeError on
        # every request: a tenth of a kept read's whole cost.
        self.acp: AppState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # First, for every path (the hot reads and the streams below the stack too): the
            # Host and Origin checks, and an event stream's ticket.
            checked = self.edge.check(scope)
            if checked is not None:
                if not isinstance(checked, bytes):  # refused, or an allowed origin's preflight
                    await checked(scope, receive, send)
                    return
                send = cors_send(send, checked)
            if b"ticket=" in scope["query_string"]:
                ticket = stream_tickets.presented(scope)
                if ticket is not None and not await self._redeemed(scope, receive, send, ticket):
                    return
        state = self.acp
        if await hot_reads.answer(state, self.authenticator, self.counts, scope, send):
            return
        # An open stream is awaited from this frame, none between (each would be held for hours).
        stream = await self.opened_stream(scope, receive)
        if stream is not None:
            await stream(scope, receive, send)
            return
        # An event stream whose start and first frame have passed every middleware (they look
        # at the start only, and let streams through) writes its later frames straight to the
        # server's send: a change to a thousand streams is a thousand writes, and each would
        # cross five wrappers for nothing.
        scope[DIRECT_SEND] = send
        await super().__call__(scope, receive, send)

    async def _redeemed(self, scope: Scope, receive: Receive, send: Send, ticket: str) -> bool:
        """Spend the stream ticket and keep its principal in the scope for the stream; False:
        refused (401, or a store error's 503), answered."""
        if self.acp is None:
            return True  # not started: the app answers (and a ticket opens nothing without a principal)
        try:
            scope[TICKET_PRINCIPAL] = await stream_tickets.redeem(self.tickets, self.acp.store, scope, ticket)
        except TicketError as refused:
            await refused.response()(scope, receive, send)
            return False
        except STORE_ERRORS as error:
            await (await store_error_handler(Request(scope, receive), error))(scope, receive, send)
            return False
        return True

    async def opened_stream(self, scope: Scope, receive: Receive) -> Response | None:
        """An event stream served below Starlette's stack by its own route in the table
        (`BELOW_THE_STACK`), matched as the router matches it and opened by the route's
        endpoint: ready to be called as an ASGI app. None: not such a route, or refused
        (nothing sent: the app serves it through the stack, and answers a refusal, such as
        no token, no such session or a store error, its way).

        Why below the stack: an open stream holds every frame of the stack it was called
        through for its whole life. Starlette's error middleware, routing, our four
        middlewares and their send wrappers held more than the stream itself (13.3 KB of
        Python heap a session stream through the stack, 5.5 KB below it; a live feed 31 KB
        of RSS through it on granian: `python -m bench.stream_memory`); the caller awaits the
        stream itself, so not even this frame is held. Same token check and the same count
        as the stack gives the route; every other request pays one string test here."""
        state = self.acp
        if state is None or scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].endswith("/events"):
            return None
        for route in self.below_the_stack:
            matched, child_scope = route.matches(scope)
            if matched is Match.FULL:
                break
        else:
            return None
        principal = self.authenticator.principal(scope)
        if principal is None:
            return None
        # The route's request gets a scope of its own: what it adds (the path's parameters,
        # the principal, a copy of the headers list) would stay in the server's scope, which
        # the server keeps for the stream's whole life.
        route_scope = {**scope, **child_scope, "app": self, "state": {**scope.get("state", {}), "principal": principal}}
        try:
            response = await route.endpoint(Request(route_scope, receive))
        except (ApiError, *STORE_ERRORS):  # the app meets it again and answers it its way
            return None
        except Exception:  # a bug of this shortcut: said, and the stream served by the app all the same
            log.exception("opening %s below the stack failed; the app serves it", scope["path"])
            return None
        self.counts.add(route.endpoint.__name__, 200)  # under the route's name, as RequestMetrics counts it
        return response


def create_app(settings: Settings, store: RedisStore | None = None) -> ApiApp:
    """Build the app; without `store` it connects to `settings.redis_url` at startup."""

    @contextlib.asynccontextmanager
    async def lifespan(app: ApiApp) -> AsyncIterator[None]:
        own_store = store or RedisStore.from_url(settings.redis_url)
        registry = WorkerRegistry(own_store)
        fanout = own_store.fanout()
        cache = StateCache(fanout)
        cwds = settings.workspace_cwds()
        feeds = LiveFeeds(own_store, registry, fanout)
        inbox = AttentionFeeds(own_store, registry, fanout, cwds)

        def changed(change: Change) -> None:
            cache.changed(change.ws, change.sid)  # first: nothing this process serves after may be older
            feeds.changed(change)
            inbox.changed(change.ws, change.sid)

        def reset() -> None:
            cache.clear()
            feeds.reset()
            inbox.reset()

        fanout.on_change, fanout.on_reset = changed, reset
        app.state.acp = app.acp = AppState(
            settings=settings,
            store=own_store,
            registry=registry,
            locator=SessionLocator(own_store, registry, cache),
            workspaces=cwds,
            fanout=fanout,
            feeds=feeds,
            attention=inbox,
            reports=LiveReports(own_store, registry),
        )
        stop = asyncio.Event()
        sweeper = asyncio.ensure_future(run_sweeper(own_store, settings.sweep_interval_s, stop))
        pruner = asyncio.ensure_future(presence.run_pruner(own_store, list(cwds), settings.presence_prune_s, stop))
        try:
            yield
        finally:
            stop.set()
            await sweeper
            await pruner
            feeds.stop()
            inbox.stop()
            await fanout.stop()
            if store is None:
                await own_store.close()

    authenticator, counts = Authenticator(settings.tokens), RequestCounts()
    edge = Edge(settings.host, settings.allow_origins, has_token=bool(settings.tokens))
    return ApiApp(
        authenticator,
        counts,
        edge,
        Tickets(settings.tokens),
        routes=ROUTES + (OWN_SHELL if settings.web_shell is None else ReferenceShell(settings.web_shell).routes()),
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error_handler,
            # Every error of the store: 503 store_full (out of memory) or store_unavailable
            # (unreachable, stalled, loading, read-only, a cluster failing over), else 500.
            **{kind: store_error_handler for kind in STORE_ERRORS},
            # Starlette runs this one outermost (ServerErrorMiddleware), so it also answers
            # what a middleware raised: JSON 500 `internal_error`, never text/plain.
            Exception: internal_error_handler,
        },
        middleware=[
            Middleware(RequestMetrics, counts=counts),
            Middleware(ETagMiddleware),
            Middleware(AuthMiddleware, authenticator=authenticator),
        ],
    )
