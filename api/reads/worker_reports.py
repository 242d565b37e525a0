"""The live workers' load reports as one API process keeps them, for placing creates and
loads (`placement.py`).

A burst of creates would otherwise read the registry and the reports twice per create. The
reports are as old as the last heartbeat anyway (a third of a lease), so one read serves
every create for `FRESH_S`; creates that arrive during a read share it.
"""

from __future__ import annotations

import asyncio

from acp_state.store import ReaderStore, WorkerRegistry, WorkerReport

FRESH_S = 0.1


class LiveReports:
    def __init__(self, store: ReaderStore, registry: WorkerRegistry) -> None:
        self._store = store
        self._registry = registry
        self._read_at = float("-inf")
        self._reports: list[WorkerReport] = []
        self._reading: asyncio.Future[list[WorkerReport]] | None = None

    async def get(self, fresh: bool = False) -> list[WorkerReport]:
        """The live workers' reports, read within the last FRESH_S (or now, if `fresh`)."""
        loop = asyncio.get_running_loop()
        if not fresh and loop.time() - self._read_at < FRESH_S:
            return list(self._reports)
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        return list(await asyncio.shield(self._reading))

    async def _read(self) -> list[WorkerReport]:
        started = asyncio.get_running_loop().time()
        reports = await self._store.worker_reports(await self._registry.live())
        self._reports, self._read_at = list(reports.values()), started
        return self._reports
