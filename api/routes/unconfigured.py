"""Reference routes of features that are no session's runtime state, which acp-state does not
have, answered as `qwen serve` answers them when nothing of the feature is configured, where
the reference's Web Shell would otherwise show an error (docs/compatibility.md lists every
such route and what the page does with it):

* `GET /brand`: no white-label brand (`ui.brand` unset): `{}`, the built-in title and logo.
* `GET /goals`: no session pursues a goal (the agent's `/goal`): `{v: 1, goals: [], droppedCount: 0}`;
  a 404 there is a red toast on the sidebar's Goals.
* `GET /session/:id/goal`: the live session pursues none: `{snapshot: {v: 2, goal: null,
  activity: "idle"}}` (404 `session_not_found` for a session that is not live, as its status).
* `GET /workspace/settings`: no setting to show or change: `{v: 1, settings: []}`; a 404 there
  is a red toast on the sidebar's Settings.
* `GET /workspace/extensions`, `GET /workspace/extensions/operations`: no extension installed,
  none being installed: `{v: 1, workspaceCwd, initialized: true, extensions: []}` and
  `{v: 1, operations: []}`; a 404 there is a red toast on the sidebar's Plugins.

None is in `/capabilities`: acp-state does not have the feature, it only says there is nothing of it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import workspace_ref
from ..auth import principal_of
from ..responses import OrjsonResponse
from ..state import app_state


async def brand(_: Request) -> Response:
    return OrjsonResponse({})


async def goals(_: Request) -> Response:
    return OrjsonResponse({"v": 1, "goals": [], "droppedCount": 0})


async def session_goal(request: Request) -> Response:
    await app_state(request).locator.live(request.path_params["id"], principal_of(request))  # or 404
    return OrjsonResponse({"snapshot": {"v": 2, "goal": None, "activity": "idle"}})


async def settings(_: Request) -> Response:
    return OrjsonResponse({"v": 1, "settings": []})


async def extensions(request: Request) -> Response:
    # The reference's legacy route names its primary workspace: here the caller's first.
    primary = next(iter(workspace_ref.visible(request).values()), "")
    return OrjsonResponse({"v": 1, "workspaceCwd": primary, "initialized": True, "extensions": []})


async def extension_operations(_: Request) -> Response:
    return OrjsonResponse({"v": 1, "operations": []})
