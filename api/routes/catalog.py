"""The batch catalog: `POST /sessions/catalog`, one listing page of up to 20 workspaces.

Request (the reference's schema, strict): `{"workspaces": "all" | [{"workspace": id or
absolute path, "cursor"?}], "options"?: {"size"?, "archiveState"?, ...}, "includeGroups"?}`.
Answer: `{"workspaces": [...]}`, one member per selection in order: `{workspace,
workspaceId, cwd, sessions, nextCursor?}` as `GET /workspace/:id/sessions` pages them, or
`{workspace, workspaceId?, cwd?, error: {code, message, status}}`.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .. import session_source, workspace_ref
from ..auth import principal_of
from ..limits import CATALOG_MAX_WORKSPACES, LISTING_DEFAULT_SIZE, LISTING_MAX_SIZE
from ..reads.listings import decode_cursor, filtered_page, listing
from ..responses import ApiError, OrjsonResponse, json_body
from ..state import app_state

INVALID = "invalid_session_catalog_request"
OPTIONS = {"size", "archiveState", "view", "group", "parentSessionId", "sourceType", "sourceId"}
# Session organization (groups, organized view, child sessions) is not kept here; sources are
# (api/session_source.py).
UNSUPPORTED_OPTIONS = ("view", "group", "parentSessionId")


def _invalid(reason: str = "Invalid session catalog request.") -> ApiError:
    return ApiError(400, reason, INVALID)


def _selections(body: Any) -> tuple[list[dict[str, Any]] | str, dict[str, Any], bool]:
    if not isinstance(body, dict) or set(body) - {"workspaces", "options", "includeGroups"}:
        raise _invalid()
    workspaces, options = body.get("workspaces"), body.get("options", {})
    include_groups = body.get("includeGroups", False)
    if not isinstance(include_groups, bool) or not isinstance(options, dict) or set(options) - OPTIONS:
        raise _invalid()
    if workspaces != "all":
        if not isinstance(workspaces, list) or not workspaces:
            raise _invalid()
        for item in workspaces:
            if (
                not isinstance(item, dict) or set(item) - {"workspace", "cursor"}
                or not isinstance(item.get("workspace"), str) or not 1 <= len(item["workspace"]) <= 4096
                or not isinstance(item.get("cursor", ""), str)
            ):
                raise _invalid()
        if len(workspaces) > CATALOG_MAX_WORKSPACES:
            raise ApiError(400, f"Select at most {CATALOG_MAX_WORKSPACES} workspaces per request.", "too_many_workspaces")
    size = options.get("size", LISTING_DEFAULT_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= LISTING_MAX_SIZE:
        raise _invalid()
    if options.get("archiveState", "active") not in ("active", "archived"):
        raise _invalid()
    try:
        session_source.parse(options.get("sourceType"), options.get("sourceId"))
    except ApiError as error:  # the reference's code here, with the source's reason
        raise _invalid(error.body["error"]) from None
    unsupported = [name for name in UNSUPPORTED_OPTIONS if name in options]
    if unsupported:
        raise _invalid(f"acp-state keeps no session organization: {', '.join(unsupported)} cannot be used")
    return workspaces, options, include_groups


async def batch_catalog(request: Request) -> Response:
    state = app_state(request)
    workspaces, options, include_groups = _selections(await json_body(request))
    principal = principal_of(request)
    if workspaces == "all":
        workspaces = [{"workspace": cwd} for ws, cwd in state.workspaces.items() if principal.may(ws)]
    size, archived = options.get("size", LISTING_DEFAULT_SIZE), options.get("archiveState") == "archived"
    members = []
    for item in workspaces:
        selector = item["workspace"]
        ws = workspace_ref.find(request, selector)
        if ws is None or not principal.may(ws):
            members.append(workspace_ref.not_registered(selector))
            continue
        member: dict[str, Any] = {"workspace": selector, "workspaceId": ws, "cwd": state.workspaces[ws]}
        try:
            offset = decode_cursor(item["cursor"]) if "cursor" in item else 0
        except ApiError as error:
            members.append({**member, "error": {"code": "invalid_cursor", "message": error.body["error"], "status": 400}})
            continue
        if archived:
            page: dict[str, Any] = {"sessions": []}
        elif options.get("sourceType") is not None:
            page = await filtered_page(state, ws, offset, size, options["sourceType"], options.get("sourceId"))
        else:
            page = orjson.loads(await listing(state, ws, offset, size))
        members.append({**member, **page, **({"groups": []} if include_groups else {})})
    return OrjsonResponse({"workspaces": members})
