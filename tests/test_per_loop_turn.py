"""`PerLoopTurn`: the calls of one event-loop turn go out as one batch (a burst of creates
sends one pipeline for its index entries and one for its replies, not one each)."""

from __future__ import annotations

import asyncio

import pytest

from acp_state.store.batching import PerLoopTurn


async def test_calls_of_one_turn_share_one_send_and_each_gets_its_own_answer() -> None:
    sent: list[list[int]] = []

    async def send(calls: list[int]) -> list[int | Exception]:
        sent.append(calls)
        await asyncio.sleep(0)  # a round trip
        return [ValueError(f"no {n}") if n == 3 else n * 10 for n in calls]

    batched = PerLoopTurn(send)
    results = await asyncio.gather(*(batched(n) for n in range(5)), return_exceptions=True)
    assert sent == [[0, 1, 2, 3, 4]]
    assert results[:3] == [0, 10, 20] and results[4] == 40
    assert isinstance(results[3], ValueError) and str(results[3]) == "no 3"
    assert await batched(7) == 70  # a later turn: a batch of its own
    assert sent[-1] == [7]


async def test_a_send_that_fails_fails_every_call_of_its_batch() -> None:
    async def send(calls: list[str]) -> list[str]:
        raise ConnectionError("the store is away")

    batched = PerLoopTurn(send)
    results = await asyncio.gather(batched("a"), batched("b"), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError, ConnectionError]
    with pytest.raises(ConnectionError):
        await batched("c")
