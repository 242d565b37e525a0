"""The attention inbox: every live session, across the workspaces a token may see, that
waits for a human (`GET /attention`), and its changes pushed (`GET /attention/events`).

An item is a pending permission, a pending question, or a turn error:
`{sessionId, workspaceId, workspaceCwd, kind, since, requestId?, title?}`, oldest wait
first. The index behind it is kept by the worker's transitions and the votes themselves,
in the same script as the change (acp_state/store/lua/attention.lua), once per workspace and
once for the deployment (per cluster slot). A page over every workspace of the process is
read from the deployment's index (one script on one Redis: one round trip per shard), one
of a token scoped to a workspace from that workspace's; either is kept until a change is
announced (`reads/attention_pages.py`). Items whose owner's lease lapsed are left out at once, and
leave the index when the sweeper removes their sessions. The stream's hub
(`streams/attention_hub.py`) loads the inbox from the deployment's index too; the items and
pages as read from the index: `reads/attention_index.py`.

The stream starts with `attention_snapshot` (`{items}`, every visible item, oldest first),
then sends `attention_added` (an item) and `attention_removed` (`{sessionId, workspaceId,
kind, requestId?}`). Each frame's `id:` is `<position>-<epoch>` (`streams/ids.py`): the count of
changes the process's hub pushed, and the hub's own epoch. A reconnect with `Last-Event-ID`
alone, on the process whose hub it came from while that hub runs, gets what changed since;
any other resume gets a fresh snapshot.
"""

from __future__ import annotations

import base64
import binascii
from typing import Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state.store import AttentionCursor

from ..auth import Principal, principal_of
from ..limits import ATTENTION_DEFAULT_SIZE, ATTENTION_MAX_SIZE
from ..reads.attention_index import deployment_read, item, page, workspace_read
from ..reads.attention_pages import KeptPage
from ..responses import JSON_TYPE, ApiError, OrjsonResponse, parse_decimal
from ..state import AppState, app_state
from ..streams import ids as stream_ids
from ..streams.attention_hub import AttentionFeeds
from ..streams.hub import Listener, frames, stream_response

def _encode_cursor(cursor: AttentionCursor) -> str:
    packed = orjson.dumps([cursor.since_ms, cursor.ws, cursor.sid, cursor.request_id])
    return base64.urlsafe_b64encode(packed).decode().rstrip("=")


def _decode_cursor(text: str) -> AttentionCursor:
    try:
        since, ws, sid, rid = orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if not (isinstance(since, int) and isinstance(ws, str) and isinstance(sid, str) and (rid is None or isinstance(rid, str))):
            raise ValueError(text)
    except (ValueError, TypeError, binascii.Error, orjson.JSONDecodeError):
        raise ApiError(400, "cursor must be a nextCursor this route returned", "invalid_cursor") from None
    return AttentionCursor(since, ws, sid, rid)


def asked(params: Mapping[str, str]) -> tuple[int, str, AttentionCursor | None]:
    """A page's size, its cursor as sent ('' for the first page) and as read; a 400 if bad."""
    size_text = params.get("size")
    size = ATTENTION_DEFAULT_SIZE if size_text is None else parse_decimal(size_text, ATTENTION_MAX_SIZE)
    if size is None or size < 1:
        raise ApiError(400, f"size must be an integer from 1 to {ATTENTION_MAX_SIZE}", "invalid_size")
    cursor_text = params.get("cursor") or ""
    return size, cursor_text, _decode_cursor(cursor_text) if cursor_text else None


def visible(feeds: AttentionFeeds, principal: Principal) -> tuple[str, ...]:
    """The process's workspaces the principal may see, in order (all: `feeds.every` itself)."""
    return feeds.every if principal.workspaces is None else tuple(ws for ws in feeds.every if principal.may(ws))


async def kept_page(state: AppState, principal: Principal, size: int, cursor_text: str) -> KeptPage | None:
    """The page this process keeps for the request, current (`AttentionPages.kept`): what
    the hot reads send without the route."""
    workspaces = visible(state.attention, principal)
    return await state.attention.pages.kept((workspaces, cursor_text, size), state.registry) if workspaces else None


async def attention_page(request: Request) -> Response:
    """`GET /attention?size=&cursor=` -> `{items, nextCursor}`."""
    state = app_state(request)
    size, cursor_text, after = asked(request.query_params)
    feeds = state.attention
    workspaces = visible(feeds, principal_of(request))
    if not workspaces:
        return OrjsonResponse({"items": [], "nextCursor": None})
    key = (workspaces, cursor_text, size)

    async def read() -> tuple[bytes, frozenset[str], bool]:
        # Every workspace of the process: the deployment's index; one (a scoped token): its own.
        reader = deployment_read(state.store, workspaces) if workspaces is feeds.every else workspace_read(state.store, workspaces)
        found = await page(reader, state.registry.is_live, set(workspaces), after, size)
        body = orjson.dumps({
            "items": [item(entry, state.workspaces[entry.ws]) for entry in found.taken],
            "nextCursor": _encode_cursor(found.next) if found.next else None,
        })
        return body, frozenset(entry.owner for entry in found.taken), found.complete

    body, etag = await feeds.pages.answer(key, state.registry, read)
    return Response(body, media_type=JSON_TYPE, headers={"ETag": etag})


async def attention_events(request: Request) -> Response:
    """`GET /attention/events`: the inbox's snapshot, then its additions and removals."""
    state = app_state(request)
    feed = await state.attention.feed()
    principal = principal_of(request)
    listener = Listener(accepts=principal.may)
    feed.add(listener)  # nothing is awaited from here to the first frame: no change falls between
    point = stream_ids.parse(request.headers.get("last-event-id") or request.query_params.get("lastEventId"))
    first = feed.snapshot(principal.may) if point is None else feed.resume(*point, principal.may)
    body = frames(listener, first, feed)
    return stream_response(body, state.settings.sse_send_timeout_s)
