"""Live state: `GET /workspaces/:workspace/sessions/live-state` and, for 1 to 20 workspaces
in one request, `POST /sessions/live-state`.

Each workspace's answer carries its `catalogVersion {generation, revision}`, kept in Redis
and moved in the same script as every change it counts, so every API process reports the
same revision for the same state. The version is read before the sessions: a body may be
newer than its version, never older. The body of the GET is cached until a change of the
workspace is announced (or an owner's lease lapses) and answered with an `ETag`: a poller
that sends it back in `If-None-Match` gets a 304 without a body, and without a Redis read.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state.store import CatalogVersion, SessionView

from .. import workspace_ref
from ..auth import principal_of
from ..limits import LIVE_STATE_MAX_WORKSPACES
from ..reads.cache import LIVE_STATE_PAGE, CachedPage
from ..reads.etag import names
from ..reads.listings import cached_page
from ..reads.summaries import live_state_row
from ..responses import ApiError, JSON_TYPE, OrjsonResponse, json_body
from ..state import AppState, app_state

# The reference's: nothing keeps the body; a poller sends the ETag back itself.
CACHE_CONTROL = "no-store"


async def workspace_live_state(request: Request) -> Response:
    state = app_state(request)
    ws = workspace_ref.resolve(request, "workspace")
    page = await _page(state, ws)
    headers = {"ETag": page.etag or "", "Cache-Control": CACHE_CONTROL}
    if page.etag is not None and names(request.headers.get("if-none-match"), page.etag):
        return Response(status_code=304, headers=headers)
    return Response(page.body, media_type=JSON_TYPE, headers=headers)


async def many_live_states(request: Request) -> Response:
    """`{"workspaces": [id or absolute path, ...]}` (1 to 20) -> one entry per workspace, in
    order: its live state, or `{workspace, error: {code, message, status}}`."""
    state = app_state(request)
    body = await json_body(request)
    selectors = body.get("workspaces") if isinstance(body, dict) else None
    if not isinstance(selectors, list) or not selectors or not all(isinstance(s, str) and s for s in selectors):
        raise ApiError(
            400, "body must be {\"workspaces\": [workspace id or absolute path, ...]}", "invalid_live_state_request"
        )
    if len(selectors) > LIVE_STATE_MAX_WORKSPACES:
        raise ApiError(400, f"Select at most {LIVE_STATE_MAX_WORKSPACES} workspaces per request.", "too_many_workspaces")
    principal = principal_of(request)
    found = {selector: workspace_ref.find(request, selector) for selector in selectors}
    found = {selector: ws if ws is not None and principal.may(ws) else None for selector, ws in found.items()}
    wanted = sorted({ws for ws in found.values() if ws is not None})
    states = await state.store.live_states(wanted) if wanted else {}
    answers = []
    for selector in selectors:
        ws = found[selector]
        if ws is None:
            answers.append(workspace_ref.not_registered(selector))
            continue
        version, views = states[ws]
        rows, _ = await _rows(state, views)
        answers.append({"workspace": selector, "workspaceId": ws, "cwd": state.workspaces[ws], **_body(version, rows)})
    return OrjsonResponse({"v": 1, "workspaces": answers})


async def _page(state: AppState, ws: str) -> CachedPage:
    cache = state.locator.cache
    cached = await cached_page(state, ws, *LIVE_STATE_PAGE)
    if cached is not None:
        return cached
    token = await cache.begin_read(ws, ws)
    version, views = (await state.store.live_states([ws]))[ws]
    rows, owners = await _rows(state, views)
    body = orjson.dumps(_body(version, rows))
    page = CachedPage(body, frozenset(owners), etag=f'"{hashlib.blake2b(body, digest_size=12).hexdigest()}"')
    cache.keep_page(ws, *LIVE_STATE_PAGE, token, page)
    return page


async def _rows(state: AppState, views: list[SessionView]) -> tuple[list[dict[str, Any]], set[str]]:
    """The rows of the sessions whose owner's lease holds, and those owners."""
    rows, owners = [], set()
    for view in views:
        if view.told and await state.registry.is_live(view.owner):  # untold: it may be undone
            rows.append(live_state_row(view))
            owners.add(view.owner)
    return rows, owners


def _body(version: CatalogVersion, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"v": 1, "catalogVersion": {"generation": version.generation, "revision": version.revision}, "sessions": rows}
