"""`GET /workspace/:id/sessions`: persisted rows with live runtime merged in (spec §1.3), a
page read, and kept, by `reads/listings.py`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import session_source, workspace_ref
from ..reads.listings import filtered_page, listing_page, page_asked
from ..responses import JSON_TYPE, OrjsonResponse
from ..state import app_state


async def list_sessions(request: Request) -> Response:
    state = app_state(request)
    ws = workspace_ref.resolve(request, "id")
    asked = page_asked(request.query_params)
    source_type, source_id = session_source.parse(request.query_params.get("sourceType"),
                                                  request.query_params.get("sourceId"))
    if asked is None:
        return OrjsonResponse({"sessions": []})  # nothing is ever archived here
    if source_type is not None:
        return OrjsonResponse(await filtered_page(state, ws, *asked, source_type, source_id))
    page = await listing_page(state, ws, *asked)
    # The page's ETag was computed once, when it was kept (the ETag middleware keeps a
    # route's own): a poller's repeated reads do not hash the same body again.
    return Response(page.body, media_type=JSON_TYPE, headers={"ETag": page.etag} if page.etag else None)
