"""Background tasks that never die silently.

A heartbeat, a command loop, a sweeper or a repair task that ends on an unexpected error
leaves its process up and useless (a worker that never registers again, an API that never
sweeps). Each round of such a task runs through `survive`: an error is counted in
`/metrics`, and the loop goes on; it is logged as a recurring failure (`acp_state.logs`:
the first of its kind with its traceback, the rest counted), so a store that is away for
minutes costs a few lines, not a traceback per loop and round.

Stopping them is level-triggered (`cancel_until_done`), as trio's cancel scopes are: on
Python 3.11, `asyncio.wait_for` returns its inner result and drops a cancellation that
arrives just as that result does, and redis-py writes every command through a `wait_for`.
A task cancelled once at that moment goes on to its next round as if never asked to stop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

from prometheus_client import Counter

from . import logs

log = logging.getLogger("acp_state.tasks")

BACKGROUND_ERRORS = Counter(
    "acp_state_background_errors_total", "Errors a background task survived, by task", ["task"]
)
RECANCEL_S = 0.05  # how soon a task that is still running is cancelled again


async def survive(task: str, round_: Callable[[], Awaitable[object]]) -> bool:
    """Run one round of a background task; False (logged and counted) if it failed."""
    try:
        await round_()
    except asyncio.CancelledError:
        raise
    except Exception as error:
        BACKGROUND_ERRORS.labels(task).inc()
        logs.failed(log, task, error)
        return False
    logs.succeeded(task)
    return True


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep `timeout_s` unless `stop` is set first; True once it is set."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


async def cancel_until_done(tasks: Iterable[asyncio.Future[object]]) -> None:
    """Cancel the tasks, and cancel those still running again every RECANCEL_S, until all
    have ended (see the module's docstring for the cancellation 3.11 can drop). What they
    raised is retrieved: they were being stopped."""
    tasks = list(tasks)
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()
