"""`GET /attention`'s answers, kept by one API process until a change says otherwise.

A page is kept whole (its body) with the owners whose lease its items count under, and
served again while no change has been announced on the change channel of any workspace
this process follows since the read that made it began (any change drops every kept page:
the change channel does not say whether the attention index moved, and one read of the
deployment index makes a page again). As `cache.StateCache` does for status and listings,
a kept page is served only once a ping sent on the change links of its workspaces after
the request came back (`Fanout.sync_all`): a vote or a new permission acknowledged anywhere
before the request is never missing from the answer. Liveness is never kept: every owner of
a kept page is checked against its lease deadline, and a page that left out an item of a
lapsed lease (which may come back, renewed late) is not kept. Concurrent misses of one page
share one read, so a stream of changes costs Redis at most one read per page at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from acp_state.metrics import Tally
from acp_state.store import Fanout, WorkerRegistry

from .cache import Heads, follow
from .etag import weak_etag

log = logging.getLogger("acp_state.api.attention_cache")

PAGE_HITS = Tally("acp_state_attention_page_hits_total", "Attention pages served from this process's cache")
PAGE_MISSES = Tally("acp_state_attention_page_misses_total", "Attention pages read from Redis")

MAX_PAGES = 1000

# The workspaces a page spans, its cursor ('' for the first page) and its size.
PageKey = tuple[tuple[str, ...], str, int]


@dataclass
class KeptPage:
    body: bytes
    etag: str  # made once, with the body: the ETag middleware keeps a route's own
    owners: frozenset[str]
    heads: Heads | None = None  # its 200's and 304's headers, made by its first hot read


@dataclass(frozen=True)
class Flight:
    """A page being read from Redis now, for every request that may share it."""

    started: int  # the changes heard when it began
    answer: asyncio.Future[tuple[bytes, str]]


# Reads a page from Redis: its body, the owners its items count under, and whether it left
# no item out for a lapsed lease (only such a page is kept).
PageReader = Callable[[], Awaitable[tuple[bytes, frozenset[str], bool]]]


async def _all_live(registry: WorkerRegistry, owners: frozenset[str]) -> bool:
    """Every owner holds its lease: by the deadlines last read, else read again (at most
    every 200 ms, shared: `WorkerRegistry.is_live`)."""
    for owner in owners:
        if not registry.holds_lease(owner) and not await registry.is_live(owner):
            return False
    return True


def _retrieved(answer: asyncio.Future[tuple[bytes, str]]) -> None:
    if not answer.cancelled():
        answer.exception()  # said by the request that read it; no "never retrieved" warning


class AttentionPages:
    def __init__(self, fanout: Fanout) -> None:
        self._fanout = fanout
        self._pages: OrderedDict[PageKey, KeptPage] = OrderedDict()
        self._flights: dict[PageKey, Flight] = {}
        self._changes = 0  # changes (and resets) heard so far: a read kept only if none came meanwhile

    def changed(self) -> None:
        """A session of a followed workspace changed, or changes may have been lost."""
        self._changes += 1
        self._pages.clear()

    async def kept(self, key: PageKey, registry: WorkerRegistry) -> KeptPage | None:
        """The kept page of `key`, once every change of its workspaces announced before the
        call has arrived (`sync_all`), while every owner it counts holds its lease."""
        if key not in self._pages or not await self._fanout.sync_all(list(key[0])):
            return None
        page = self._pages.get(key)  # a change heard during the sync dropped it
        if page is None or not await _all_live(registry, page.owners):
            return None
        PAGE_HITS.inc()
        return page

    async def answer(self, key: PageKey, registry: WorkerRegistry, read: PageReader) -> tuple[bytes, str]:
        """The answer of `key` and its ETag: kept, else read (`read`), and kept if no change
        came meanwhile. Concurrent misses of one key share one read: a request joins a read
        under way only if, once every change announced before it has arrived (`sync_all`),
        none has arrived since that read began, as it could then keep its answer too."""
        page = await self.kept(key, registry)
        if page is not None:
            return page.body, page.etag
        if key in self._flights and await self._fanout.sync_all(list(key[0])):
            flight = self._flights.get(key)  # perhaps one begun during the sync, after a change
        else:
            flight = None
        if flight is not None and flight.started == self._changes:
            try:
                answer = await asyncio.shield(flight.answer)
                PAGE_HITS.inc()
                return answer
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not flight.answer.cancelled() or (current is not None and current.cancelling()):
                    raise
                # the request that was reading it went away: read it ourselves
        PAGE_MISSES.inc()
        started = await self._begin(key[0])
        flight = Flight(started, asyncio.get_running_loop().create_future())
        flight.answer.add_done_callback(_retrieved)
        self._flights[key] = flight
        try:
            body, owners, complete = await read()
        except Exception as error:
            flight.answer.set_exception(error)
            raise
        except BaseException:  # cancelled (its client left): whoever joined reads for itself
            flight.answer.cancel()
            raise
        finally:
            if self._flights.get(key) is flight:
                del self._flights[key]
        answer = body, weak_etag(body)
        flight.answer.set_result(answer)
        if complete:
            self._keep(key, started, KeptPage(*answer, owners))
        return answer

    async def _begin(self, workspaces: tuple[str, ...]) -> int:
        """Call before reading a page from Redis: follows its workspaces' changes; the
        answer may be kept (`_keep`) only if no change arrives after this point."""
        for ws in workspaces:
            await follow(self._fanout, ws)
        return self._changes

    def _keep(self, key: PageKey, started: int, page: KeptPage) -> None:
        if started != self._changes or not all(self._fanout.watching(ws) for ws in key[0]):
            return  # changed while we read, or not followed: serve this once, do not keep it
        self._pages[key] = page
        if len(self._pages) > MAX_PAGES:
            self._pages.popitem(last=False)
