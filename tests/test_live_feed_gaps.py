"""The live feed's own logic on the embedded store (a pure unit test: no processes): what it
does when the change channel skips a revision, which real pub/sub does too rarely to force."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import orjson

from acp_state.ids import new_id
from acp_state.store import CatalogRow, Change, Mode, RedisStore, Transition, WorkerRegistry, WorkerReport, keys
from acp_state.api.streams.live_state_hub import WorkspaceFeed
from acp_state.api.streams.hub import Listener
from tests.helpers import eventually


class Channel:
    """Stands for the fan-out: the test delivers the change messages itself."""

    async def watch(self, ws: str) -> bool:
        return True


async def next_frame(listener: Listener) -> tuple[str, dict[str, Any]]:
    """The one frame the listener gets next."""
    await asyncio.wait_for(listener.wait(), 10)  # the feed's task runs on this loop
    raw = listener.drain()
    assert raw.count(b"\n\n") == 1, raw
    fields = dict(line.split(": ", 1) for line in raw.decode().strip().splitlines())
    return fields["event"], orjson.loads(fields["data"])


async def test_a_skipped_revision_makes_the_feed_read_the_whole_state_again() -> None:
    store = RedisStore.from_url(f"memory://feed-{secrets.token_hex(4)}")
    ws, inc = secrets.token_hex(8), f"w-{secrets.token_hex(4)}"
    await store.heartbeat(inc, WorkerReport(inc), 60_000)
    first, second = new_id(), new_id()
    for sid in (first, second):
        meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
        await store.apply(ws, sid, inc, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    feed = WorkspaceFeed(store, WorkerRegistry(store), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await feed.start()
    listener = Listener()
    feed.add(listener)
    start = feed.revision

    await store.apply(ws, second, inc, Transition(active=True))  # announced as start + 1: lost
    await store.apply(ws, first, inc, Transition(active=True))  # start + 2
    feed.changed(Change(ws, first, start + 2, feed.generation))
    event, body = await next_frame(listener)
    assert feed.revision == start + 2
    assert event == "live_state_changed" and body["removed"] == []
    assert {row["sessionId"]: row["hasActivePrompt"] for row in body["sessions"]} == {first: True, second: True}
    feed.stop()
    await store.close()


async def test_a_change_of_another_generation_gets_a_new_snapshot() -> None:
    """Redis lost the workspace's version (restarted empty, or it sat idle past its TTL)
    while the feed's subscription held: the next change names a new generation, whose
    revisions start again, and the feed starts over from a whole read."""
    store = RedisStore.from_url(f"memory://feed-{secrets.token_hex(4)}")
    ws, inc, sid = secrets.token_hex(8), f"w-{secrets.token_hex(4)}", new_id()
    await store.heartbeat(inc, WorkerReport(inc), 60_000)
    meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
    await store.apply(ws, sid, inc, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    for _ in range(3):
        await store.apply(ws, sid, inc, Transition(active=True))
    feed = WorkspaceFeed(store, WorkerRegistry(store), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await feed.start()
    listener = Listener()
    feed.add(listener)
    old = feed.generation

    await store.redis.delete(keys.catalog_version(ws))
    await store.apply(ws, sid, inc, Transition(active=False))  # revision 1 of a new generation
    now = await store.catalog_version(ws)
    assert now.generation != old and now.revision == 1
    feed.changed(Change(ws, sid, 1, now.generation))
    event, body = await next_frame(listener)
    assert event == "live_state_snapshot" and body["catalogVersion"] == {"generation": now.generation, "revision": 1}
    assert [row["hasActivePrompt"] for row in body["sessions"]] == [False]
    feed.stop()
    await store.close()


class VersionReadEarlier:
    """The store, but a whole read answers the version it had before the latest change: as
    when a change lands between the whole read's version and its sessions (the version is
    read first)."""

    def __init__(self, store: RedisStore, version: Any) -> None:
        self._store, self._version = store, version

    async def live_states(self, workspaces: list[str]) -> dict[str, Any]:
        return {ws: (self._version, views) for ws, (_, views) in (await self._store.live_states(workspaces)).items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_a_change_a_whole_read_took_in_before_its_announcement_is_still_resumed() -> None:
    """The feed's whole read holds a change (revision R+1) under the version before it (R);
    its announcement, when it comes, changes no row the feed holds, so nothing is pushed, but
    a client that saw revision R (here, or on a process whose read came earlier) still lacks
    it: a resume from R gets it."""
    store = RedisStore.from_url(f"memory://feed-{secrets.token_hex(4)}")
    ws, inc, sid = secrets.token_hex(8), f"w-{secrets.token_hex(4)}", new_id()
    await store.heartbeat(inc, WorkerReport(inc), 60_000)
    meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
    await store.apply(ws, sid, inc, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    before = await store.catalog_version(ws)
    await store.apply(ws, sid, inc, Transition(active=True))  # revision before.revision + 1
    feed = WorkspaceFeed(VersionReadEarlier(store, before), WorkerRegistry(store), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await feed.start()
    assert feed.revision == before.revision and feed.rows[sid]["hasActivePrompt"] is True
    listener = Listener()
    feed.add(listener)
    feed.changed(Change(ws, sid, before.revision + 1, before.generation))
    await eventually(lambda: feed.revision == before.revision + 1, "the feed took the announcement")
    assert not listener.frames  # no row changed: nothing pushed

    raw = await feed.resume(before.revision, before.generation)
    fields = dict(line.split(": ", 1) for line in raw.decode().strip().splitlines())
    assert fields["event"] == "live_state_changed" and fields["id"] == f"{before.revision + 1}-{before.generation}"
    assert [row["sessionId"] for row in orjson.loads(fields["data"])["sessions"]] == [sid]
    feed.stop()
    await store.close()


async def test_changes_that_move_no_row_still_move_the_listeners_resume_point() -> None:
    """A change that moves no row pushes no frame, so a listener's last id falls behind the
    revision; a feed that starts afterwards (a restarted process, another one) answers a
    resume from before its start from Redis's change log, with the rows logged since. The
    feed tells the revision soon after (an `id:` with no event), and a resume from it is
    answered there with nothing missed."""
    store = RedisStore.from_url(f"memory://feed-{secrets.token_hex(4)}")
    ws, inc, sid = secrets.token_hex(8), f"w-{secrets.token_hex(4)}", new_id()
    await store.heartbeat(inc, WorkerReport(inc), 60_000)
    meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
    await store.apply(ws, sid, inc, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    feed = WorkspaceFeed(store, WorkerRegistry(store), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await feed.start()
    listener = Listener()
    feed.add(listener)
    seen = feed.revision  # the listener's last id: the snapshot's

    await store.apply(ws, sid, inc, Transition(mode=Mode.UPDATE))  # announced; its row stays as it was
    now = await store.catalog_version(ws)
    assert now.revision == seen + 1
    feed.changed(Change(ws, sid, now.revision, now.generation))
    await asyncio.wait_for(listener.wait(), 10)
    assert listener.drain() == f"id: {now.revision}-{now.generation}\n\n".encode()

    later = WorkspaceFeed(store, WorkerRegistry(store), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await later.start()  # knows nothing from before its start
    logged = (await later.resume(seen, now.generation)).decode()  # from the last frame: the change log's
    fields = dict(line.split(": ", 1) for line in logged.strip().splitlines())
    assert fields["event"] == "live_state_changed" and fields["id"] == f"{now.revision}-{now.generation}"
    assert [row["sessionId"] for row in orjson.loads(fields["data"])["sessions"]] == [sid]
    assert await later.resume(now.revision, now.generation) == b""  # from the id told: nothing missed
    feed.stop()
    later.stop()
    await store.close()


class Lapsed(WorkerRegistry):
    """The lease view with these incarnations' leases lapsed (no sweeper has run yet)."""

    def __init__(self, store: RedisStore, lapsed: set[str]) -> None:
        super().__init__(store)
        self.lapsed = lapsed

    async def is_live(self, incarnation: str) -> bool:
        return incarnation not in self.lapsed and await super().is_live(incarnation)


async def test_a_feed_started_since_answers_a_resume_from_the_change_log() -> None:
    """A feed that started after the client's last revision answers from Redis's change log
    what changed since, with the sessions it found hidden at its start (a lease lapsed, not
    yet swept: no change was logged for them, but the client may still show them) as removed.
    What the log cannot tell (another generation, a revision below its floor) gets a snapshot."""
    store = RedisStore.from_url(f"memory://feed-{secrets.token_hex(4)}")
    ws, inc, gone_inc = secrets.token_hex(8), f"w-{secrets.token_hex(4)}", f"w-{secrets.token_hex(4)}"
    kept, still, orphan = new_id(), new_id(), new_id()
    for owner in (inc, gone_inc):
        await store.heartbeat(owner, WorkerReport(owner), 60_000)
    for sid, owner in ((kept, inc), (still, inc), (orphan, gone_inc)):
        meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
        await store.apply(ws, sid, owner, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    seen = await store.catalog_version(ws)  # the client's last id: every session shown
    await store.apply(ws, kept, inc, Transition(active=True))
    feed = WorkspaceFeed(store, Lapsed(store, {gone_inc}), Channel(), ws, forget=lambda feed: None)  # type: ignore[arg-type]
    await feed.start()
    assert feed.revision == seen.revision + 1 and sorted(feed.rows) == sorted([kept, still])

    fields = dict(line.split(": ", 1) for line in (await feed.resume(seen.revision, seen.generation)).decode().strip().splitlines())
    body = orjson.loads(fields["data"])
    assert fields["event"] == "live_state_changed" and fields["id"] == f"{seen.revision + 1}-{seen.generation}"
    assert [row["sessionId"] for row in body["sessions"]] == [kept] and body["sessions"][0]["hasActivePrompt"] is True
    assert body["removed"] == [orphan]

    assert b"event: live_state_snapshot" in await feed.resume(seen.revision, "1")  # another generation
    await store.redis.zadd(keys.change_log(ws), {keys.CHANGE_LOG_FLOOR: seen.revision + 1})  # it forgot
    assert b"event: live_state_snapshot" in await feed.resume(seen.revision, seen.generation)
    feed.stop()
    await store.close()
