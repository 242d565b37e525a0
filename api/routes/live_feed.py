"""`GET /workspaces/:workspace/sessions/live-state/events`: a workspace's live state, pushed
by the process's hub of that workspace (`streams/live_state_hub.py`, which tells the frames,
the ids and the resume), to a stream that starts with a snapshot or what a resume missed."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import workspace_ref
from ..state import app_state
from ..streams import ids as stream_ids
from ..streams.hub import Listener, frames, stream_response

GENERATION_HEADER = "X-Acp-Catalog-Generation"


async def live_state_events(request: Request) -> Response:
    state = app_state(request)
    ws = workspace_ref.resolve(request, "workspace")
    point = resume_point(request)
    feed = await state.feeds.feed(ws)
    listener = Listener()
    feed.add(listener)  # what the feed pushes from here on queues behind the first frame
    try:
        first = feed.snapshot() if point is None else await feed.resume(*point)
    except BaseException:
        feed.remove(listener)
        raise
    body = frames(listener, first, feed)
    return stream_response(body, state.settings.sse_send_timeout_s, {GENERATION_HEADER: feed.generation})


def resume_point(request: Request) -> tuple[int, str | None] | None:
    """The revision and generation a client resumes from, if it resumes: its last event id
    (`Last-Event-ID`, else `?lastEventId=`), whose generation wins over one sent beside it
    (`?generation=` or the header): a browser's reconnect repeats the URL it first opened."""
    point = stream_ids.parse(request.headers.get("last-event-id") or request.query_params.get("lastEventId"))
    if point is None:
        return None
    revision, generation = point
    return revision, generation or request.query_params.get("generation") or request.headers.get(GENERATION_HEADER)
