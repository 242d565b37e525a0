"""The attention inbox as read from the store's index: an entry's wire item, and pages of
entries of live owners in the visible workspaces, oldest wait first (`GET /attention`, and the
stream's hub loading the whole inbox)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Container, NamedTuple, Sequence

from acp_state.interactions import USER_QUESTION
from acp_state.store import AttentionCursor, AttentionEntry, ReaderStore

Key = tuple[str, str, str | None]  # workspace, session, request (None: the turn error)


def item(entry: AttentionEntry, cwd: str) -> dict[str, Any]:
    """The wire item of one index entry."""
    detail = entry.detail
    if entry.request_id is None:
        kind, title = "turn_error", detail.get("message")
    elif detail.get("kind") == USER_QUESTION:
        questions = detail.get("questions") or [{}]
        first = questions[0] if isinstance(questions[0], dict) else {}
        kind, title = USER_QUESTION, detail.get("title") or first.get("question") or first.get("header")
    else:
        action = detail.get("action") if isinstance(detail.get("action"), dict) else {}
        kind, title = "permission", action.get("title")
    body: dict[str, Any] = {
        "sessionId": entry.sid, "workspaceId": entry.ws, "workspaceCwd": cwd, "kind": kind, "since": entry.since_ms,
    }
    if entry.request_id is not None:
        body["requestId"] = entry.request_id
    if isinstance(title, str) and title:
        body["title"] = title
    return body


def removed_item(key: Key, kind: str) -> dict[str, Any]:
    ws, sid, rid = key
    body: dict[str, Any] = {"sessionId": sid, "workspaceId": ws, "kind": kind}
    if rid is not None:
        body["requestId"] = rid
    return body


class Page(NamedTuple):
    taken: list[AttentionEntry]  # the page's entries
    next: AttentionCursor | None  # where the next page starts (None: at the end)
    complete: bool  # no entry was left out for a lapsed lease (which may yet be renewed)


# Reads entries after a cursor, `limit` from each index it reads, in the attention order,
# and the horizon past which they do not reach (None: they reach the end).
PageRead = Callable[[AttentionCursor | None, int], Awaitable[tuple[list[AttentionEntry], AttentionCursor | None]]]


async def page(
    read: PageRead,
    is_live: Callable[[str], Awaitable[bool]],
    visible: Container[str],
    after: AttentionCursor | None,
    size: int,
) -> Page:
    """Up to `size` entries of live owners in `visible` workspaces after `after`, oldest
    wait first, and the cursor of the next page (None at the end). A page may hold fewer
    than `size` entries and still have a next one: entries of lapsed leases (and, read from
    the deployment's index, of workspaces not visible) are skipped, not replaced."""
    entries, horizon = await read(after, size + 1)
    taken: list[AttentionEntry] = []
    last: AttentionEntry | None = None
    more, complete = horizon is not None, True
    for entry in entries:
        if horizon is not None and entry.order > horizon.order:
            break
        if len(taken) == size:
            more = True
            break
        last = entry
        if entry.ws not in visible:
            continue
        if await is_live(entry.owner):
            taken.append(entry)
        else:
            complete = False
    return Page(taken, last.cursor if more and last is not None else None, complete)


def deployment_read(store: ReaderStore, workspaces: Sequence[str]) -> PageRead:
    """Pages read from the deployment's attention index (its part in each slot the
    workspaces use, on a cluster): one script a page on one Redis, one per slot on a
    cluster, one round trip per shard either way."""

    async def read(after: AttentionCursor | None, limit: int) -> tuple[list[AttentionEntry], AttentionCursor | None]:
        return await store.deployment_attention_page(list(workspaces), after, limit)

    return read


def workspace_read(store: ReaderStore, workspaces: Sequence[str]) -> PageRead:
    """Pages read from each workspace's own index (each workspace's next `limit`: one round
    trip per shard): what a token scoped to one workspace reads.
    (Asking each for a fair share first reads less when waits are spread evenly, but twice
    when one workspace holds the oldest: measured no faster, and it breaks the one round
    trip; see docs/performance.md.)"""

    async def read(after: AttentionCursor | None, limit: int) -> tuple[list[AttentionEntry], AttentionCursor | None]:
        entries = await store.attention_page(list(workspaces), after, limit)
        return entries, _horizon(entries, limit)

    return read


def _horizon(entries: list[AttentionEntry], limit: int) -> AttentionCursor | None:
    """A workspace that filled its share of a read (`limit`) may hold more past its last
    entry: nothing beyond the earliest such last entry can be told in order from the read."""
    last: dict[str, AttentionEntry] = {}
    counts: dict[str, int] = {}
    for entry in entries:
        last[entry.ws] = entry
        counts[entry.ws] = counts.get(entry.ws, 0) + 1
    full = [last[ws].cursor for ws, count in counts.items() if count >= limit]
    return min(full, key=lambda cursor: cursor.order) if full else None
