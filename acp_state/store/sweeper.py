"""The sweeper: removes the sessions of workers declared dead and tells their clients.

Any process may run it. The store declares a worker dead only when its lease lapsed while
the store itself was serving (see the CLAIM_DEAD script), and hands each dead worker to exactly
one sweeper; a sweeper that dies mid-way loses its claim and another takes over. Each session
is removed by a transition fenced as the dead incarnation: every prompt it had
admitted gets its terminal `turn_error`, then the session its `session_died`, once, however
many sweepers race.
"""

from __future__ import annotations

import asyncio
import logging

from .. import events
from ..clock import now_ms
from ..metrics import SWEEPS, SWEPT_SESSIONS
from ..tasks import survive, wait_or_stop
from .interface import SweeperStore
from .types import SESSION_ID_SLOT, ApplyOutcome, DeadClaims, EndAdmitted, Mode, Transition

log = logging.getLogger("acp_state.sweeper")
WORKER_LOST = "worker_lost"
# A sweeper waiting for a lease to lapse asks this long after its deadline (Redis's clock
# and ours tick apart by the round trip).
LAPSE_MARGIN_S = 0.005


def died(sid: str) -> Transition:
    """The transition that removes a dead worker's session: every prompt it had admitted
    gets its `turn_error`, then the session its `session_died`."""
    return Transition(
        mode=Mode.DELETE,
        uncatalog_untold=True,  # a session created for nobody leaves no row
        end_admitted=EndAdmitted(WORKER_LOST, "the session's worker was lost before the prompt completed"),
        events=[events.body("session_died", {"sessionId": sid, "reason": WORKER_LOST})],
    )


async def sweep_once(store: SweeperStore) -> tuple[int, DeadClaims]:
    """Sweep every dead incarnation this process is handed; returns the sessions removed and
    the round's claims. The workspaces of one incarnation are swept side by side, each in
    batched calls (`Store.sweep`)."""
    removed = 0
    claims = await store.claim_dead_workers()
    for incarnation in claims.claimed:
        entries = await store.worker_index(incarnation)
        started = now_ms()
        by_workspace: dict[str, list[str]] = {}
        for ws, sid in entries:
            by_workspace.setdefault(ws, []).append(sid)
        # One transition for all (the store puts each session's id in), made now: its
        # events carry the time they are written.
        transition = died(SESSION_ID_SLOT)
        outcomes = await asyncio.gather(
            *(store.sweep(ws, incarnation, sids, transition) for ws, sids in by_workspace.items())
        )
        swept = sum(outcome == ApplyOutcome.APPLIED for each in outcomes for outcome in each)
        SWEPT_SESSIONS.inc(swept)
        removed += swept
        await store.forget_worker(incarnation, set(by_workspace))
        SWEEPS.inc()
        log.info("swept dead worker %s: %d sessions in %d ms", incarnation, len(entries), now_ms() - started)
    return removed, claims


async def run_sweeper(store: SweeperStore, interval_s: float, stop: asyncio.Event) -> None:
    """Sweep every `interval_s` until `stop` is set; an error is logged and counted, never fatal.

    Each round is also a tick of the store's clock (the CLAIM_DEAD script), by which the store
    tells a silence of its own from a worker's, so the pace quickens to a sixth of the
    shortest registered lease: well inside the half-lease silence that counts as a stall.
    A lease due to lapse sooner than that is waited for: a live worker renews long before
    its deadline, so only a dead one's comes this close, and its sessions go at once."""
    pace = interval_s

    async def round_() -> None:
        nonlocal pace
        _, claims = await sweep_once(store)
        pace = min(interval_s, claims.shortest_lease_ms / 6000) if claims.shortest_lease_ms else interval_s
        if claims.next_lapse_ms is not None:
            pace = min(pace, claims.next_lapse_ms / 1000 + LAPSE_MARGIN_S)

    while not stop.is_set():
        await survive("sweeper", round_)
        if await wait_or_stop(stop, pace):
            return
