"""How a retried create ends when its key's record lapsed while the first create's outcome
was followed (a pure unit test of `first_create_outcome` over a stand-in store). Seen in the
seeded cluster chaos run: the first create's API took the answer, told the session and died;
the record lapsed during a long outage; the retry answered `create_undone` and the client
created a second session while the first stood, known to nobody."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from acp_state.commands import Reply
from acp_state.store import ABANDONED, CatalogRow, CreateRecord
from acp_state.api.responses import ApiError
from acp_state.api.routes.sessions import first_create_outcome

FIRST = CreateRecord("sid-1", "client-1", False, "req-1", kept=False)


class Store:
    def __init__(self, answer: Any, told: bool, listed: bool) -> None:
        self.answer, self.told, self.listed = answer, told, listed
        self.kept: list[str] = []
        self.record: tuple[str, ...] | None = None

    async def take_reply(self, request: str) -> Any:
        return self.answer

    async def mark_told(self, ws: str, sid: str) -> None:
        self.told = True

    async def was_told(self, ws: str, sid: str) -> bool:
        return self.told and self.listed

    async def catalog_row(self, ws: str, sid: str) -> CatalogRow | None:
        return CatalogRow("t", "t", 0) if self.listed else None

    async def keep_create(self, key: str, sid: str, client_id: str, attached: bool) -> None:
        self.kept.append(sid)

    async def claim_create(self, key: str, sid: str, client_id: str, ttl_ms: int) -> None:
        self.record = (sid, client_id)

    async def note_create_request(self, key: str, sid: str, client_id: str, request: str) -> None:
        self.record = (sid, client_id, request)


def state(store: Store) -> Any:
    return SimpleNamespace(store=store, settings=SimpleNamespace(create_timeout_s=10))


@pytest.mark.parametrize("answer,told,listed,outcome", [
    (Reply(ok=True, created_at="t"), False, True, "kept"),  # the answer was still there: taken and told here
    (None, True, True, "kept"),  # taken by an API that told the session, then died
    (Reply(ok=False, code="agent_unavailable"), False, False, "failed"),
    (ABANDONED, False, True, "failed"),  # abandoned: its worker undoes it
    (None, False, False, "failed"),  # never published: its worker undoes it when it answers
    (None, False, True, "unknown"),  # taken, not yet told: the next retry follows it again
])
async def test_a_lapsed_record_is_answered_from_the_first_creates_own_state(answer: Any, told: bool, listed: bool, outcome: str) -> None:
    store = Store(answer, told, listed)
    if outcome == "unknown":
        with pytest.raises(ApiError) as refused:
            await first_create_outcome(state(store), "key", "ws", FIRST)
        assert refused.value.status == 503 and refused.value.body["code"] == "outcome_unknown"
        assert store.record == ("sid-1", "client-1", "req-1") and store.kept == []
        return
    record = await first_create_outcome(state(store), "key", "ws", FIRST)
    if outcome == "kept":
        assert record == FIRST and store.kept == ["sid-1"] and store.told
    else:
        assert record is None and store.kept == []
