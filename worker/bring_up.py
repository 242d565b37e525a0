"""A session's agent brought up after the session is ours (the eager hand-off, `--handoff
eager`): ACP `session/resume` (or `session/load`) in the background, once the session is
live here and its stream goes on.

A move's target (worker/move.py, `take_over`) takes the session over first, in one fenced
step, and answers at once; then the agent's session is brought up here. (A load of a dead
worker's session is not: its answer carries what the agent's resume said, worker/creates.py.) Every command that needs the agent waits for
it (`wait`: a prompt's turn, an approval mode, a close), in the order it came, as parked
commands wait for a move. A move's bring-up first waits for the old owner to let go of the
agent's session (`let_go`: its `Released` command, or its lease lapsed): two workers never
drive the agent's session at once. A bring-up that fails is said on the session's stream
(`session_died`, reason `resume_failed`, a `turn_error` for each prompt it admitted); the
session's catalog row stays, so a later load resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Awaitable, Protocol

from acp_state.store import Transition
from acp_state.turn_errors import from_exception

if TYPE_CHECKING:
    from .agent import AgentProcess


class BroughtUp(Protocol):
    """What a bring-up reads and does of its session (worker/session.py's `LiveSession`,
    which holds the bring-up: named here by what it offers, not imported)."""

    sid: str
    cwd: str
    agent: AgentProcess
    agent_sid: str
    closed: bool

    async def note(self, transition: Transition) -> None: ...

    async def die(self, code: str = ..., message: str = ..., reason: str = ...) -> None: ...

log = logging.getLogger("worker.session")

RESUME_FAILED = "resume_failed"
AGENT_UP = "the agent's session is up"  # (logged in both hand-offs: a test reads their order)


class BringUp:
    """One session's bring-up of its agent session (see the module)."""

    __slots__ = ("session", "ready", "task", "released", "previous", "loading")

    def __init__(self, session: BroughtUp, previous: str | None = None) -> None:
        self.session = session
        # True once the agent holds the session; False if it never will (failed, or closed first).
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self.previous = previous  # a move's old owner, whose release is awaited
        self.released = asyncio.Event()
        self.loading = False  # the agent was asked to resume the session (and has not answered)

    def let_go(self, owner: str) -> None:
        """The old owner said it let go of the agent's session (`commands.Released`)."""
        if owner == self.previous:
            self.released.set()

    async def wait(self) -> bool:
        """Until the agent holds the session (True), or never will (False)."""
        if self.task is not None and self.task is asyncio.current_task():
            return True  # (the bring-up's own failure path closes the session)
        return await asyncio.shield(self.ready)

    def start(self, released: Awaitable[None] | None = None) -> None:
        """Bring the agent's session up now (after `released`, a move's wait for the old owner)."""
        self.task = asyncio.ensure_future(self._run(released))

    async def settle(self) -> None:
        """Before the session lets go of its agent: a resume the agent is running ends first
        (it is not raced by a forget); one not asked yet never will be (a close or a
        shutdown does not wait for the old owner's release)."""
        if self.task is asyncio.current_task():
            return
        if self.task is not None and not self.loading:
            self.task.cancel()
        if not self.ready.done() and not self.loading:
            self.ready.set_result(False)
        if self.task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(self.task)

    async def _run(self, released: Awaitable[None] | None) -> None:
        session = self.session
        try:
            if released is not None:
                await released
            if not session.closed and not self.ready.done():
                self.loading = True
                await session.agent.load_session(session.agent_sid, session.cwd)
        except Exception as error:
            log.warning("bringing the agent's session up failed: %r", error, extra={"sessionId": session.sid})
            if not self.ready.done():
                self.ready.set_result(False)
            await fail(session, from_exception(error).message)
            return
        if not session.closed:
            log.info(AGENT_UP, extra={"sessionId": session.sid})
            # What the agent's resume answered of the session (its modes, models, options:
            # `GET /session/:id/context`), as a create's first snapshot carries it.
            mode = session.agent.modes.get(session.agent_sid, (None, []))[0]
            reported = session.agent.reported.get(session.agent_sid)
            if mode is not None or reported:
                await session.note(Transition(approval_mode=mode, agent_state=reported or {}))
        if not self.ready.done():
            self.ready.set_result(not session.closed)


async def fail(session: BroughtUp, reason: str) -> None:
    """The agent could not resume the session: its clients are told on the stream (its
    prompts' `turn_error`, `session_died` with reason `resume_failed`) and it ends here; its
    catalog row stays, so a later load resumes it from the agent's history."""
    if session.closed:
        return
    with contextlib.suppress(Exception):  # (the agent may be gone)
        await session.agent.forget(session.agent_sid)
    await session.die(RESUME_FAILED, f"the agent could not resume the session: {reason}"[:500], RESUME_FAILED)
