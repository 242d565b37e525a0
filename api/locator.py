"""Finding a live session from its id: workspace slot, owner, liveness.

A session's workspace and owner never change while it lives, so both are cached; a status
read then costs exactly one round trip to the store (the session's view).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Awaitable, Callable, TypeVar

from acp_state import ids
from acp_state.store import ReaderStore, WorkerRegistry

from .auth import Principal
from .reads.cache import CachedSession, StateCache
from .responses import ApiError

CACHE_SIZE = 100_000
# How many moves one command follows (a session moves once per drain of its worker).
MOVES_FOLLOWED = 3
T = TypeVar("T")


def not_found(sid: str) -> ApiError:
    return ApiError(404, f'No session with id "{sid}"', "session_not_found", sessionId=sid)


class SessionLocator:
    def __init__(self, store: ReaderStore, registry: WorkerRegistry, cache: StateCache) -> None:
        self.store = store
        self.registry = registry
        self.cache = cache
        self._workspaces: OrderedDict[str, str] = OrderedDict()

    async def workspace_of(self, sid: str, principal: Principal) -> str | None:
        """The session's workspace id, or None if unknown or outside the caller's scope."""
        ws = await self._workspace_of(sid)
        return ws if ws is not None and principal.may(ws) else None

    async def _workspace_of(self, sid: str) -> str | None:
        ws = self._workspaces.get(sid)
        if ws is None:
            ws = await self.store.locate(sid)
            if ws is None:
                return None
            self._workspaces[sid] = ws
            if len(self._workspaces) > CACHE_SIZE:
                self._workspaces.popitem(last=False)
        return ws

    def remember(self, sid: str, ws: str) -> None:
        self._workspaces[sid] = ws

    async def live(self, sid: str, principal: Principal) -> CachedSession:
        """The live session, or a 404 (unknown id, closed, or its worker's lease lapsed).

        Served from the invalidation-driven cache when it holds the session: no round trip.
        """
        entry = await self.cache.session(sid)
        if entry is None:
            entry = await self._read(sid)
        if not principal.may(entry.ws) or not await self.registry.is_live(entry.owner):
            raise not_found(sid)
        return entry

    async def cached(self, sid: str, principal: Principal) -> CachedSession | None:
        """The live session from the cache alone, when it is current there and this caller
        may see it; None otherwise (not kept, changed, out of scope, or a lease to check
        against Redis): ask `live`, which answers every case."""
        cache = self.cache
        entry = cache.kept(sid)
        if entry is None:
            return None
        # `cache.session`, without a coroutine of its own: this is every hot status read.
        entry = cache.counted(cache.kept(sid) if await cache.sync(entry.ws) else None)
        if entry is None or not principal.may(entry.ws) or not self.registry.holds_lease(entry.owner):
            return None
        return entry

    async def to_owner(
        self, sid: str, ref: CachedSession, send: Callable[[str], Awaitable[T]], refused: Callable[[T], bool]
    ) -> T:
        """`send(owner)` to the session's owner. A refusal (`refused`: the owner fenced it)
        may mean that a drain moved the session to another worker since it was located: then
        it goes to the new owner, read from the store, instead of answering that the session
        is gone."""
        owner = ref.owner
        for _ in range(MOVES_FOLLOWED):
            result = await send(owner)
            if not refused(result):
                return result
            view = await self.store.session(ref.ws, sid)
            if view is None or view.owner == owner or not await self.registry.is_live(view.owner):
                return result
            owner = view.owner
        return result

    async def _read(self, sid: str) -> CachedSession:
        if not ids.is_token(sid):
            raise not_found(sid)
        ws = await self._workspace_of(sid)
        if ws is None:
            raise not_found(sid)
        token = await self.cache.begin_read(ws, sid)
        view = await self.store.session(ws, sid)
        if view is None:
            raise not_found(sid)
        entry = CachedSession(ws, view.owner, view)
        self.cache.keep_session(sid, token, entry)
        return entry
