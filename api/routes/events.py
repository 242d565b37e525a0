"""`GET /session/:id/events`: the session's events as Server-Sent Events.

Framed as the reference frames them (`retry:`, then `id:`/`event:`/`data:`). A client that
sends `Last-Event-ID` gets what it missed from the replay log, then `replay_complete`;
history the log no longer holds is announced (the reference's `state_resync_required`, then
acp-state's `history_truncated`), never skipped silently. Live events arrive through the
process's shared pub/sub connection; a gap in ids is filled from the log (the stream's body:
`streams/session_body.py`; its response: `streams/response.py`).
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Mapping

from starlette.datastructures import Headers, QueryParams
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from acp_state import ids
from acp_state.store import STORE_ERRORS

from ..auth import Authenticator, Principal, principal_of
from ..limits import MAX_SAFE_INTEGER
from ..locator import not_found
from ..request_metrics import RequestCounts
from ..responses import ApiError, parse_decimal
from ..state import AppState, app_state
from ..streams.frames import parse_last_event_id
from ..streams.response import EventStreamResponse
from ..streams.session_body import SessionBody

log = logging.getLogger("api.events")

async def stream_events(request: Request) -> EventStreamResponse:
    return await open_stream(
        app_state(request), request.path_params["id"], principal_of(request), request.headers, request.query_params
    )


async def open_stream(
    state: AppState, sid: str, principal: Principal, headers: Mapping[str, str], query: Mapping[str, str]
) -> EventStreamResponse:
    """Session `sid`'s event stream for `principal`, subscribed, its state read: ready to
    send. ApiError 404 if the principal may not see the session, or it is neither live nor
    asked for from an event id (a replay of a session that ended). A burst of opens runs a
    few at a time (`StreamOpens.admitted`)."""
    async with state.stream_opens.admitted():
        return await _open_stream(state, sid, principal, headers, query)


async def _open_stream(
    state: AppState, sid: str, principal: Principal, headers: Mapping[str, str], query: Mapping[str, str]
) -> EventStreamResponse:
    last_id = parse_last_event_id(headers.get("last-event-id"))
    # The reference's SDK sends the epoch as a header beside Last-Event-ID; ours as a query.
    epoch_hint = query.get("eventEpoch") or headers.get("x-qwen-event-epoch")
    queued = parse_decimal(query.get("maxQueued"), MAX_SAFE_INTEGER)
    buffer = min(2048, max(16, queued)) if queued is not None else 256

    ws = await state.locator.workspace_of(sid, principal) if ids.is_token(sid) else None
    if ws is None:
        raise not_found(sid)
    # One string for the streams of a session, not a copy each (held for the stream's life).
    ws, sid = sys.intern(ws), sys.intern(sid)
    subscription = await state.fanout.subscribe_session(ws, sid, buffer)
    try:
        # Read state only after the subscription is confirmed: nothing can fall in between.
        view = await state.stream_opens.session(state.store, ws, sid)
        live = view is not None and await state.registry.is_live(view.owner)
        if not live and last_id is None:
            raise not_found(sid)
    except BaseException:
        await state.fanout.unsubscribe(subscription)
        raise
    body = SessionBody(state.store, state.fanout, ws, sid, view, live, last_id, epoch_hint, subscription)
    # The reference's headers: its SDK reads the epoch before the first frame, and the
    # stream id names this one connection (a resumed stream gets a new one).
    sent = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no", "X-Qwen-SSE-Stream-Id": str(uuid.uuid4())}
    if view is not None:
        sent["X-Qwen-Event-Epoch"] = view.epoch
    return EventStreamResponse(body, state.settings.sse_send_timeout_s, sent, subscription)


async def answer(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope, receive: Receive,
                 send: Send) -> bool:
    """Serve `GET /session/:id/events` below Starlette's stack (`opened`, then the stream);
    False: not served, nothing sent, the app must serve it."""
    response = await opened(state, auth, counts, scope)
    if response is None:
        return False
    await response(scope, receive, send)
    return True


async def opened(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope) -> EventStreamResponse | None:
    """`GET /session/:id/events` opened below Starlette's stack, ready to be called as an
    ASGI app; None: not this route, or refused (nothing sent: the app must serve it). An
    open stream holds every frame of the stack it was called through for its whole life:
    Starlette's error middleware, routing, our four middlewares and their send wrappers held
    more than the stream itself (13.3 KB of Python heap a stream through the stack, 5.5 KB
    below it: `python -m bench.stream_memory`); the caller awaits the stream itself, so not
    even this frame is held. The stream gets the same token check and the same count as the
    route; anything the route would refuse (no token, no such session, a store error) is
    left to the app, which answers it its way."""
    if state is None or scope["type"] != "http" or scope["method"] != "GET":
        return None
    path: str = scope["path"]
    if not (path.startswith("/session/") and path.endswith("/events")):
        return None
    sid, principal = path[9:-7], auth.principal(scope)
    if not sid or "/" in sid or principal is None:
        return None
    try:
        # Headers of the scope's list, not `Headers(scope=)`: that copies the list into the
        # scope, which the server keeps for the stream's whole life.
        headers = Headers(raw=scope["headers"])
        response = await open_stream(state, sid, principal, headers, QueryParams(scope["query_string"]))
    except (ApiError, *STORE_ERRORS):  # the app meets it again and answers it its way
        return None
    except Exception:  # a bug of this shortcut: said, and the stream served by the app all the same
        log.exception("opening the event stream of %s below the stack failed; the app serves it", sid)
        return None
    counts.add(stream_events.__name__, 200)  # under the route's name, as its answer starts (RequestMetrics)
    return response
