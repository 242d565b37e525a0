"""A route's workspace, named as the reference names it: by id, or by absolute path.

`/workspace/:id/...` and `/workspaces/:workspace/...` take either the workspace id (first 16
hex chars of sha256 of its canonical cwd) or the URL-encoded absolute cwd, canonicalized as
the reference does (`path.resolve` + `realpath`); the official SDK's
`listWorkspaceSessions(cwd)` sends the path form. Anything else is the reference's 400.
"""

from __future__ import annotations

import os

from starlette.requests import Request

from .auth import principal_of
from .responses import ApiError
from .state import app_state

MISMATCH = "workspace_mismatch"


def canonical(path: str) -> str:
    """`path.resolve` + `realpath`: absolute, normalized, symlinks followed."""
    return os.path.realpath(os.path.abspath(path))


def resolve(request: Request, param: str) -> str:
    """The id of the registered workspace the path parameter `param` names (a 400 the
    reference's way when none; a 404 when this caller's token may not see it)."""
    selector = request.path_params[param]
    ws = find(request, selector)
    if ws is None:
        raise mismatch(request, selector, param)
    if not principal_of(request).may(ws):
        raise ApiError(404, f'No workspace with id "{ws}"', "workspace_not_found", workspaceId=ws)
    return ws


def find(request: Request, selector: str) -> str | None:
    """The registered workspace `selector` names by id or by absolute path, if any."""
    workspaces = app_state(request).workspaces
    if selector in workspaces:
        return selector
    if not os.path.isabs(selector):
        return None
    for ws, cwd in workspaces.items():
        if cwd == selector:
            return ws
    wanted = canonical(selector)
    return next((ws for ws, cwd in workspaces.items() if canonical(cwd) == wanted), None)


def mismatch(request: Request, selector: str, param: str) -> ApiError:
    """The reference's answers: a selector that is neither an id nor an absolute path, and
    an absolute path of no registered workspace (worded per route family, as it does)."""
    if not os.path.isabs(selector):
        return ApiError(400, f"`:{param}` must decode to a workspace id or absolute path", MISMATCH)
    settings = app_state(request).settings
    if param == "workspace":
        return ApiError(
            400, "Workspace mismatch: the requested workspace is not registered with this daemon.", MISMATCH,
            workspaceCount=len(settings.workspaces),
        )
    bound = settings.workspaces[0]
    if len(settings.workspaces) > 1:
        return ApiError(
            400,
            f"Workspace mismatch: daemon is bound to {len(settings.workspaces)} workspaces; "
            "none matched the requested workspace.",
            MISMATCH, boundWorkspace=bound, workspaceCount=len(settings.workspaces), requestedWorkspace=canonical(selector),
        )
    return ApiError(
        400, f'Workspace mismatch: daemon is bound to "{bound}"', MISMATCH,
        boundWorkspace=bound, requestedWorkspace=canonical(selector),
    )


def not_registered(selector: str) -> dict:
    """A batch route's member for a selector naming no workspace (the reference's shape)."""
    error = {"code": "workspace_not_found", "message": "Workspace is not registered with this daemon.", "status": 404}
    return {"workspace": selector, "error": error}
