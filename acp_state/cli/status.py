"""`acp-state status`: a live table of workers (lease age, sessions, load) and sessions by state.

Everything comes from the workers' lease reports: one round trip for the registry and one
for the reports, whatever the number of sessions.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from ..placement import load
from ..store import LeaseReader, WorkerReport
from ..summary import SESSION_STATES


def render(deadlines: dict[str, int], reports: dict[str, WorkerReport], now: int) -> str:
    lines = [
        f"{'worker':44} {'lease age':>10} {'expires in':>10} {'sessions':>9} {'load':>6} {'agents':>6}  state",
    ]
    totals = dict.fromkeys(SESSION_STATES, 0)
    live = 0
    for incarnation, deadline in sorted(deadlines.items()):
        report = reports.get(incarnation)
        if report is None or deadline <= now:
            lines.append(f"{incarnation:44} {'lapsed':>10} {(deadline - now) / 1000:>9.1f}s {'-':>9} {'-':>6} {'-':>6}")
            continue
        live += 1
        age = (now - (report.renewed_at if report.renewed_at is not None else now)) / 1000
        lines.append(
            f"{incarnation:44} {age:>9.1f}s {(deadline - now) / 1000:>9.1f}s "
            f"{report.sessions:>9} {100 * load(report):>5.0f}% {report.agents or 0:>6}  "
            + ("draining" if report.draining else "serving")
        )
        for state, count in report.states.items():
            if state in totals:
                totals[state] += count
    lines.append("")
    lines.append(f"live workers: {live}   sessions by state (as of each worker's last heartbeat):")
    lines.append("  " + "   ".join(f"{state} {count}" for state, count in totals.items()))
    return "\n".join(lines)


async def snapshot(store: LeaseReader) -> str:
    view = await store.lease_view()
    reports = await store.worker_reports(list(view.deadlines))
    return render(view.deadlines, reports, view.redis_now_ms)


async def watch(store: LeaseReader, *, once: bool, interval_s: float) -> None:
    if once:
        print(await snapshot(store))
        return
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        table = await snapshot(store)
        sys.stdout.write("\x1b[H\x1b[2J" + table + "\n")  # redraw in place
        sys.stdout.flush()
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
