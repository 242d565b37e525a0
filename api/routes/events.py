"""`GET /session/:id/events`: the session's events as Server-Sent Events.

Framed as the reference frames them (`retry:`, then `id:`/`event:`/`data:`). A client that
sends `Last-Event-ID` gets what it missed from the replay log, then `replay_complete`;
history the log no longer holds is announced (the reference's `state_resync_required`, then
acp-state's `history_truncated`), never skipped silently. Live events arrive through the
process's shared pub/sub connection; a gap in ids is filled from the log (the stream's body:
`streams/session_body.py`; its response: `streams/response.py`).
"""

from __future__ import annotations

import sys
import uuid
from typing import Mapping

from starlette.requests import Request

from acp_state import ids

from ..auth import Principal, principal_of
from ..limits import MAX_SAFE_INTEGER, STREAM_BUFFER_DEFAULT, STREAM_BUFFER_MAX, STREAM_BUFFER_MIN
from ..locator import not_found
from ..responses import parse_decimal
from ..state import AppState, app_state
from ..streams.frames import parse_last_event_id
from ..streams.response import EventStreamResponse
from ..streams.session_body import SessionBody


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
    buffer = min(STREAM_BUFFER_MAX, max(STREAM_BUFFER_MIN, queued)) if queued is not None else STREAM_BUFFER_DEFAULT

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
