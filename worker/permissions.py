"""A live session's permission requests: what the agent asks (permissions and questions,
spec §4.1), published, indexed for the legacy vote route, and answered by the vote that won
in Redis or cancelled by the session itself.

A `LiveSession` (worker/session.py) makes its `PermissionRequests` when its agent first
asks: a worker holds tens of thousands of idle sessions, most of which never ask. It is
given what it uses: the store (the request index), the session's identity and its ordered
writes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from acp_state import commands, events, ids, interactions, tracing
from acp_state.clock import iso
from acp_state.commands import cancelled_response
from acp_state.store import Applied, ApplyOutcome, PendingInteraction, Transition, WorkerStore

log = logging.getLogger("worker.session")


@dataclass
class Pending:
    """A permission request the agent awaits."""

    interaction: dict[str, Any]
    allowed: list[str]
    order: int
    prompt_id: str | None
    answer: asyncio.Future[commands.Vote | None]  # the vote that won it; None: cancelled here


class PermissionRequests:
    """The permission requests of one live session (see the module)."""

    __slots__ = ("store", "ws", "sid", "_write", "pending", "_order")

    def __init__(
        self, *, store: WorkerStore, ws: str, sid: str, write: Callable[[Transition], Awaitable[Applied | None]]
    ) -> None:
        self.store = store
        self.ws = ws
        self.sid = sid
        self._write = write  # the session's, in order with its other transitions
        self.pending: dict[str, Pending] = {}  # by request id, in the order they were asked
        self._order = itertools.count()

    def pending_kinds(self) -> list[str]:
        """The kind of each pending request (a permission, or a question for the user)."""
        return [pending.interaction["kind"] for pending in self.pending.values()]

    def interactions(self) -> list[PendingInteraction]:
        """Every pending request as the store keeps it (a snapshot writes them all)."""
        return [self._projected(rid, pending) for rid, pending in self.pending.items()]

    @staticmethod
    def _projected(rid: str, pending: Pending) -> PendingInteraction:
        return PendingInteraction(rid, pending.interaction, pending.order, pending.allowed)

    async def request(
        self, tool_call: dict[str, Any], options: list[dict[str, Any]], prompt_id: str | None, turn_trace: Any = None
    ) -> dict[str, Any]:
        """The agent asks, during prompt `prompt_id`: publish the request, register it,
        await the winning vote (spec §4.1). `turn_trace`: the turn's span, the wait's parent."""
        if len(self.pending) >= interactions.MAX_PENDING_PER_SESSION:
            log.warning("%d pending requests, refusing another", len(self.pending), extra={"sessionId": self.sid})
            return cancelled_response()
        mapped = interactions.map_options(options)
        interactions.check_sentinel(mapped)
        rid = ids.new_id()
        interaction = interactions.normalize(rid, tool_call, options, iso())
        pending = Pending(
            interaction=interaction,
            allowed=interactions.allowed_option_ids(mapped),
            order=next(self._order),
            prompt_id=prompt_id,
            answer=asyncio.get_running_loop().create_future(),
        )
        self.pending[rid] = pending
        data = {"requestId": rid, "sessionId": self.sid, "toolCall": tool_call, "options": options}
        result = await self._write(
            Transition(
                interactions_added=[self._projected(rid, pending)],
                events=[events.body("permission_request", data, prompt_id)],
            )
        )
        if result is None or result.applied != ApplyOutcome.APPLIED:
            self.pending.pop(rid, None)
            return cancelled_response()
        await self._locate_request(rid, True)
        wait = tracing.start_wait(turn_trace, rid, interaction["kind"])
        try:
            vote = await pending.answer
        finally:
            tracing.end_wait(wait, pending.answer)
            # The request's index stays until it expires: a vote repeated with the same
            # Idempotency-Key on the legacy route must still find the session.
            still_ours = self.pending.pop(rid, None) is not None
        response = vote.acp_response() if vote is not None else cancelled_response()
        voter = vote.client_id if vote is not None else None
        if still_ours:
            # Resolved by a vote: the vote script already removed the fields.
            data = {"requestId": rid, "outcome": response["outcome"]}
            if voter:
                data["voterClientId"] = voter
            await self._write(
                Transition(
                    interactions_removed=[rid],
                    events=[events.body("permission_resolved", data, prompt_id, voter)],
                )
            )
        return response

    def resolve_vote(self, vote: commands.Vote) -> None:
        """A vote won in Redis reached us: hand it to the waiting agent request."""
        pending = self.pending.get(vote.rid)
        if pending is not None and not pending.answer.done():
            pending.answer.set_result(vote)

    def cancel_all(self, event_list: list[str]) -> list[str]:
        """Resolve every pending request `cancelled`, adding its `permission_resolved` to
        `event_list`; returns their request ids."""
        resolved: list[str] = []
        for rid, pending in list(self.pending.items()):
            if not pending.answer.done():
                pending.answer.set_result(None)
            outcome = cancelled_response()["outcome"]
            event_list.append(events.body("permission_resolved", {"requestId": rid, "outcome": outcome}, pending.prompt_id))
            resolved.append(rid)
            del self.pending[rid]
        return resolved

    def drop(self) -> None:
        """Answer every pending request cancelled and forget it, writing nothing (the store
        ended the session already)."""
        for pending in list(self.pending.values()):
            if not pending.answer.done():
                pending.answer.set_result(None)
        self.pending.clear()

    async def locate_all(self) -> None:
        """Index every pending request again (the store lost the index with the session)."""
        for rid in list(self.pending):
            await self._locate_request(rid, True)

    async def _locate_request(self, rid: str, present: bool) -> None:
        """Index (or drop) a pending request for the legacy vote route. Best effort: a Redis
        hiccup here must not fail the agent's request; a lost index is rewritten with the
        session (republish), and a stale one expires."""
        try:
            await self.store.locate_request(rid, f"{self.ws}/{self.sid}" if present else None)
        except Exception:
            log.warning("could not %s request %s", "index" if present else "unindex", rid, extra={"sessionId": self.sid})
