"""Session history: the paginated transcript, and reload with refresh-append (spec §2.2).

The transcript outlives the worker (its own retention); a reload of a live, idle session
with no pending interaction replays the newest transcript page and appends the stored
`turn_error` event at the end, unless newer turn content superseded it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state import ids

from .auth import principal_of
from .locator import not_found
from .responses import ApiError, OrjsonResponse, json_body, parse_decimal
from .resume import attach_or_resume
from .session_requests import client_id_header
from .state import app_state
from .summaries import live_summary

DEFAULT_PAGE = 100
MAX_PAGE = 500
_STREAM_ID = re.compile(r"\A([0-9]{1,20})-([0-9]{1,20})\Z")
MAX_STREAM_PART = 2**64 - 1


def _page_size(value: Any, default: int = DEFAULT_PAGE) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        value = parse_decimal(value, MAX_PAGE)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PAGE:
        raise ApiError(400, f"page size must be an integer from 1 to {MAX_PAGE}", "invalid_limit")
    return value


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


def _record(raw: str) -> dict[str, Any]:
    """A transcript record as the reference pages them: `{v, type, data}`."""
    envelope = orjson.loads(raw)
    return {"v": 1, "type": envelope["type"], "data": envelope["data"]}


def _replayed(entry_id: str, raw: str) -> dict[str, Any]:
    """A transcript record as a load replays it: with its time, `_meta.serverTimestamp`
    (epoch ms, when the worker recorded it; a record kept without one takes its entry id's
    time, the same moment), which the reference's Web Shell shows as the message's time and
    measures a turn's length by. The reference stamps its replayed entries so too."""
    envelope = orjson.loads(raw)
    meta = envelope.get("_meta")
    stamp = meta.get("serverTimestamp") if isinstance(meta, dict) else None
    if not isinstance(stamp, int):
        stamp = int(entry_id.partition("-")[0])
    return {"v": 1, "type": envelope["type"], "data": envelope["data"], "_meta": {"serverTimestamp": stamp}}


async def transcript(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    limit = _page_size(request.query_params.get("limit"))
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
        "events": [_record(raw) for _, raw in reversed(page)],  # oldest first within a page
        "hasMore": len(entries) > limit,
    }
    if body["hasMore"]:
        body["nextCursor"] = page[-1][0]
    if row is not None:
        body["startTime"] = row["createdAt"]
        body["lastUpdated"] = row["updatedAt"]
    return OrjsonResponse(body)


async def load(request: Request) -> Response:
    """`POST /session/:id/load`, with `historyReplay: "response"`: a live session is
    attached; a persisted one is resumed first (api/resume.py), then answered alike."""
    state = app_state(request)
    sid = request.path_params["id"]
    client_id = client_id_header(request) or ids.new_client_id()
    body = await json_body(request, required=False)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request")
    page_size = _page_size(body.get("historyPageSize"))
    ref, attached = await attach_or_resume(state, sid, principal_of(request), client_id)
    snapshot = await state.store.load_snapshot(ref.ws, sid, page_size)
    view, page = snapshot.view, snapshot.page
    if view is None:
        raise not_found(sid)
    summary = live_summary(view)
    if summary["pendingInteractionCount"] or summary["hasActivePrompt"]:
        # Persisted pages cannot show pending interactions or a running turn: replay the log.
        replay = [orjson.loads(raw) for raw in snapshot.log]
        has_more = False
    else:
        replay = [_replayed(entry_id, raw) for entry_id, raw in reversed(page[:page_size])]
        has_more = len(page) > page_size
        if view.turn_error_event is not None:
            replay.append(view.turn_error_event)
    answer = {
        "sessionId": sid,
        "workspaceCwd": summary["workspaceCwd"],
        "attached": attached,
        "clientId": client_id,
        "createdAt": summary["createdAt"],
        "state": {},
        "hasRunningBackgroundTasks": False,
        "hasActivePrompt": summary["hasActivePrompt"],
        "compactedReplay": replay,
        "liveJournal": [],
        "lastEventId": view.last_event_id,
        "eventEpoch": view.epoch,
    }
    if has_more:  # as the reference: only when there is more
        answer["historyHasMore"] = True
    return OrjsonResponse(answer)
