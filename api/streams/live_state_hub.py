"""The hubs behind `GET /workspaces/:workspace/sessions/live-state/events` (its route:
`routes/live_feed.py`): a workspace's live state, pushed.

The stream starts with `live_state_snapshot` (the live-state body: `v`, `catalogVersion`,
`sessions`), then sends one `live_state_changed` per change of a row: `{catalogVersion,
sessions: [changed rows], removed: [session ids]}`. Each frame's `id:` is
`<revision>-<generation>` (`ids.py`): all a resume needs. A session whose
owner's lease lapsed is removed at once, before any sweeper ran (same id: its revision did
not move).

One `WorkspaceFeed` per workspace and process follows the workspace's change channel, where
every change is announced with the revision it moved the workspace to, reads the changed
session once and pushes one frame to every listener. A revision skipped (pub/sub lost a
message) or one that falls (a new generation: Redis lost the workspace) makes it read the
whole live state again and push the difference, or a new snapshot.

Resume: `Last-Event-ID` (or `?lastEventId=`) alone, as a browser's EventSource sends it,
gets what changed since that revision: from the feed's memory, or, for a revision from
before the feed started (a restarted process, another one behind a load balancer), from the
workspace's change log in Redis (`ReaderStore.changed_since`: each session's last change
revision). The older form, a bare revision with the stream's `generation` beside it (the
`X-Acp-Catalog-Generation` response header; sent back as `?generation=` or that header), is
still read; a generation in the id wins over one beside it (a browser's reconnect repeats
the URL it first opened). A generation that differs, or a revision older than the change
log's floor, gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from acp_state.store import STORE_ERRORS, Change, Fanout, ReaderStore, SessionView, WorkerRegistry

from . import ids as stream_ids
from .frames import frame
from .hub import Hub, Listener
from ..reads.summaries import live_state_row

log = logging.getLogger("api.live_feed")

# Most changes move no row a listener sees (a turn's every update, a create's answer taken
# after the session was read), so its last frame's id falls behind the revision, and a
# reconnect to a feed that started since (a restarted API process, another one) would be sent
# every row the change log names since, though none changed. The revision is told this long
# after such changes.
ID_FOLLOWS_S = 1.0


class WorkspaceFeed(Hub):
    """One workspace's live rows as this process follows them, and their listeners."""

    def __init__(self, store: ReaderStore, registry: WorkerRegistry, fanout: Fanout, ws: str, forget: Any) -> None:
        super().__init__()
        self.ws = ws
        self._store, self._registry, self._fanout, self._forget = store, registry, fanout, forget
        self.generation = ""
        self.revision = 0
        self.rows: dict[str, dict[str, Any]] = {}
        self.owners: dict[str, str] = {}
        # sid -> the revision of its row's last change; a removal for a lapsed lease counts
        # half a revision later than the revision it was seen at.
        self.memory = stream_ids.ChangeMemory[str]()
        # The live sessions readers did not see at the feed's start (an owner's lease lapsed,
        # a create not yet told): a client resuming from before the start may hold their rows.
        self._hidden_at_start: tuple[str, ...] = ()
        self._fresh = True  # announcements that queued during the last whole read are in it
        self._told = 0  # the revision whose id the listeners were last sent
        self._telling: asyncio.TimerHandle | None = None

    name = "live feed"

    async def _follow(self) -> None:
        await self._fanout.watch(self.ws)

    def _forgotten(self) -> None:
        if self._telling is not None:
            self._telling.cancel()
        self._forget(self)

    def changed(self, change: Change) -> None:
        self.hear(change)

    async def _take(self, batch: list[Change | None]) -> None:
        todo: list[tuple[str, int]] = []
        expected = self.revision
        for change in batch:
            if change is None or change.generation != self.generation:
                return await self._resync()  # messages lost, or a new generation began
            if change.revision <= expected and self._fresh:
                continue  # announced before the whole read that holds it
            if change.revision != expected + 1:
                return await self._resync()  # one was missed
            todo.append((change.sid, change.revision))
            expected = change.revision
        if not todo:
            return
        self._fresh = False
        sids = list(dict.fromkeys(sid for sid, _ in todo))
        found = dict(zip(sids, await asyncio.gather(*(self._visible(sid) for sid in sids)), strict=True))
        for sid, revision in todo:
            self.revision = revision
            if self._set(sid, found[sid], revision, announced=True):
                row = self.rows.get(sid)
                self._push(self._changed([row] if row else [], [] if row else [sid]))
        self._revision_moved()

    async def _visible(self, sid: str) -> tuple[dict[str, Any], str] | None:
        view = await self._store.session(self.ws, sid)
        return await self._row(view) if view is not None else None

    async def _row(self, view: SessionView) -> tuple[dict[str, Any], str] | None:
        """The session's row and owner, if readers see it (told, and its lease holds)."""
        if view.told and await self._registry.is_live(view.owner):
            return live_state_row(view), view.owner
        return None

    def _set(self, sid: str, found: tuple[dict[str, Any], str] | None, at: float, announced: bool = False) -> bool:
        """Take the session's current row (None: not live) as of revision `at`; True if its
        row changed. A change announced at `at` is remembered for resumes even when the row
        was already so: a whole read (which reads the version first) may have taken it in
        before its announcement came, and a client that saw an earlier revision, here or on
        another process, still lacks it."""
        if found is None:
            changed = self.rows.pop(sid, None) is not None
            self.owners.pop(sid, None)
        else:
            row, self.owners[sid] = found
            changed = self.rows.get(sid) != row
            self.rows[sid] = row
        if not (changed or announced):
            return False
        self.memory.note(sid, at, len(self.rows))
        return changed

    async def _resync(self) -> None:
        """Read the whole live state; push the difference, or a snapshot for a new generation."""
        version, views = (await self._store.live_states([self.ws]))[self.ws]
        current = {view.meta["sessionId"]: await self._row(view) for view in views}
        self._fresh = True
        if version.generation != self.generation:
            self.generation, self.revision = version.generation, version.revision
            self.memory = stream_ids.ChangeMemory(since=version.revision)
            self._hidden_at_start = tuple(sid for sid, found in current.items() if found is None)
            self.rows = {sid: found[0] for sid, found in current.items() if found is not None}
            self.owners = {sid: found[1] for sid, found in current.items() if found is not None}
            self._push(self.snapshot())
            return
        self.revision = max(self.revision, version.revision)
        changed = [sid for sid in sorted({*self.rows, *current}) if self._set(sid, current.get(sid), self.revision)]
        if changed:
            sessions = [self.rows[sid] for sid in changed if sid in self.rows]
            self._push(self._changed(sessions, [sid for sid in changed if sid not in self.rows]))
        self._revision_moved()

    async def _check_owners(self) -> None:
        """Remove, at once, the sessions of owners whose lease lapsed."""
        lapsed = {owner for owner in set(self.owners.values()) if not await self._registry.is_live(owner)}
        gone = sorted(sid for sid, owner in self.owners.items() if owner in lapsed)
        if gone:
            for sid in gone:
                self._set(sid, None, self.revision + 0.5)
            self._push(self._changed([], gone))

    def _push(self, frame: bytes) -> None:
        """One frame to every listener (at the feed's revision)."""
        self.broadcast_all(frame)
        self._told = self.revision

    def _revision_moved(self) -> None:
        if self.revision != self._told and self._telling is None:
            self._telling = asyncio.get_running_loop().call_later(ID_FOLLOWS_S, self._tell_revision)

    def _tell_revision(self) -> None:
        """Changes that moved no row left the listeners' last id behind the revision: an
        `id:` with no event moves their resume point (once a second at most, and only then)."""
        self._telling = None
        if self.revision != self._told and self.generation:
            self._push(f"id: {self.event_id()}\n\n".encode())

    async def _keepalive(self) -> None:
        """The keepalive names the feed's revision too (see `_tell_revision`). Each listener
        has been sent every frame before it: frames go out in order."""
        self.broadcast_all(f"id: {self.event_id()}\n: keepalive\n\n".encode())

    # ---- frames -------------------------------------------------------------------------

    def _version(self) -> dict[str, Any]:
        return {"generation": self.generation, "revision": self.revision}

    def snapshot(self) -> bytes:
        body = {"v": 1, "catalogVersion": self._version(), "sessions": [self.rows[sid] for sid in sorted(self.rows)]}
        return frame("live_state_snapshot", orjson.dumps(body).decode(), self.event_id())

    def snapshot_for(self, listener: Listener) -> bytes:
        return self.snapshot()

    def _changed(self, sessions: list[dict[str, Any]], removed: list[str]) -> bytes:
        body = {"catalogVersion": self._version(), "sessions": sessions, "removed": removed}
        return frame("live_state_changed", orjson.dumps(body).decode(), self.event_id())

    def event_id(self) -> str:
        """The `id:` of a frame at the feed's revision: the revision with its generation."""
        return stream_ids.compose(self.revision, self.generation)

    async def resume(self, last_id: int, generation: str | None) -> bytes:
        """What a client that saw revision `last_id` of `generation` missed (b"" if nothing),
        or a snapshot when that cannot be told. A revision this feed has not reached yet was
        seen on a process that heard it first: nothing is missed, and what this feed pushes
        as it catches up is the rows as they are now.

        A revision from before the feed's memory (it started since: a restarted process,
        another one) is answered from Redis's change log, with the rows as the feed holds
        them; frames the feed pushes meanwhile queue behind this one, in order, so each row
        ends as the feed's latest."""
        if generation != self.generation:
            return self.snapshot()
        if self.memory.covers(min(last_id, self.revision), self.revision):
            return self._missed(self.memory.after(last_id))
        try:
            logged = await self._store.changed_since(self.ws, generation, last_id)
        except STORE_ERRORS as error:
            log.warning("live feed %s: change log unreadable, resume gets a snapshot: %r", self.ws, error)
            logged = None
        if logged is None or generation != self.generation:
            return self.snapshot()
        # Since the feed's start: its own memory (owners whose lease lapsed) and the sessions
        # hidden when it started, beside what Redis logged.
        return self._missed(list(dict.fromkeys([*logged, *self.memory.after(last_id), *self._hidden_at_start])))

    def _missed(self, missed: list[str]) -> bytes:
        if not missed:
            return b""
        return self._changed([self.rows[s] for s in missed if s in self.rows], [s for s in missed if s not in self.rows])


class LiveFeeds:
    """The workspace feeds of one API process."""

    def __init__(self, store: ReaderStore, registry: WorkerRegistry, fanout: Fanout) -> None:
        self._store, self._registry, self._fanout = store, registry, fanout
        self._feeds: dict[str, WorkspaceFeed] = {}
        self._starting: dict[str, asyncio.Task[WorkspaceFeed]] = {}
        self._ending = False

    async def feed(self, ws: str) -> WorkspaceFeed:
        """The workspace's feed, started (once, whoever asks meanwhile) if it was not."""
        feed = self._feeds.get(ws)
        if feed is not None:
            return feed
        if ws not in self._starting:
            self._starting[ws] = asyncio.ensure_future(self._start(ws))
        try:
            return await asyncio.shield(self._starting[ws])
        finally:
            if self._starting.get(ws) is not None and self._starting[ws].done():
                del self._starting[ws]

    async def _start(self, ws: str) -> WorkspaceFeed:
        feed = WorkspaceFeed(self._store, self._registry, self._fanout, ws, self._forget)
        await feed.start()
        self._feeds[ws] = feed
        if self._ending:
            feed.end()
        return feed

    def _forget(self, feed: WorkspaceFeed) -> None:
        if self._feeds.get(feed.ws) is feed:
            del self._feeds[feed.ws]

    def changed(self, change: Change) -> None:
        feed = self._feeds.get(change.ws)
        if feed is not None:
            feed.changed(change)

    def reset(self) -> None:
        for feed in self._feeds.values():
            feed.reset()

    def end(self) -> None:
        self._ending = True
        for feed in self._feeds.values():
            feed.end()

    def stop(self) -> None:
        for feed in list(self._feeds.values()):
            feed.stop()

    @property
    def listeners(self) -> int:
        return sum(len(feed.listeners) for feed in self._feeds.values())
