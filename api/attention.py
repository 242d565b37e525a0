"""The attention inbox: every live session, across the workspaces a token may see, that
waits for a human (`GET /attention`), and its changes pushed (`GET /attention/events`).

An item is a pending permission, a pending question, or a turn error:
`{sessionId, workspaceId, workspaceCwd, kind, since, requestId?, title?}`, oldest wait
first. The index behind it is kept by the worker's transitions and the votes themselves,
in the same script as the change (acp_state/store/lua/attention.lua), once per workspace and
once for the deployment (per cluster slot). A page over every workspace of the process is
read from the deployment's index (one script on one Redis: one round trip per shard), one
of a token scoped to a workspace from that workspace's; either is kept until a change is
announced (`attention_cache`). Items whose owner's lease lapsed are left out at once, and
leave the index when the sweeper removes their sessions. The stream's hub loads the inbox
from the deployment's index too.

The stream starts with `attention_snapshot` (`{items}`, every visible item, oldest first),
then sends `attention_added` (an item) and `attention_removed` (`{sessionId, workspaceId,
kind, requestId?}`). Each frame's `id:` is `<position>-<epoch>` (`stream_ids`): the count of
changes the process's hub pushed, and the hub's own epoch. A reconnect with `Last-Event-ID`
alone, on the process whose hub it came from while that hub runs, gets what changed since;
any other resume gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Container, Mapping, NamedTuple, Sequence

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state.interactions import USER_QUESTION
from acp_state.store import AttentionCursor, AttentionEntry, Fanout, ReaderStore, WorkerRegistry

from . import stream_ids
from .attention_cache import AttentionPages, KeptPage
from .auth import Principal, principal_of
from .push import Hub, Listener, frames, stream_response
from .responses import JSON_TYPE, ApiError, OrjsonResponse, parse_decimal
from .sse import frame
from .state import AppState, app_state

DEFAULT_SIZE = 50
MAX_SIZE = 500
# What the stream's hub reads per page when it loads the whole inbox, and at most in all.
LOAD_PAGE = 1000
MAX_FOLLOWED = 100_000

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


def _removed(key: Key, kind: str) -> dict[str, Any]:
    ws, sid, rid = key
    body: dict[str, Any] = {"sessionId": sid, "workspaceId": ws, "kind": kind}
    if rid is not None:
        body["requestId"] = rid
    return body


# ---- GET /attention ---------------------------------------------------------------------


def _encode_cursor(cursor: AttentionCursor) -> str:
    packed = orjson.dumps([cursor.since_ms, cursor.ws, cursor.sid, cursor.request_id])
    return base64.urlsafe_b64encode(packed).decode().rstrip("=")


def _decode_cursor(text: str) -> AttentionCursor:
    try:
        since, ws, sid, rid = orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if not (isinstance(since, int) and isinstance(ws, str) and isinstance(sid, str) and (rid is None or isinstance(rid, str))):
            raise ValueError(text)
    except (ValueError, TypeError, binascii.Error, orjson.JSONDecodeError):
        raise ApiError(400, "cursor must be a nextCursor this route returned", "invalid_cursor") from None
    return AttentionCursor(since, ws, sid, rid)


def asked(params: Mapping[str, str]) -> tuple[int, str, AttentionCursor | None]:
    """A page's size, its cursor as sent ('' for the first page) and as read; a 400 if bad."""
    size_text = params.get("size")
    size = DEFAULT_SIZE if size_text is None else parse_decimal(size_text, MAX_SIZE)
    if size is None or size < 1:
        raise ApiError(400, f"size must be an integer from 1 to {MAX_SIZE}", "invalid_size")
    cursor_text = params.get("cursor") or ""
    return size, cursor_text, _decode_cursor(cursor_text) if cursor_text else None


def visible(feeds: AttentionFeeds, principal: Principal) -> tuple[str, ...]:
    """The process's workspaces the principal may see, in order (all: `feeds.every` itself)."""
    return feeds.every if principal.workspaces is None else tuple(ws for ws in feeds.every if principal.may(ws))


async def kept_page(state: AppState, principal: Principal, size: int, cursor_text: str) -> KeptPage | None:
    """The page this process keeps for the request, current (`AttentionPages.kept`): what
    the hot reads send without the route."""
    workspaces = visible(state.attention, principal)
    return await state.attention.pages.kept((workspaces, cursor_text, size), state.registry) if workspaces else None


async def attention_page(request: Request) -> Response:
    """`GET /attention?size=&cursor=` -> `{items, nextCursor}`."""
    state = app_state(request)
    size, cursor_text, after = asked(request.query_params)
    feeds = state.attention
    workspaces = visible(feeds, principal_of(request))
    if not workspaces:
        return OrjsonResponse({"items": [], "nextCursor": None})
    key = (workspaces, cursor_text, size)

    async def read() -> tuple[bytes, frozenset[str], bool]:
        # Every workspace of the process: the deployment's index; one (a scoped token): its own.
        reader = deployment_read(state.store, workspaces) if workspaces is feeds.every else workspace_read(state.store, workspaces)
        found = await page(reader, state.registry.is_live, set(workspaces), after, size)
        body = orjson.dumps({
            "items": [item(entry, state.workspaces[entry.ws]) for entry in found.taken],
            "nextCursor": _encode_cursor(found.next) if found.next else None,
        })
        return body, frozenset(entry.owner for entry in found.taken), found.complete

    body, etag = await feeds.pages.answer(key, state.registry, read)
    return Response(body, media_type=JSON_TYPE, headers={"ETag": etag})


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


# ---- GET /attention/events --------------------------------------------------------------


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
        removed = frame("attention_removed", orjson.dumps(_removed(key, wire["kind"])).decode(), self._note(key, wire["kind"]))
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
                missed.append(frame("attention_removed", orjson.dumps(_removed(key, self._left[key])).decode(), event_id))
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


async def attention_events(request: Request) -> Response:
    """`GET /attention/events`: the inbox's snapshot, then its additions and removals."""
    state = app_state(request)
    feed = await state.attention.feed()
    principal = principal_of(request)
    listener = Listener(accepts=principal.may)
    feed.add(listener)  # nothing is awaited from here to the first frame: no change falls between
    point = stream_ids.parse(request.headers.get("last-event-id") or request.query_params.get("lastEventId"))
    first = feed.snapshot(principal.may) if point is None else feed.resume(*point, principal.may)
    body = frames(listener, first, feed)
    return stream_response(body, state.settings.sse_send_timeout_s)
