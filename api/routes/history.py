"""`GET /session/:id/transcript`: a session's history, paginated (spec §2.2). The transcript
outlives the worker (its own retention); a reload (`POST /session/:id/load`) replays it:
`routes/resume.py`."""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state import ids

from ..auth import principal_of
from ..locator import not_found
from ..responses import ApiError, OrjsonResponse
from ..state import app_state
from ..transcript_records import asked_page_size, record
_STREAM_ID = re.compile(r"\A([0-9]{1,20})-([0-9]{1,20})\Z")
MAX_STREAM_PART = 2**64 - 1


def _cursor(value: str | None) -> str | None:
    """A transcript cursor: an entry id `<ms>-<seq>` (two 64-bit unsigned integers) above
    `0-0`. Anything else would make Redis refuse the range (a 500), so it is a 400 here."""
    if value is None:
        return None
    match = _STREAM_ID.match(value)
    parts = [int(part) for part in match.groups()] if match else []
    if not parts or max(parts) > MAX_STREAM_PART or parts == [0, 0]:
        raise ApiError(400, "cursor is not one this daemon issued", "invalid_cursor")
    return value


async def transcript(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    limit = asked_page_size(request.query_params.get("limit"))
    cursor = _cursor(request.query_params.get("cursor"))
    ws = await state.locator.workspace_of(sid, principal_of(request)) if ids.is_token(sid) else None
    if ws is None:
        raise not_found(sid)
    entries, row = await state.store.transcript_page(ws, sid, cursor, limit)
    if row is None and not entries:
        raise not_found(sid)
    page = entries[:limit]
    body: dict[str, Any] = {
        "v": 1,
        "sessionId": sid,
        "events": [record(raw) for _, raw in reversed(page)],  # oldest first within a page
        "hasMore": len(entries) > limit,
    }
    if body["hasMore"]:
        body["nextCursor"] = page[-1][0]
    if row is not None:
        body["startTime"] = row["createdAt"]
        body["lastUpdated"] = row["updatedAt"]
    return OrjsonResponse(body)
