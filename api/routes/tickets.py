"""`POST /stream-tickets {path}`: a single-use ticket that opens one event stream without a
token in its URL (how a ticket is made, verified and spent: `stream_tickets.py`)."""

from __future__ import annotations

from urllib.parse import unquote

from starlette.requests import Request

from ..auth import principal_of
from ..limits import MAX_STREAM_PATH
from ..responses import ApiError, OrjsonResponse, json_body
from ..stream_tickets import STREAM_PATHS


async def create_ticket(request: Request) -> OrjsonResponse:
    """`POST /stream-tickets {path}`: a ticket to open the event stream at `path` (relative
    to the API, as the stream's URL names it, encoded or not) once, within 60 s."""
    body = await json_body(request)
    given = body.get("path") if isinstance(body, dict) else None
    if not isinstance(given, str) or not given or len(given) > MAX_STREAM_PATH:
        raise ApiError(400, "`path` must name an event stream", "invalid_stream_path")
    path = "/" + unquote(given.split("?", 1)[0]).lstrip("/")
    if not STREAM_PATHS.fullmatch(path):
        raise ApiError(400, "`path` must name an event stream", "invalid_stream_path")
    ticket, expires = request.app.tickets.issue(principal_of(request), path)
    return OrjsonResponse({"ticket": ticket, "expiresAt": expires, "path": path})
