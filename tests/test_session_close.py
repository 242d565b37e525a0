"""How a live session ends, on the embedded store (pure unit: fakeredis runs the scripts)."""

from __future__ import annotations

import secrets

from acp_state.ids import new_id
from acp_state.store import RedisStore
from acp_state.store.connection import connect
from acp_state.worker.session import LiveSession


class _Agent:
    modes: dict = {}  # the agent's session modes by agent session id (none here)
    reported: dict = {}  # what its session/new answered of each session (none here)

    async def forget(self, agent_sid: str) -> None:
        pass


async def _gone(session: LiveSession) -> None:
    pass


async def _published(store: RedisStore, untold_request: str | None) -> LiveSession:
    session = LiveSession(
        store=store, incarnation=f"w-{secrets.token_hex(4)}", ws=secrets.token_hex(8), sid=new_id(), cwd="/w",
        agent=_Agent(), agent_sid="a-1", single=False, on_gone=_gone,  # type: ignore[arg-type]
    )
    session.untold_request = untold_request
    result = await session.publish_created("client-1")
    assert result is not None
    return session


async def test_a_session_nobody_was_told_of_leaves_no_row_however_it_ends() -> None:
    """A worker stopped (SIGTERM) while a create's answer was still untaken: its creator was
    never told of the session, so no listing may show it afterwards (seen in the cluster
    chaos run: a listed session no acknowledged create named)."""
    store = RedisStore(connect("memory://"))
    untold = await _published(store, untold_request="req-1")
    told = await _published(store, untold_request=None)
    for session in (untold, told):
        await session.close("worker_shutdown")
    assert [row.sid for row in await store.list_page(untold.ws, 0, 10)] == []
    assert [row.sid for row in await store.list_page(told.ws, 0, 10)] == [told.sid]
