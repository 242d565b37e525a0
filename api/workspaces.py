"""`GET /workspace/:id/sessions`: persisted rows with live runtime merged in (spec §1.3)."""

from __future__ import annotations

import base64

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state import ids
from acp_state.summary import live_summary, merged_row, persisted_row

from .auth import principal_of
from .cache import CachedPage
from .responses import ApiError, OrjsonResponse, parse_decimal
from .state import app_state

DEFAULT_SIZE = 20
MAX_SIZE = 100


def encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"o:{offset}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, offset = text.partition(":")
        if kind != "o" or not offset.isdigit() or len(offset) > 9:
            raise ValueError(cursor)
        return int(offset)
    except ValueError:
        raise ApiError(400, "cursor is not one this daemon issued", "invalid_cursor") from None


async def list_sessions(request: Request) -> Response:
    state = app_state(request)
    ws = request.path_params["id"]
    if not ids.is_workspace_id(ws) or ws not in state.workspaces or not principal_of(request).may(ws):
        raise ApiError(404, f'No workspace with id "{ws}"', "workspace_not_found", workspaceId=ws)
    query = request.query_params
    size = parse_decimal(query.get("size", str(DEFAULT_SIZE)), MAX_SIZE)
    if size is None or size < 1:
        raise ApiError(400, f"size must be an integer from 1 to {MAX_SIZE}", "invalid_size")
    archive_state = query.get("archiveState", "active")
    if archive_state not in ("active", "archived"):
        raise ApiError(400, "archiveState must be 'active' or 'archived'", "invalid_archive_state")
    if archive_state == "archived":
        return OrjsonResponse({"sessions": []})  # nothing is ever archived here
    offset = decode_cursor(query["cursor"]) if "cursor" in query else 0

    cached = state.locator.cache.page(ws, offset, size)
    if cached is not None and all([await state.registry.is_live(owner) for owner in cached.owners]):
        return Response(cached.body, media_type="application/json")
    token = await state.locator.cache.begin_read(ws, ws)
    page = await state.store.list_page(ws, offset, size)
    sessions, owners = [], set()
    cwd = state.workspaces[ws]
    for listed in page[:size]:
        row = {"sessionId": listed.sid, "workspaceCwd": cwd, **listed.row} if listed.row else None
        view = listed.view
        live = view is not None and await state.registry.is_live(view.owner)
        if row is None and not live:
            continue
        if live:
            assert view is not None
            owners.add(view.owner)
            summary = live_summary(view)
            sessions.append(merged_row(row, summary) if row else summary)
        else:
            sessions.append(persisted_row(row))  # type: ignore[arg-type]
    listing: dict[str, object] = {"sessions": sessions}
    if len(page) > size:
        listing["nextCursor"] = encode_cursor(offset + size)
    body = orjson.dumps(listing)
    # Kept until a change in the workspace arrives, or one of these owners' leases lapses.
    state.locator.cache.keep_page(ws, offset, size, token, CachedPage(body, frozenset(owners)))
    return Response(body, media_type="application/json")
