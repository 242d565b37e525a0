"""The inbox's paging logic on its own (a pure unit test over an in-memory stand-in for the
store's ATTENTION_PAGE): whatever the page size, the number of workspaces and how the waits
are spread, walking the pages gives every live entry once, in order."""

from __future__ import annotations

import random

import pytest

from acp_state.store import AttentionCursor, AttentionEntry
from acp_state.api.attention import page


class Index:
    """Each workspace's entries, answered as ATTENTION_PAGE answers: up to `limit` per
    workspace after the cursor in the attention order, all of them merged in that order."""

    def __init__(self, entries: list[AttentionEntry]) -> None:
        self.entries = sorted(entries, key=lambda e: e.order)
        self.reads = 0

    async def attention_page(self, workspaces: list[str], after: AttentionCursor | None, limit: int) -> list[AttentionEntry]:
        self.reads += 1
        found = []
        for ws in workspaces:
            mine = [e for e in self.entries if e.ws == ws and (after is None or e.order > after.order)]
            found += mine[:limit]
        return sorted(found, key=lambda e: e.order)


def spread(seed: int, workspaces: int, count: int) -> list[AttentionEntry]:
    rng = random.Random(seed)
    entries = []
    for n in range(count):
        ws = f"ws{rng.randrange(workspaces):02d}"
        since = rng.choice([1000, 1000, 2000]) + rng.randrange(50)  # many equal waits
        request = None if n % 5 == 0 else f"r{n}"
        entries.append(AttentionEntry(ws, f"s{rng.randrange(count // 2 + 1):04d}", request, since, f"w{n % 3}", "{}"))
    return list({e.order: e for e in entries}.values())  # one entry per place, as the index keeps


@pytest.mark.parametrize("seed,workspaces,count,size", [
    (1, 1, 30, 7), (2, 10, 300, 100), (3, 10, 1000, 100), (4, 25, 200, 9), (5, 3, 50, 1), (6, 40, 120, 50),
])
async def test_walking_the_pages_gives_every_live_entry_once_in_order(seed: int, workspaces: int, count: int, size: int) -> None:
    entries = spread(seed, workspaces, count)
    index = Index(entries)
    lapsed = "w2"

    async def is_live(owner: str) -> bool:
        return owner != lapsed

    names = sorted({e.ws for e in entries})
    walked, after, pages = [], None, 0
    while True:
        taken, after = await page(index, is_live, names, after, size)  # type: ignore[arg-type]
        assert len(taken) <= size
        walked += taken
        pages += 1
        if after is None:
            break
    assert walked == [e for e in index.entries if e.owner != lapsed]
    assert index.reads == pages  # one read per page: one round trip per shard
