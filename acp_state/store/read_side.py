"""The readers' side of `RedisStore` (`LeaseReader` and the reading half of `ReaderStore`):
the lease view and the workers' reports, a session's view, the listings and live states of
workspaces, the attention index, turn records, the event and transcript logs, a load's
snapshot, and this process's fan-out.

Status reads, listings and live states are the hot paths: each is one round trip in steady
state (one per shard on a cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson

from ..metrics import REDIS_ROUNDTRIP
from ..turns import TurnRecord
from . import keys, scripts
from .batching import Script, pipelined
from .codec import attention_entries, unpack_catalog_row, view_of
from .connection import is_cluster
from .fanout import Fanout
from .keys import VersionField
from .side import RedisSide
from .types import AttentionCursor, AttentionEntry, CatalogRow, CatalogVersion, LeaseView, ListedSession, LoadSnapshot, SessionView, WorkerReport

# Workspaces whose last listing's live sessions are remembered (see ReadSide.list_page).
LIST_HINTS = 4096


class ReadSide(RedisSide):
    """What readers read (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._list = Script(self.redis, scripts.LIST)
        self._version = Script(self.redis, scripts.VERSION)
        self._current_turn = Script(self.redis, scripts.CURRENT_TURN)
        self._attention_page = Script(self.redis, scripts.ATTENTION_PAGE)
        self._attention_of = Script(self.redis, scripts.ATTENTION_OF)
        self._live_on_page: dict[str, list[str]] = {}  # ws -> live ids its last listing found
        self._live_in_workspace: dict[str, list[str]] = {}  # ws -> live ids its last live-state read found

    def fanout(self) -> Fanout:
        """This process's live delivery and change feed, on the store's own client."""
        return Fanout(self.redis)

    # ---- the registry -------------------------------------------------------------------

    async def lease_view(self) -> LeaseView:
        """The registry's deadlines, leases and clock, with Redis's time to judge them by."""
        if is_cluster(self.redis):
            # The registry's keys share one slot; TIME names no key, so it goes to any node,
            # and the nodes' clocks agree to within what NTP keeps (far below a lease).
            members, leases, (tick, stall), now = await asyncio.gather(
                self.redis.zrange(keys.WORKERS, 0, -1, withscores=True),
                self.redis.zrange(keys.LEASES, 0, -1, withscores=True),
                self.redis.hmget(keys.CLOCK, [keys.ClockField.TICK, keys.ClockField.STALL]),
                self.redis.time(),
            )
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrange(keys.WORKERS, 0, -1, withscores=True)
            pipe.zrange(keys.LEASES, 0, -1, withscores=True)
            pipe.hmget(keys.CLOCK, [keys.ClockField.TICK, keys.ClockField.STALL])
            pipe.time()
            members, leases, (tick, stall), now = await pipe.execute()
        seconds, micros = now
        return LeaseView(
            deadlines={m: int(score) for m, score in members},
            leases={m: int(score) for m, score in leases},
            redis_now_ms=int(seconds) * 1000 + int(micros) // 1000,
            tick_ms=int(tick or 0),
            stall_ms=int(stall or 0),
        )

    async def worker_reports(self, incarnations: list[str]) -> dict[str, WorkerReport]:
        """The load report each live worker stored with its lease (one round trip); one no
        worker could have written (not a report) is left out, as a worker without one."""
        if not incarnations:
            return {}
        values = await self.redis.hmget(keys.REPORTS, incarnations)
        reports = {}
        for inc, value in zip(incarnations, values, strict=True):
            if value:
                with contextlib.suppress(ValueError):
                    reports[inc] = WorkerReport.unpack(inc, value)
        return reports

    async def known_agents(self) -> list[str]:
        """Every agent name a worker offered within the registry's TTL (live or not)."""
        return sorted(await self.redis.zrange(keys.AGENTS, 0, -1))

    # ---- sessions -----------------------------------------------------------------------

    async def locate(self, sid: str) -> str | None:
        return await self.redis.get(keys.locator(sid))

    async def request_location(self, rid: str) -> tuple[str, str] | None:
        where = await self.redis.get(keys.request_locator(rid))
        if not where:
            return None
        ws, _, sid = where.partition("/")
        return ws, sid

    async def session(self, ws: str, sid: str) -> SessionView | None:
        """The live session's state, or None if the store holds none (closed, swept, lost)."""
        with REDIS_ROUNDTRIP.labels("session_read").time():
            return view_of(await self.redis.hgetall(keys.session(ws, sid)), sid)

    async def catalog_row(self, ws: str, sid: str) -> CatalogRow | None:
        """A session's durable catalog row (written with its first snapshot), if kept."""
        row = await self.redis.hget(keys.catalog(ws), sid)
        return unpack_catalog_row(row) if row else None

    # ---- workspaces ---------------------------------------------------------------------

    async def list_page(
        self, ws: str, offset: int, size: int
    ) -> list[ListedSession]:
        """Up to size + 1 catalog rows from `offset`, newest first, each with its live state.

        scripts.LIST reads only the session hashes it is given: it is given those the last
        listing of the workspace found live, so a listing is one round trip unless the page
        gained a live session since (then one more, declaring it)."""
        declared = list(self._live_on_page.get(ws, ()))
        while True:
            flat = await self._list(
                [keys.live(ws), keys.catalog(ws), keys.catalog_order(ws), *(keys.session(ws, s) for s in declared)],
                [offset, size, *declared],
            )
            undeclared = [flat[i] for i in range(0, len(flat), 3) if flat[i + 2] is None]
            if not undeclared:
                break
            declared += undeclared
        rows, live = [], []
        for i in range(0, len(flat), 3):
            sid, row, pairs = flat[i], flat[i + 1], flat[i + 2]
            fields = dict(zip(pairs[::2], pairs[1::2], strict=True))
            rows.append(ListedSession(sid, orjson.loads(row) if row else None, view_of(fields, sid)))
            if fields:
                live.append(sid)
        _remember(self._live_on_page, ws, live)
        return rows

    async def live_states(self, workspaces: list[str]) -> dict[str, tuple[CatalogVersion, list[SessionView]]]:
        """Each workspace's catalog version and its live sessions' views, the version read
        first (a reader may then see a newer state than the version says, never an older).

        One pipeline asks every workspace's version, live set and the session hashes its
        last read found live: one round trip per shard, unless a workspace gained a live
        session since (one more for those) or lost its version (one more to start anew)."""
        pipe = self.redis.pipeline(transaction=False)
        for ws in workspaces:
            pipe.hmget(keys.catalog_version(ws), [VersionField.GENERATION, VersionField.REVISION])
            pipe.smembers(keys.live(ws))
            for sid in self._live_in_workspace.get(ws, ()):
                pipe.hgetall(keys.session(ws, sid))
        replies = iter(await pipe.execute())
        found: dict[str, tuple[list[Any], set[str], dict[str, dict[str, str]]]] = {}
        for ws in workspaces:
            version, members = next(replies), set(next(replies))
            hashes = {sid: next(replies) for sid in self._live_in_workspace.get(ws, ())}
            found[ws] = (version, members, hashes)
        missing = [(ws, sid) for ws, (_, members, hashes) in found.items() for sid in members - hashes.keys()]
        if missing:
            pipe = self.redis.pipeline(transaction=False)
            for ws, sid in missing:
                pipe.hgetall(keys.session(ws, sid))
            for (ws, sid), fields in zip(missing, await pipe.execute(), strict=True):
                found[ws][2][sid] = fields
        result: dict[str, tuple[CatalogVersion, list[SessionView]]] = {}
        for ws, (version, members, hashes) in found.items():
            generation, revision = version
            current = (
                CatalogVersion(generation, int(revision)) if generation is not None else await self.catalog_version(ws)
            )
            views = [view for sid in sorted(members) if (view := view_of(hashes.get(sid) or {}, sid)) is not None]
            _remember(self._live_in_workspace, ws, [view.meta["sessionId"] for view in views])
            result[ws] = (current, views)
        return result

    async def changed_since(self, ws: str, generation: str, revision: int) -> list[str] | None:
        """The sessions that changed (or left) after `revision` of `generation`, oldest change
        first, from the workspace's change log (changes.lua); None when the log cannot tell:
        another generation, or a revision older than the log's floor (it forgot the changes
        after it, or did not exist then). One round trip to one slot, read in this order: the
        sessions, then the floor, then the generation, so that whatever made the sessions
        read incomplete (a trim raises the floor; a lost workspace starts a new generation)
        shows in a read after it (no MULTI, which a cluster's pipeline may not take)."""
        log = keys.change_log(ws)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(log, f"({revision}", "+inf")
        pipe.zscore(log, keys.CHANGE_LOG_FLOOR)
        pipe.hget(keys.catalog_version(ws), VersionField.GENERATION)
        sids, floor, current = await pipe.execute()
        if current != generation or floor is None or revision < floor:
            return None
        return list(sids)

    async def catalog_version(self, ws: str) -> CatalogVersion:
        """The workspace's catalog version (a new generation at revision 0 if it had none)."""
        generation, revision = await self._version([keys.catalog_version(ws), keys.change_log(ws)], [self.retention.catalog_ms])
        return CatalogVersion(generation, int(revision))

    async def attention_page(
        self, workspaces: list[str], after: AttentionCursor | None, limit: int
    ) -> list[AttentionEntry]:
        """Up to `limit` entries of each workspace's attention index that come after `after`
        in the attention order (`AttentionCursor.order`), all of them in that order. One
        pipeline: one round trip per shard."""
        calls = []
        for ws in workspaces:
            if after is None:
                bound = ["", "gt", ""]
            else:
                # Equal waits are ordered by workspace, then by member (the index's order).
                tie = "ge" if ws >= after.ws else "gt"
                bound = [str(after.since_ms), tie, after.member if ws == after.ws else ""]
            calls.append(([keys.attention(ws), keys.attention_details(ws)], [*bound, limit]))
        replies = await pipelined(self.redis, self._attention_page, calls)
        failed = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failed is not None:
            raise failed
        entries = [entry for ws, flat in zip(workspaces, replies, strict=True) for entry in attention_entries(ws, flat)]
        entries.sort(key=lambda e: e.order)
        return entries

    async def deployment_attention_page(
        self, workspaces: list[str], after: AttentionCursor | None, limit: int
    ) -> tuple[list[AttentionEntry], AttentionCursor | None]:
        """Up to `limit` entries of each deployment attention index that holds one of the
        workspaces' waits (one on a single Redis, a slot's on a cluster: one round trip per
        shard), after `after`, in the attention order; and the horizon: past the earliest
        last entry of an index that filled its `limit`, entries are missing (None: none
        are). Entries of other workspaces sharing an index come too: the caller filters."""
        tags = sorted({keys.attention_tag(ws, is_cluster(self.redis)) for ws in workspaces})
        bound = ["", "gt", ""] if after is None else [str(after.since_ms), "ge", f"{after.ws}/{after.member}"]
        calls = [([keys.attention_all(tag), keys.attention_all_details(tag)], [*bound, limit]) for tag in tags]
        replies = await pipelined(self.redis, self._attention_page, calls)
        failed = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failed is not None:
            raise failed
        entries: list[AttentionEntry] = []
        horizon: AttentionCursor | None = None
        for flat in replies:
            found = attention_entries(None, flat)
            entries += found
            if len(flat) >= limit * 3 and found and (horizon is None or found[-1].order < horizon.order):
                horizon = found[-1].cursor
        entries.sort(key=lambda e: e.order)
        return entries, horizon

    async def attention_of(self, ws: str, sid: str) -> list[AttentionEntry]:
        """What one live session waits for (its entries of the attention index)."""
        key_list = [keys.session(ws, sid), keys.attention(ws), keys.attention_details(ws)]
        return attention_entries(ws, await self._attention_of(key_list, [sid]))

    # ---- turns and logs -----------------------------------------------------------------

    async def turn(self, ws: str, sid: str, prompt_id: str) -> TurnRecord | None:
        """One turn's record, while it is among the session's kept turns."""
        packed = await self.redis.hget(keys.turns(ws, sid), prompt_id)
        return None if packed is None else TurnRecord.unpack(packed)

    async def pending_turns(self, ws: str, sid: str) -> list[TurnRecord]:
        """The turns the session accepted that have not ended (running, then queued), oldest
        admission first: the prompt queue."""
        records = [TurnRecord.unpack(packed) for packed in (await self.redis.hgetall(keys.turns(ws, sid))).values()]
        return sorted((r for r in records if not r.ended), key=lambda r: (r.queued_at, r.state.value != "running"))

    async def current_turn(self, ws: str, sid: str) -> TurnRecord | None:
        """The running turn, else the oldest queued one, else the one that ended last."""
        packed = await self._current_turn([keys.session(ws, sid), keys.turns(ws, sid), keys.turns_ended(ws, sid)], [])
        return TurnRecord.unpack(packed) if packed else None

    async def replay(self, ws: str, sid: str, after: int, upto: int | None = None) -> tuple[list[str], int | None]:
        """Envelopes with ids in (after, upto] from the replay log, plus the first id it holds."""
        stream = keys.events(ws, sid)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(stream, "-", "+", count=1)
        pipe.xrange(stream, f"({after}-0", "+" if upto is None else f"{upto}-0")
        first, entries = await pipe.execute()
        first_id = int(first[0][0].split("-")[0]) if first else None
        return [fields["e"] for _, fields in entries], first_id

    async def transcript_page(
        self, ws: str, sid: str, before: str | None, limit: int
    ) -> tuple[list[tuple[str, str]], dict[str, Any] | None]:
        """Up to limit + 1 transcript entries older than `before`, newest first, and the catalog row."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(keys.transcript(ws, sid), f"({before}" if before else "+", "-", count=limit + 1)
        pipe.hget(keys.catalog(ws), sid)
        entries, row = await pipe.execute()
        return [(entry_id, fields["e"]) for entry_id, fields in entries], orjson.loads(row) if row else None

    async def load_snapshot(
        self, ws: str, sid: str, page_size: int
    ) -> LoadSnapshot:
        """One consistent read (MULTI, one slot): the session hash, the newest transcript page
        (limit + 1 entries, newest first) and the replay log."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(keys.session(ws, sid))
        pipe.xrevrange(keys.transcript(ws, sid), "+", "-", count=page_size + 1)
        pipe.xrange(keys.events(ws, sid), "-", "+")
        fields, page, log_entries = await pipe.execute()
        return LoadSnapshot(
            view_of(fields, sid),
            [(entry_id, f["e"]) for entry_id, f in page],
            [f["e"] for _, f in log_entries],
        )


def _remember(hints: dict[str, list[str]], ws: str, live: list[str]) -> None:
    """Keep the live ids a workspace's last read found, for the next one to declare (a
    bounded number of workspaces, the oldest forgotten first)."""
    hints.pop(ws, None)
    if live:
        hints[ws] = live
        if len(hints) > LIST_HINTS:
            del hints[next(iter(hints))]
