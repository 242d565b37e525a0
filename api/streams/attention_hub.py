"""The attention inbox's hub (`GET /attention/events`, its route `routes/attention.py`):
every visible item of the process's workspaces, followed through their change channels, and
pushed to the streams that show them as `attention_added` and `attention_removed`, each
`id:` `<position>-<epoch>` (`ids.py`); a resume from this hub's memory gets what changed
since, any other a fresh snapshot."""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from typing import Any, Callable

import orjson

from acp_state.store import AttentionCursor, AttentionEntry, Fanout, ReaderStore, WorkerRegistry

from . import ids as stream_ids
from .frames import frame
from .hub import Hub, Listener
from ..reads.attention_index import Key, deployment_read, item, removed_item
from ..reads.attention_pages import AttentionPages

# What the hub reads per page when it loads the whole inbox, and at most in all.
LOAD_PAGE = 1000
MAX_FOLLOWED = 100_000


class AttentionFeed(Hub):
    """Every visible item of the process's workspaces, followed through their change
    channels, and the streams that show them."""

    def __init__(self, store: ReaderStore, registry: WorkerRegistry, fanout: Fanout, workspaces: dict[str, str], forget: Callable[[], None]) -> None:
        super().__init__()
        self._store, self._registry, self._fanout, self._forget = store, registry, fanout, forget
        self._workspaces = workspaces
        self.items: dict[Key, tuple[dict[str, Any], str]] = {}  # -> (wire item, owner)
        # Every change pushed moves `position`; an id names it with this hub's own epoch, so a
        # resume is told from memory only here, while this hub runs.
        self.epoch, self.position = secrets.token_hex(8), 0
        self.memory = stream_ids.ChangeMemory[Key]()
        self._left: OrderedDict[Key, str] = OrderedDict()  # items removed, while remembered -> kind

    name = "attention feed"

    async def _follow(self) -> None:
        for ws in sorted(self._workspaces):
            await self._fanout.watch(ws)

    def _forgotten(self) -> None:
        self._forget()

    def changed(self, ws: str, sid: str) -> None:
        if ws in self._workspaces:
            self.hear((ws, sid))

    async def _take(self, batch: list[tuple[str, str] | None]) -> None:
        if None in batch:
            return await self._reload()
        sessions = list(dict.fromkeys(item for item in batch if item is not None))
        found = await asyncio.gather(*(self._store.attention_of(ws, sid) for ws, sid in sessions))
        for (ws, sid), entries in zip(sessions, found, strict=True):
            current = {key: value for key, value in (await self._visible(entries)).items()}
            before = {key for key in self.items if key[0] == ws and key[1] == sid}
            self._replace(before, current)

    async def _visible(self, entries: list[AttentionEntry]) -> dict[Key, tuple[dict[str, Any], str]]:
        return {
            (e.ws, e.sid, e.request_id): (item(e, self._workspaces[e.ws]), e.owner)
            for e in entries
            if e.ws in self._workspaces and await self._registry.is_live(e.owner)
        }

    def _replace(self, before: set[Key], current: dict[Key, tuple[dict[str, Any], str]]) -> None:
        """Items `before` are replaced by `current`: push what left and what came."""
        for key in sorted(before - current.keys()):
            self._remove(key)
        for key, value in current.items():
            if self.items.get(key, (None,))[0] != value[0]:
                self.items[key] = value
                added = frame("attention_added", orjson.dumps(value[0]).decode(), self._note(key))
                self.broadcast(lambda listener, ws=key[0], f=added: f if listener.accepts(ws) else None)

    def _remove(self, key: Key) -> None:
        wire, _ = self.items.pop(key)
        removed = frame("attention_removed", orjson.dumps(removed_item(key, wire["kind"])).decode(), self._note(key, wire["kind"]))
        self.broadcast(lambda listener: removed if listener.accepts(key[0]) else None)

    async def _reload(self) -> None:
        """Read the whole inbox again and push the difference."""
        current: dict[Key, tuple[dict[str, Any], str]] = {}
        after: AttentionCursor | None = None
        read = deployment_read(self._store, sorted(self._workspaces))
        while len(current) < MAX_FOLLOWED:
            entries, after = await read(after, LOAD_PAGE)
            current.update(await self._visible(entries))
            if after is None:
                break  # every workspace answered all it holds past the cursor
        self._replace(set(self.items), current)

    async def _check_owners(self) -> None:
        lapsed = {owner for _, owner in self.items.values() if not await self._registry.is_live(owner)}
        for key in sorted(key for key, (_, owner) in self.items.items() if owner in lapsed):
            self._remove(key)

    def snapshot_for(self, listener: Listener) -> bytes:
        return self.snapshot(listener.accepts)

    def snapshot(self, accepts: Callable[[str], bool]) -> bytes:
        visible = sorted((wire for (ws, _, _), (wire, _) in self.items.items() if accepts(ws)), key=_order)
        return frame("attention_snapshot", orjson.dumps({"items": visible}).decode(), stream_ids.compose(self.position, self.epoch))

    def _note(self, key: Key, left: str | None = None) -> str:
        """An item was added, replaced or removed (`left`: its kind): the id of that change."""
        self.position += 1
        self.memory.note(key, self.position, len(self.items))
        if left is None:
            self._left.pop(key, None)
        else:
            self._left[key] = left
            while len(self._left) > stream_ids.REMEMBERED_CHANGES:
                self._left.popitem(last=False)
        return stream_ids.compose(self.position, self.epoch)

    def resume(self, position: int, epoch: str | None, accepts: Callable[[str], bool]) -> bytes:
        """What a stream that saw `position` of `epoch` missed, as the frames of each item's
        last change (b"" if nothing), or a snapshot when that cannot be told from memory."""
        if epoch != self.epoch or not self.memory.covers(position, self.position):
            return self.snapshot(accepts)
        missed = []
        for key in self.memory.after(position):
            event_id = stream_ids.compose(int(self.memory.at[key]), self.epoch)
            if not accepts(key[0]):
                continue
            if key in self.items:
                missed.append(frame("attention_added", orjson.dumps(self.items[key][0]).decode(), event_id))
            elif key in self._left:
                missed.append(frame("attention_removed", orjson.dumps(removed_item(key, self._left[key])).decode(), event_id))
        return b"".join(missed)


def _order(wire: dict[str, Any]) -> tuple[int, str, str, str]:
    return wire["since"], wire["workspaceId"], wire["sessionId"], wire.get("requestId") or "!"


class AttentionFeeds:
    """The process's one attention hub, started by its first stream."""

    def __init__(self, store: ReaderStore, registry: WorkerRegistry, fanout: Fanout, workspaces: dict[str, str]) -> None:
        self._args = (store, registry, fanout, workspaces)
        self.every = tuple(sorted(workspaces))  # the process's workspaces, as a page spans them
        self.pages = AttentionPages(fanout)  # GET /attention's kept answers
        self._feed: AttentionFeed | None = None
        self._starting: asyncio.Task[AttentionFeed] | None = None
        self._ending = False

    async def feed(self) -> AttentionFeed:
        if self._feed is not None:
            return self._feed
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> AttentionFeed:
        feed = AttentionFeed(*self._args, forget=self._forget)
        await feed.start()
        self._feed = feed
        if self._ending:
            feed.end()
        return feed

    def _forget(self) -> None:
        self._feed = None

    def changed(self, ws: str, sid: str) -> None:
        self.pages.changed()
        if self._feed is not None:
            self._feed.changed(ws, sid)

    def reset(self) -> None:
        self.pages.changed()
        if self._feed is not None:
            self._feed.reset()

    def end(self) -> None:
        self._ending = True
        if self._feed is not None:
            self._feed.end()

    def stop(self) -> None:
        if self._feed is not None:
            self._feed.stop()
