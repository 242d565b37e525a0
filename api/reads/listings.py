"""A workspace's listing (`GET /workspace/:id/sessions`, and the batch catalog and live
state that read through it): the page a query asks for, its rows (persisted, with live
runtime merged in), read from Redis once for the readers that ask meanwhile, and kept in
this process's cache until a change of the workspace is announced."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any, Mapping

import orjson

from .. import session_source
from .cache import CachedPage
from .etag import weak_etag
from ..limits import LISTING_DEFAULT_SIZE, LISTING_MAX_SIZE
from ..responses import ApiError
from ..state import AppState
from .summaries import live_summary, merged_row, persisted_row


def encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"o:{offset}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, offset = text.partition(":")
        if kind != "o" or not offset.isdigit() or len(offset) > 9:
            raise ValueError(cursor)
        return int(offset)
    except ValueError:
        raise ApiError(400, "cursor is not one this daemon issued", "invalid_cursor") from None


SIZE = re.compile(r"\s*([+-]?)0*([0-9]+)\s*")


def page_size(text: str | None) -> int:
    """`size` clamped to 1..100, as the reference clamps it (its Web Shell asks for 1,000):
    any integer, signed or with spaces around it; anything else answers 400 `invalid_size`
    (the reference takes it for the default)."""
    if text is None:
        return LISTING_DEFAULT_SIZE
    match = SIZE.fullmatch(text) if text.isascii() else None
    if match is None:
        raise ApiError(400, f"size must be an integer (clamped to 1..{LISTING_MAX_SIZE})", "invalid_size")
    sign, digits = match.groups()
    if sign == "-" or digits == "0":
        return 1
    return LISTING_MAX_SIZE if len(digits) > 3 else min(int(digits), LISTING_MAX_SIZE)


def unfiltered_page_asked(query: Mapping[str, str]) -> tuple[int, int] | None:
    """`page_asked` of a listing that filters nothing (None otherwise): the hot reads answer
    only those from their kept pages."""
    return None if "sourceType" in query or "sourceId" in query else page_asked(query)


def page_asked(query: Mapping[str, str]) -> tuple[int, int] | None:
    """The (offset, size) a listing's query asks for; None for the archived listing, which
    is always empty; a 400 for anything else."""
    size = page_size(query.get("size"))
    archive_state = query.get("archiveState", "active")
    if archive_state not in ("active", "archived"):
        raise ApiError(400, "archiveState must be 'active' or 'archived'", "invalid_archive_state")
    if archive_state == "archived":
        return None
    return (decode_cursor(query["cursor"]) if "cursor" in query else 0), size


async def listing(state: AppState, ws: str, offset: int, size: int) -> bytes:
    """One page of the workspace's listing as JSON (see listing_page)."""
    return (await listing_page(state, ws, offset, size)).body


async def listing_page(state: AppState, ws: str, offset: int, size: int) -> CachedPage:
    """One page of the workspace's listing, its JSON and its ETag, from this process's cache
    while no change of the workspace was announced and every live row's owner still holds
    its lease.

    A page not kept is read from Redis once for the readers that ask for it meanwhile: a
    change in a workspace sends every poller of its first page here at the same moment,
    and each reading the same rows held them all for as long as all the reads took. A
    reader that waited for another's read takes the page through `cached_page` again,
    whose sync makes it current for that reader too (a change announced before it voids
    the page); if that read was not kept (it raced a change), the reader reads for itself:
    a reader waits once, never in a queue."""
    cache = state.locator.cache
    key = (ws, offset, size)
    cached = await cached_page(state, ws, offset, size)
    reading = cache.page_reads.get(key)
    if cached is None and reading is not None:
        await asyncio.wait([reading])  # its outcome is not ours: a failed or cancelled read only ends the wait
        cached = await cached_page(state, ws, offset, size)
    if cached is not None:
        return cached
    if key in cache.page_reads:
        return await _read_page(state, ws, offset, size)
    reading = cache.page_reads[key] = asyncio.get_running_loop().create_future()
    try:
        return await _read_page(state, ws, offset, size)
    finally:
        del cache.page_reads[key]
        reading.set_result(None)


async def _read_page(state: AppState, ws: str, offset: int, size: int) -> CachedPage:
    token = await state.locator.cache.begin_read(ws, ws)
    page = await state.store.list_page(ws, offset, size)
    sessions, owners = [], set()
    for listed in page[:size]:
        listed_row = await _listed(state, ws, listed, owners)
        if listed_row is not None:
            sessions.append(listed_row)
    result: dict[str, object] = {"sessions": sessions}
    if len(page) > size:
        result["nextCursor"] = encode_cursor(offset + size)
    body = orjson.dumps(result)
    page = CachedPage(body, frozenset(owners), weak_etag(body))
    # Kept until a change in the workspace arrives, or one of these owners' leases lapses.
    state.locator.cache.keep_page(ws, offset, size, token, page)
    return page


async def _listed(state: AppState, ws: str, listed: Any, owners: set[str]) -> dict[str, Any] | None:
    """One entry of the store's page as the listing shows it (live rows merged; the owner
    noted in `owners`), or None: not listed (untold, or neither live nor kept)."""
    row = {"sessionId": listed.sid, "workspaceCwd": state.workspaces[ws], **listed.row} if listed.row else None
    view = listed.view
    if view is not None and not view.told:
        return None  # its create may still be undone: nobody was told of it yet
    live = view is not None and await state.registry.is_live(view.owner)
    if row is None and not live:
        return None
    if live:
        assert view is not None
        owners.add(view.owner)
        return merged_row(row or {}, live_summary(view), view.meta)
    return persisted_row(row)  # type: ignore[arg-type]


async def filtered_page(state: AppState, ws: str, offset: int, size: int, source_type: str,
                         source_id: str | None) -> dict[str, Any]:
    """A page of the sessions of one source (the reference's `sourceType`/`sourceId` filter):
    read through the listing in steps of 100 until `size` rows match; the cursor is the
    listing's offset after the last row looked at. Not kept: a filter is a rare read."""
    sessions: list[dict[str, Any]] = []
    while True:
        page = await state.store.list_page(ws, offset, LISTING_MAX_SIZE)
        entries = page[:LISTING_MAX_SIZE]
        for n, listed in enumerate(entries, 1):
            row = await _listed(state, ws, listed, set())
            if row is not None and session_source.matches(row, source_type, source_id):
                sessions.append(row)
                if len(sessions) == size:
                    more = n < len(entries) or len(page) > LISTING_MAX_SIZE
                    return {"sessions": sessions, **({"nextCursor": encode_cursor(offset + n)} if more else {})}
        if len(page) <= LISTING_MAX_SIZE:
            return {"sessions": sessions}
        offset += len(entries)


async def cached_page(state: AppState, ws: str, offset: int, size: int) -> CachedPage | None:
    """A kept page, unless one of the owners of its live rows lost its lease since."""
    cached = await state.locator.cache.page(ws, offset, size)
    if cached is not None and all([await state.registry.is_live(owner) for owner in cached.owners]):
        return cached
    return None


async def current_page(state: AppState, ws: str, offset: int, size: int) -> CachedPage | None:
    """A kept page with its ETag, from the cache alone, with every owner's lease as last
    read still held; None otherwise: ask `listing_page`, which answers every case."""
    page = await state.locator.cache.page(ws, offset, size)
    if page is None or page.etag is None or not all(state.registry.holds_lease(owner) for owner in page.owners):
        return None
    return page
