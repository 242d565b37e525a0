"""The inbox's paging logic on its own (a pure unit test over an in-memory stand-in for the
store's ATTENTION_PAGE, read per workspace or from the deployment's index): whatever the
page size, the number of workspaces and how the waits are spread, walking the pages gives
every live entry of the visible workspaces once, in order."""

from __future__ import annotations

import random

import pytest

from acp_state.store import AttentionCursor, AttentionEntry
from acp_state.api.reads.attention_index import deployment_read, page, workspace_read


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

    async def deployment_attention_page(
        self, workspaces: list[str], after: AttentionCursor | None, limit: int
    ) -> tuple[list[AttentionEntry], AttentionCursor | None]:
        """One index holding every workspace's entries (a single Redis)."""
        self.reads += 1
        found = [e for e in self.entries if after is None or e.order > after.order][:limit]
        return found, found[-1].cursor if len(found) == limit else None


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
        found = await page(workspace_read(index, names), is_live, set(names), after, size)  # type: ignore[arg-type]
        taken, after = found.taken, found.next
        assert len(taken) <= size
        walked += taken
        pages += 1
        if after is None:
            break
    assert walked == [e for e in index.entries if e.owner != lapsed]
    assert index.reads == pages  # one read per page: one round trip per shard


@pytest.mark.parametrize("seed,workspaces,count,size", [(7, 10, 1000, 100), (8, 4, 90, 7), (9, 1, 30, 30)])
async def test_pages_of_the_deployment_index_give_every_visible_live_entry_once_in_order(
    seed: int, workspaces: int, count: int, size: int
) -> None:
    entries = spread(seed, workspaces, count)
    index = Index(entries)
    names = sorted({e.ws for e in entries})
    visible = set(names[: max(1, len(names) - 1)])  # the deployment may hold workspaces this process does not serve

    async def is_live(owner: str) -> bool:
        return owner != "w1"

    walked, after, pages, complete = [], None, 0, True
    while True:
        found = await page(deployment_read(index, names), is_live, visible, after, size)  # type: ignore[arg-type]
        assert len(found.taken) <= size
        walked += found.taken
        complete = complete and found.complete
        pages += 1
        after = found.next
        if after is None:
            break
    assert walked == [e for e in index.entries if e.owner != "w1" and e.ws in visible]
    assert index.reads == pages
    assert not complete  # a page that left out a lapsed lease's item says so (it is not kept)
