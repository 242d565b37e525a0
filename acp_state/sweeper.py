"""The sweeper: removes the keys of workers whose lease lapsed and tells their clients.

Any process may run it. Per dead incarnation exactly one sweeper wins a short lock; each
session is removed by the fenced APPLY script acting as the dead incarnation, so even two
racing sweepers emit `session_died` once per session.
"""

from __future__ import annotations

import asyncio
import logging

from . import events
from .clock import now_ms
from .metrics import SWEEPS, SWEPT_SESSIONS
from .store import Store

log = logging.getLogger("acp_state.sweeper")
LOCK_MS = 30_000
BATCH = 500


async def sweep_once(store: Store) -> int:
    """Sweep every dead incarnation this process wins; returns the sessions removed."""
    removed = 0
    for incarnation in await store.dead_workers(now_ms()):
        if not await store.lock_sweep(incarnation, LOCK_MS):
            continue
        entries = await store.worker_index(incarnation)
        started = now_ms()
        for first in range(0, len(entries), BATCH):
            batch = entries[first : first + BATCH]
            results = await asyncio.gather(
                *(
                    store.apply(
                        ws,
                        sid,
                        incarnation,
                        {
                            "mode": "delete",
                            "events": [
                                events.body("session_died", {"sessionId": sid, "reason": "worker_lost"})
                            ],
                        },
                    )
                    for ws, sid in batch
                )
            )
            swept = sum(1 for r in results if r.applied == 1)
            SWEPT_SESSIONS.inc(swept)
            removed += swept
            if len(entries) > BATCH:
                log.info(
                    "sweeping %s: %d/%d sessions",
                    incarnation,
                    min(first + BATCH, len(entries)),
                    len(entries),
                )
        await store.forget_worker(incarnation, {ws for ws, _ in entries})
        SWEEPS.inc()
        log.info(
            "swept dead worker %s: %d sessions in %d ms",
            incarnation,
            len(entries),
            now_ms() - started,
        )
    return removed


async def run_sweeper(store: Store, interval_s: float, stop: asyncio.Event) -> None:
    """Sweep every `interval_s` until `stop` is set; errors are logged, never fatal."""
    while not stop.is_set():
        try:
            await sweep_once(store)
        except Exception:  # Redis hiccups must not kill the host process
            log.exception("sweep failed")
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
