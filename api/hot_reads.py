"""The reads dashboards poll all day, answered straight from this process's cache.

`GET /session/:id/status`, `GET /workspace/:id/sessions` and `GET /attention` are most of
an API process's traffic, and a kept answer is a few dict lookups and one shared sync ping;
Starlette's stack around it (error middleware, routing, request and response objects, our
four middlewares) cost twice that again in a profile. So a read whose answer is current in the
cache is sent from here, with the very status, headers and body the routes would give it,
and counted under the route's name. Everything else, including every miss, every error
and every check that needs Redis, goes through the app as before: this is a shortcut for
the one case the routes answer from memory, never a second implementation of them.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from starlette.datastructures import QueryParams
from starlette.types import Scope, Send

from acp_state.store import STORE_ERRORS

from .auth import Authenticator
from .reads.attention_pages import KeptPage
from .reads.cache import CachedPage, CachedSession, Heads
from .reads.etag import names
from .reads.listings import current_page, unfiltered_page_asked
from .reads.summaries import status_answer
from .request_metrics import RequestCounts
from .responses import JSON_TYPE, ApiError
from .routes.attention import asked, attention_page, kept_page
from .routes.sessions import status
from .routes.workspaces import list_sessions
from .state import AppState

log = logging.getLogger("api.hot_reads")

T = TypeVar("T")

_JSON_TYPE = JSON_TYPE.encode()
# Counted under the routes' own names, as `RequestMetrics` counts what the routes answer.
STATUS_ROUTE, LISTING_ROUTE, ATTENTION_ROUTE = status.__name__, list_sessions.__name__, attention_page.__name__


async def answer(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope, send: Send) -> bool:
    """Answer the request from the cache if it is a hot read held current; False: not
    answered, nothing sent, the app must serve it.

    Flat on purpose: each coroutine a kept read passes through costs it about 3% of its
    CPU (`python -m bench.hot_read`)."""
    if state is None or scope["type"] != "http" or scope["method"] != "GET":
        return False
    path: str = scope["path"]
    try:
        if path.startswith("/session/") and path.endswith("/status"):
            sid, principal = path[9:-7], auth.principal(scope)
            if not sid or "/" in sid or principal is None:
                return False
            route, found = STATUS_ROUTE, _status(await state.locator.cached(sid, principal))
        elif path == "/attention":
            principal = auth.principal(scope)
            if principal is None:
                return False
            size, cursor_text, _ = _remembered(scope["query_string"], asked)
            route, found = ATTENTION_ROUTE, _attention(await kept_page(state, principal, size, cursor_text))
        elif path.startswith("/workspace/") and path.endswith("/sessions"):
            ws, principal = path[11:-9], auth.principal(scope)
            # Only the id form: a path selector is canonicalized (and may be refused) by the route.
            if ws not in state.workspaces or principal is None or not principal.may(ws):
                return False
            listed = _remembered(scope["query_string"], unfiltered_page_asked)
            if listed is None:
                return False
            route, found = LISTING_ROUTE, _listing(await current_page(state, ws, *listed))
        else:
            return False
    except (ApiError, *STORE_ERRORS):  # the app meets it again and answers it its way
        return False
    except Exception:  # a bug of this shortcut: said, and the read served by the app all the same
        log.exception("hot read of %s failed; the app answers it", path)
        return False
    if found is None:
        return False
    await _send(scope, send, counts, route, *found)
    return True


def _status(entry: CachedSession | None) -> tuple[bytes, str, Heads] | None:
    if entry is None:
        return None
    body, etag = status_answer(entry)
    if entry.status_heads is None:
        entry.status_heads = _heads(body, etag)
    return body, etag, entry.status_heads


def _listing(page: CachedPage | None) -> tuple[bytes, str, Heads] | None:
    if page is None or page.etag is None:
        return None
    if page.heads is None:
        page.heads = _heads(page.body, page.etag)
    return page.body, page.etag, page.heads


def _attention(page: KeptPage | None) -> tuple[bytes, str, Heads] | None:
    if page is None:
        return None
    if page.heads is None:
        page.heads = _heads(page.body, page.etag)
    return page.body, page.etag, page.heads


def _heads(body: bytes, etag: str) -> Heads:
    """The headers of a kept answer's 200 and 304, as the route and the ETag middleware
    would send them."""
    tag = (b"etag", etag.encode())
    return [tag, (b"content-length", str(len(body)).encode()), (b"content-type", _JSON_TYPE)], [tag]


def _remembered(query: bytes, parse: Callable[[QueryParams], T]) -> T:
    """`parse` of a raw query string (`page_asked`, `attention.asked`), remembered: pollers
    send the same few queries again and again, and parsing one cost as much as the rest of
    a kept read. A 400 is raised, never kept: the route answers it."""
    key = (parse, query)
    parsed = _ASKED.get(key, _UNKNOWN)
    if parsed is _UNKNOWN:
        parsed = parse(QueryParams(query))
        if len(_ASKED) >= _ASKED_KEPT:
            _ASKED.clear()
        _ASKED[key] = parsed
    return parsed  # type: ignore[return-value]


_ASKED: dict[tuple[object, bytes], object] = {}
_ASKED_KEPT = 1024
_UNKNOWN = object()


async def _send(scope: Scope, send: Send, counts: RequestCounts, route: str, body: bytes, etag: str, heads: Heads) -> None:
    """The route's answer as Starlette and the ETag middleware would send it, counted
    before it goes (as `RequestMetrics` counts): a client never scrapes a count older than
    an answer it has."""
    if names(_header(scope, b"if-none-match"), etag):
        counts.add(route, 304)
        await send({"type": "http.response.start", "status": 304, "headers": heads[1]})
        await send({"type": "http.response.body", "body": b""})
        return
    counts.add(route, 200)
    await send({"type": "http.response.start", "status": 200, "headers": heads[0]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
