"""Background tasks that never die silently.

A heartbeat, a command loop, a sweeper or a repair task that ends on an unexpected error
leaves its process up and useless (a worker that never registers again, an API that never
sweeps). Each round of such a task runs through `survive`: an error is logged with its
traceback, counted in `/metrics`, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from prometheus_client import Counter

log = logging.getLogger("acp_state.tasks")

BACKGROUND_ERRORS = Counter(
    "acp_state_background_errors_total", "Errors a background task survived, by task", ["task"]
)


async def survive(task: str, round_: Callable[[], Awaitable[object]]) -> bool:
    """Run one round of a background task; False (logged and counted) if it failed."""
    try:
        await round_()
    except asyncio.CancelledError:
        raise
    except Exception:
        BACKGROUND_ERRORS.labels(task).inc()
        log.exception("%s failed; it goes on", task)
        return False
    return True


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep `timeout_s` unless `stop` is set first; True once it is set."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        return False
    return True
