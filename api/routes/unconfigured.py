"""Reference routes of features that are no session's runtime state, which acp-state does not
have, answered as `qwen serve` answers them when nothing of the feature is configured, where
the reference's Web Shell would otherwise show an error (docs/compatibility.md lists every
such route and what the page does with it):

* `GET /brand`: no white-label brand (`ui.brand` unset): `{}`, the built-in title and logo.
* `GET /goals`: no session pursues a goal (the agent's `/goal`): `{v: 1, goals: [], droppedCount: 0}`;
  a 404 there is a red toast on the sidebar's Goals.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..responses import OrjsonResponse


async def brand(_: Request) -> Response:
    return OrjsonResponse({})


async def goals(_: Request) -> Response:
    return OrjsonResponse({"v": 1, "goals": [], "droppedCount": 0})
