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
    reference's way when none). A workspace the caller's token may not see is none: it is
    answered exactly as one that is not registered, so no answer tells a scoped token which
    paths or ids are another tenant's."""
    selector = request.path_params[param]
    ws = find(request, selector)
    if ws is None:
        raise mismatch(request, selector, param)
    return ws


def visible(request: Request) -> dict[str, str]:
    """The registered workspaces (id -> cwd, in registration order) the caller may see."""
    workspaces = app_state(request).workspaces
    principal = principal_of(request)
    if principal.workspaces is None:
        return workspaces
    return {ws: cwd for ws, cwd in workspaces.items() if principal.may(ws)}


def find(request: Request, selector: str) -> str | None:
    """The registered workspace the caller may see that `selector` names by id or by
    absolute path, if any."""
    workspaces = visible(request)
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
    an absolute path of no registered workspace (worded per route family, as it does).

    They name the workspaces the daemon is bound to, so they name only those the caller may
    see (a scoped token's own), count only those, and echo the requested path without
    reading the file system for it (its real path could name another tenant's directory)."""
    if not os.path.isabs(selector):
        return ApiError(400, f"`:{param}` must decode to a workspace id or absolute path", MISMATCH)
    bound_to = list(visible(request).values())
    scoped = principal_of(request).workspaces is not None
    requested = os.path.normpath(selector) if scoped else canonical(selector)
    if param == "workspace":
        return ApiError(
            400, "Workspace mismatch: the requested workspace is not registered with this daemon.", MISMATCH,
            workspaceCount=len(bound_to),
        )
    if not bound_to:
        return ApiError(
            400, "Workspace mismatch: the requested workspace is not registered with this daemon.", MISMATCH,
            workspaceCount=0, requestedWorkspace=requested,
        )
    bound = bound_to[0]
    if len(bound_to) > 1:
        return ApiError(
            400,
            f"Workspace mismatch: daemon is bound to {len(bound_to)} workspaces; "
            "none matched the requested workspace.",
            MISMATCH, boundWorkspace=bound, workspaceCount=len(bound_to), requestedWorkspace=requested,
        )
    return ApiError(
        400, f'Workspace mismatch: daemon is bound to "{bound}"', MISMATCH,
        boundWorkspace=bound, requestedWorkspace=requested,
    )


def not_registered(selector: str) -> dict:
    """A batch route's member for a selector naming no workspace (the reference's shape)."""
    error = {"code": "workspace_not_found", "message": "Workspace is not registered with this daemon.", "status": 404}
    return {"workspace": selector, "error": error}
