"""A reader's view of the worker leases: which incarnations are live right now.

Deadlines are cached and trusted until they pass, so a status read needs no extra round
trip in steady state; a deadline that has passed is re-checked against Redis (at most a few
times a second) before a session is declared not live.
"""

from __future__ import annotations

import asyncio

from .clock import now_ms
from .store import Store

RECHECK_MS = 200


class WorkerRegistry:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._deadlines: dict[str, int] = {}
        self._checked_at = 0
        self._refreshing: asyncio.Task[None] | None = None

    async def refresh(self) -> dict[str, int]:
        """Reload every lease deadline (single-flight: concurrent callers share one read)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._load())
        await asyncio.shield(self._refreshing)
        return self._deadlines

    async def _load(self) -> None:
        self._deadlines = await self._store.workers()
        self._checked_at = now_ms()

    async def is_live(self, incarnation: str) -> bool:
        """True while the incarnation's lease deadline lies in the future."""
        now = now_ms()
        if self._deadlines.get(incarnation, 0) > now:
            return True
        if now - self._checked_at >= RECHECK_MS or incarnation not in self._deadlines:
            await self.refresh()
        return self._deadlines.get(incarnation, 0) > now_ms()

    async def live(self) -> list[str]:
        """Every incarnation with a valid lease, freshly read."""
        deadlines = await self.refresh()
        now = now_ms()
        return [inc for inc, deadline in deadlines.items() if deadline > now]
