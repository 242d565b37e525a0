"""A live session as the store holds it: its identity, and its transitions written in order.

The session's state in the worker's memory is the truth; the store holds its projection.
`StoredSession` writes that projection one transition at a time, in order, each until the
store takes it, and tells its owner when the store refuses one (fenced: another worker owns
the session, or the store lost it). `LiveSession` (worker/session.py) is one: the turn state
machine over these writes. A write that is not a session's transition (an index entry, a
reply) is retried the same way by `until_stored`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Awaitable, Callable

from acp_state import events, logs
from acp_state.store import Applied, ApplyOutcome, Mode, Transition, WorkerStore

from .metrics import EVENTS, TRANSITIONS, WRITES_DROPPED

log = logging.getLogger("worker.session")

# A transition the store cannot take yet is retried, from RETRY_FIRST_S doubling up to
# RETRY_MAX_S, for WRITE_PATIENCE_S (a worker shutting down waits less).
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
WRITE_PATIENCE_S = 120.0
TERMINALS = ("turn_complete", "turn_error")
WRITES_TASK = "a session's transition write (retried)"


async def until_stored(write: Callable[[], Awaitable[Any]], patience_s: float = 30.0) -> bool:
    """Run a write until the store takes it (retrying while it is away, as session
    transitions do); False if it said no (a reply nobody waits for) or never took it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    pause = RETRY_FIRST_S
    while True:
        try:
            return await write() is not False
        except Exception as error:  # (redis-py can fail oddly on a connection torn mid-write)
            if loop.time() + pause > deadline:
                log.error("a write was given up: %r", error)
                return False
            log.warning("a write failed (%r); retrying", error)
        await asyncio.sleep(pause)
        pause = min(2 * pause, RETRY_MAX_S)


class StoredSession:
    """One session's identity and its ordered writes (see the module)."""

    # Slots, not a per-instance dict: a worker holds tens of thousands of idle sessions.
    __slots__ = ("store", "incarnation", "ws", "sid", "closed", "abandoned", "write_patience_s",
                 "_on_fenced", "_published", "_publishing", "_in_order", "_op", "_unwritten")

    def __init__(
        self,
        *,
        store: WorkerStore,
        incarnation: str,
        ws: str,
        sid: str,
        on_fenced: Callable[[Any, ApplyOutcome], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.incarnation = incarnation
        self.ws = ws
        self.sid = sid
        self.closed = False
        self.abandoned = False  # its incarnation died: nothing more of it is written
        self.write_patience_s = WRITE_PATIENCE_S
        # Told, with this session, when the store refuses one of its writes.
        self._on_fenced = on_fenced
        # Set once the first snapshot was written (or the session gave up): an update the
        # agent sends right after `session/new` must not reach the store before the
        # session itself, or the fence refuses it.
        self._published = False
        self._publishing: asyncio.Future[None] | None = None  # made only if a write waits for it
        self._in_order = asyncio.Lock()  # FIFO: transitions reach the store in order
        self._op = 0  # running number of this session's transitions
        self._unwritten: list[str] = []  # terminals a fenced write carried, for the rewrite

    def _mark_published(self) -> None:
        self._published = True
        if self._publishing is not None and not self._publishing.done():
            self._publishing.set_result(None)

    @property
    def published(self) -> bool:
        """The session's first snapshot has been written (or it gave up)."""
        return self._published

    def _settled(self) -> None:
        """After each write, taken or not (a subclass counts its state here)."""

    async def _write(self, transition: Transition | Callable[[], Transition]) -> Applied | None:
        """Apply one transition, in order, until the store has it.

        The state here is the truth and the store its projection, so a transition the store
        could not take (unreachable, stalled, out of memory) is retried, in order (one at a
        time per session), under a running number that makes a retry of one that did apply
        a no-op. A fenced write (the store has no such session of ours) is reported to the
        worker, which asks the registry whether we were declared dead or the store lost it;
        the terminals it carried are then written again with the session. `transition` may
        be a function, called in turn: a snapshot must see what the writes before it did."""
        if not callable(transition) and transition.mode not in (Mode.CREATE, Mode.TAKEOVER) and not self._published:
            if self._publishing is None:
                self._publishing = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._publishing)
        async with self._in_order:
            if callable(transition):
                transition = transition()
            if self.closed and transition.mode is not Mode.DELETE:
                return None
            TRANSITIONS.inc()
            for body in transition.events:
                EVENTS.labels(events.event_type(body)).inc()
            self._op += 1
            transition = dataclasses.replace(transition, op=self._op)
            try:
                result = await self._apply_until_taken(transition)
            finally:
                self._settled()
            if result is not None and result.applied not in (ApplyOutcome.APPLIED, ApplyOutcome.PRESENT):
                self._unwritten += [body for body in transition.events if events.event_type(body) in TERMINALS]
                # (A refused takeover is the mover's to handle: the session is not ours.)
                if not self.closed and self._on_fenced is not None and transition.mode is not Mode.TAKEOVER:
                    log.warning("the store refused a write (%d); checking our lease", result.applied, extra={"sessionId": self.sid})
                    asyncio.ensure_future(self._on_fenced(self, result.applied))
        return result

    async def _apply_until_taken(self, transition: Transition) -> Applied | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.write_patience_s
        pause = RETRY_FIRST_S
        retried = False
        while True:
            try:
                applied = await self.store.apply(self.ws, self.sid, self.incarnation, transition)
                if retried:
                    logs.succeeded(WRITES_TASK)
                return applied
            except Exception as error:
                # Retried whatever the error: the running number makes a retry of a write
                # that did apply a no-op, and redis-py can fail oddly on a connection torn
                # mid-reply. Said once per kind of error, then counted (acp_state.logs).
                if self.abandoned or loop.time() + pause > deadline:
                    WRITES_DROPPED.inc()
                    log.error("a transition could not be written; dropped (%r)", error, extra={"sessionId": self.sid})
                    logs.succeeded(WRITES_TASK)  # (no longer retried: the outage's end is the loops' to tell)
                    return None
                logs.failed(log, WRITES_TASK, error, logging.WARNING)
                retried = True
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def written(self) -> None:
        """Until every transition queued so far reached the store (they are written in order)."""
        await asyncio.sleep(0)  # writes started as tasks just before reach the queue first
        async with self._in_order:
            pass

    async def note(self, transition: Transition) -> None:
        """A transition of the session's own parts elsewhere (worker/bring_up.py), in order."""
        await self._write(transition)

    async def mark_told(self) -> None:
        """The create's answer was taken. Its API says so in the store itself; this makes it
        so even if that API could not (the session would stay out of listings)."""
        await self._write(Transition(told=True))
