"""Invalidation-driven caches of one API process: session state and listing pages.

Every change to a session's status is announced on its workspace's change channel before
the change's events go out; this process follows that channel (`Fanout.watch`) for every
workspace it caches, so the cached copy is dropped before any SSE listener of this process
sees the event. A kept copy is served only after a ping sent on that channel's connection
after the read began came back (`Fanout.sync`): by then every change acknowledged anywhere
before the read has arrived, so a cached read is never older than an acknowledged write.
Nothing is kept or served for a workspace whose channel is not confirmed (on a cluster:
whose node did not answer a ping within the last second), and a read that raced a change is
served but not kept. Liveness is never cached here: a hit is still
checked against the owner's lease deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from acp_state.metrics import Tally
from acp_state.store import Fanout, SessionView

log = logging.getLogger("acp_state.api.cache")

CACHE_HITS = Tally("acp_state_state_cache_hits_total", "Session reads served from this process's cache")
CACHE_MISSES = Tally("acp_state_state_cache_misses_total", "Session reads that went to Redis")

MAX_SESSIONS = 100_000
MAX_PAGES = 10_000


# The headers of a kept answer as the hot reads send it (`hot_reads`): of its 200 and of
# its 304. Made once per kept answer and never changed after: the server only reads them.
Heads = tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]


async def follow(fanout: Fanout, ws: str) -> None:
    """Follow `ws`'s changes if not yet followed. Best effort: with Redis away the read that
    follows says so, and `fanout.watching(ws)` stays False, so nothing read is kept."""
    if not fanout.watching(ws):
        try:
            await fanout.watch(ws)
        except Exception:
            log.debug("cannot follow the changes of %s", ws, exc_info=True)


@dataclass

class CachedSession:
    ws: str
    owner: str
    view: SessionView
    status_body: bytes | None = None  # its status answer and ETag, made on its first read
    status_etag: str = ""
    status_heads: Heads | None = None


@dataclass
class CachedPage:
    body: bytes
    owners: frozenset[str]
    etag: str | None = None
    heads: Heads | None = None


# The page key of a workspace's live state, beside its listing pages (offset, size).
LIVE_STATE_PAGE = (-1, 0)


class ChangeFeed(Protocol):
    """Where the cache learns of changes: acp_state.store.Fanout."""

    def watching(self, ws: str) -> bool: ...
    async def watch(self, ws: str) -> bool: ...
    def sync(self, ws: str) -> Awaitable[bool]: ...


class StateCache:
    def __init__(self, feed: ChangeFeed) -> None:
        self._feed = feed
        # True once every change of a workspace announced before the call has arrived;
        # False: that cannot be said now (read Redis). The feed's own, not a wrapper: it is
        # on every kept read's path.
        self.sync: Callable[[str], Awaitable[bool]] = feed.sync
        self._sessions: OrderedDict[str, CachedSession] = OrderedDict()
        self._pages: OrderedDict[tuple[str, int, int], CachedPage] = OrderedDict()
        # A read may be kept only if its key was not invalidated after the read began:
        # every invalidation takes the next number of a process-wide counter.
        self._clock = 0
        self._invalidated: OrderedDict[str, int] = OrderedDict()
        self._cleared_at = 0  # reads that began before this are never kept
        # Listing pages being read from Redis now, each read once for all its concurrent
        # readers (`workspaces.listing_page`).
        self.page_reads: dict[tuple[str, int, int], asyncio.Future[None]] = {}

    # ---- the change feed ----------------------------------------------------------------

    def changed(self, ws: str, sid: str) -> None:
        """A session changed (announced on its workspace's channel, or done by this process:
        a close it was told of is not served from the cache even before the news arrives)."""
        self._sessions.pop(sid, None)
        for key in [k for k in self._pages if k[0] == ws]:
            del self._pages[key]
        self._mark(sid)
        self._mark(ws)

    def clear(self) -> None:
        """Messages may have been lost: nothing cached can be trusted any more."""
        self._sessions.clear()
        self._pages.clear()
        self._clock += 1
        self._invalidated.clear()
        self._cleared_at = self._clock

    def _mark(self, key: str) -> None:
        self._clock += 1
        self._invalidated[key] = self._clock
        self._invalidated.move_to_end(key)
        if len(self._invalidated) > MAX_SESSIONS:
            self._invalidated.popitem(last=False)
            # Forgetting an old mark could let an old read in: void reads older than it.
            self._cleared_at = self._clock

    async def begin_read(self, ws: str, key: str) -> int:
        """Call before reading `key` of workspace `ws` from Redis; the result may be kept
        (keep_*) only if no change to it was announced after this point."""
        await follow(self._feed, ws)
        return self._clock

    def _current(self, ws: str, key: str, started: int) -> bool:
        return (
            started >= self._cleared_at
            and self._invalidated.get(key, 0) <= started
            and self._feed.watching(ws)
        )

    # ---- sessions -----------------------------------------------------------------------

    def kept(self, sid: str) -> CachedSession | None:
        """The copy kept of a session, as it stands: it may be older than a change
        acknowledged elsewhere until its workspace's `sync` comes back, and a change that
        arrives meanwhile drops it. `session` waits for that; a hot path that cannot
        afford the extra coroutine awaits `sync` itself and takes `kept` again after."""
        return self._sessions.get(sid)

    @staticmethod
    def counted(entry: CachedSession | None) -> CachedSession | None:
        """A read of a kept session served (a hit) or sent to Redis (a miss)."""
        (CACHE_MISSES if entry is None else CACHE_HITS).inc()
        return entry

    async def session(self, sid: str) -> CachedSession | None:
        """The kept session, once every change announced before the call has arrived
        (`sync`): a close acknowledged anywhere is never answered from here afterwards."""
        entry = self.kept(sid)
        if entry is not None:
            # Its changes may not reach us now: read Redis. Else take the entry again: a
            # change that arrived during the sync dropped it.
            entry = self.kept(sid) if await self.sync(entry.ws) else None
        return self.counted(entry)

    def keep_session(self, sid: str, started: int, entry: CachedSession) -> None:
        if not self._current(entry.ws, sid, started):
            return  # changed while we read: serve this once, do not keep it
        self._sessions[sid] = entry
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    # ---- listing pages ------------------------------------------------------------------

    async def page(self, ws: str, offset: int, size: int) -> CachedPage | None:
        """A kept page, once every change announced before the call has arrived."""
        if (ws, offset, size) not in self._pages or not await self.sync(ws):
            return None
        return self._pages.get((ws, offset, size))

    def keep_page(self, ws: str, offset: int, size: int, started: int, page: CachedPage) -> None:
        if not self._current(ws, ws, started):
            return
        self._pages[(ws, offset, size)] = page
        if len(self._pages) > MAX_PAGES:
            self._pages.popitem(last=False)
