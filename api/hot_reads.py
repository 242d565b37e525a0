"""The reads dashboards poll all day, answered straight from this process's cache.

`GET /session/:id/status` and `GET /workspace/:id/sessions` are most of an API process's
traffic, and a kept answer is a few dict lookups and one shared sync ping; Starlette's
stack around it (error middleware, routing, request and response objects, our four
middlewares) cost twice that again in a profile. So a read whose answer is current in the
cache is sent from here, with the very status, headers and body the routes would give it,
and counted under the route's name. Everything else, including every miss, every error
and every check that needs Redis, goes through the app as before: this is a shortcut for
the one case the routes answer from memory, never a second implementation of them.
"""

from __future__ import annotations

import logging
from typing import Callable

from starlette.datastructures import QueryParams
from starlette.types import Scope, Send

from acp_state.store import STORE_ERRORS

from .auth import Authenticator
from .etag import names
from .metrics import RequestCounts
from .responses import JSON_TYPE, ApiError
from .sessions import status, status_answer
from .state import AppState
from .workspaces import current_page, list_sessions, page_asked

log = logging.getLogger("api.hot_reads")

_JSON_TYPE = JSON_TYPE.encode()
# Counted under the routes' own names, as `RequestMetrics` counts what the routes answer.
STATUS_ROUTE, LISTING_ROUTE = status.__name__, list_sessions.__name__


async def answer(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope, send: Send) -> bool:
    """Answer the request from the cache if it is a hot read held current; False: not
    answered, nothing sent, the app must serve it."""
    if state is None or scope["type"] != "http" or scope["method"] != "GET":
        return False
    path: str = scope["path"]
    try:
        if path.startswith("/session/") and path.endswith("/status"):
            route, found = STATUS_ROUTE, await _status(state, auth, scope, path[9:-7])
        elif path.startswith("/workspace/") and path.endswith("/sessions"):
            route, found = LISTING_ROUTE, await _listing(state, auth, scope, path[11:-9])
        else:
            return False
    except (ApiError, *STORE_ERRORS):  # the app meets it again and answers it its way
        return False
    except Exception:  # a bug of this shortcut: said, and the read served by the app all the same
        log.exception("hot read of %s failed; the app answers it", path)
        return False
    if found is None:
        return False
    await _send(scope, send, *found, lambda status: counts.add(route, status))
    return True


async def _status(state: AppState, auth: Authenticator, scope: Scope, sid: str) -> tuple[bytes, str] | None:
    principal = auth.principal(scope)
    if not sid or "/" in sid or principal is None:
        return None
    entry = await state.locator.cached(sid, principal)
    return None if entry is None else status_answer(entry)


async def _listing(state: AppState, auth: Authenticator, scope: Scope, selector: str) -> tuple[bytes, str] | None:
    principal = auth.principal(scope)
    # Only the id form: a path selector is canonicalized (and may be refused) by the route.
    if selector not in state.workspaces or principal is None or not principal.may(selector):
        return None
    asked = _page_asked(scope["query_string"])
    if asked is None:
        return None
    page = await current_page(state, selector, *asked)
    return None if page is None else (page.body, page.etag)  # type: ignore[return-value]


def _page_asked(query: bytes) -> tuple[int, int] | None:
    """`page_asked` of a raw query string, remembered: pollers send the same few queries
    again and again, and parsing one cost as much as the rest of a kept read."""
    asked = _ASKED.get(query, _UNKNOWN)
    if asked is _UNKNOWN:
        asked = page_asked(QueryParams(query))  # a 400 is raised, never kept: the route answers it
        if len(_ASKED) >= _ASKED_KEPT:
            _ASKED.clear()
        _ASKED[query] = asked
    return asked  # type: ignore[return-value]


_ASKED: dict[bytes, object] = {}
_ASKED_KEPT = 1024
_UNKNOWN = object()


async def _send(scope: Scope, send: Send, body: bytes, etag: str, count: Callable[[int], None]) -> None:
    """The route's answer as Starlette and the ETag middleware would send it, counted
    before it goes (as `RequestMetrics` counts): a client never scrapes a count older than
    an answer it has."""
    if names(_header(scope, b"if-none-match"), etag):
        count(304)
        await send({"type": "http.response.start", "status": 304, "headers": [(b"etag", etag.encode())]})
        await send({"type": "http.response.body", "body": b""})
        return
    count(200)
    headers = [(b"etag", etag.encode()), (b"content-length", str(len(body)).encode()), (b"content-type", _JSON_TYPE)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
