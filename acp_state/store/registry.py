"""A reader's view of the worker leases: which incarnations are live right now.

Deadlines are written on Redis's clock (the heartbeat script reads TIME), so they are judged
on it too: each refresh also reads Redis's time, and the view keeps the offset between that
clock and this process's monotonic one. A process whose own wall clock is off therefore still
agrees with every other process on who is live.

Deadlines are cached and trusted until they pass, so a status read needs no extra round
trip in steady state; a deadline that has passed is re-checked against Redis (at most a few
times a second) before a session is declared not live.
"""

from __future__ import annotations

import asyncio
import time

from .interface import LeaseReader

RECHECK_MS = 200


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class WorkerRegistry:
    def __init__(self, store: LeaseReader) -> None:
        self._store = store
        # incarnation -> until when it counts as live: its lease deadline, extended while the
        # store itself was silent (LeaseView.live_until)
        self._deadlines: dict[str, int] = {}
        self._offset_ms = 0  # Redis's clock minus this process's monotonic clock
        self._checked_at = -RECHECK_MS  # monotonic ms of the last refresh
        self._refreshing: asyncio.Task[None] | None = None

    def redis_now(self) -> int:
        """Redis's clock as of the last refresh, carried forward on this process's own."""
        return _monotonic_ms() + self._offset_ms

    async def refresh(self) -> dict[str, int]:
        """Reload every lease deadline (single-flight: concurrent callers share one read)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._load())
        await asyncio.shield(self._refreshing)
        return self._deadlines

    async def _load(self) -> None:
        view = await self._store.lease_view()
        received = _monotonic_ms()
        # Redis read its clock somewhere within the round trip. Taking the latest moment it
        # can have been errs, by up to the round trip, towards "still live" only: a round
        # trip stretched by a busy Redis or a busy loop (seconds, under a burst of 10,000
        # streams) must not make a live worker's sessions answer 404. The sweeper decides
        # deaths inside Redis, on its own clock, so a lenient reader changes no death.
        self._offset_ms = view.redis_now_ms - received
        self._deadlines = view.live_until()
        self._checked_at = received

    async def is_live(self, incarnation: str) -> bool:
        """True while the incarnation's lease deadline lies in the future (Redis's clock),
        or the store was silent within a lease, in which nobody may declare it dead."""
        if self.holds_lease(incarnation):
            return True
        if _monotonic_ms() - self._checked_at >= RECHECK_MS or incarnation not in self._deadlines:
            await self.refresh()
        return self.holds_lease(incarnation)

    def holds_lease(self, incarnation: str) -> bool:
        """True while the deadline last read lies in the future; False says nothing (the
        lease may have been renewed since): ask `is_live`."""
        return self._deadlines.get(incarnation, 0) > self.redis_now()

    async def live(self) -> list[str]:
        """Every incarnation with a valid lease, freshly read."""
        deadlines = await self.refresh()
        now = self.redis_now()
        return [inc for inc, deadline in deadlines.items() if deadline > now]
