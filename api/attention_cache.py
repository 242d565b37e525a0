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
lapsed lease (which may come back, renewed late) is not kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from acp_state.metrics import Tally
from acp_state.store import Fanout

log = logging.getLogger("acp_state.api.attention_cache")

PAGE_HITS = Tally("acp_state_attention_page_hits_total", "Attention pages served from this process's cache")
PAGE_MISSES = Tally("acp_state_attention_page_misses_total", "Attention pages read from Redis")

MAX_PAGES = 1000

# The workspaces a page spans, its cursor ('' for the first page) and its size.
PageKey = tuple[tuple[str, ...], str, int]


@dataclass(frozen=True)
class KeptPage:
    body: bytes
    owners: frozenset[str]


class AttentionPages:
    def __init__(self, fanout: Fanout) -> None:
        self._fanout = fanout
        self._pages: OrderedDict[PageKey, KeptPage] = OrderedDict()
        self._changes = 0  # changes (and resets) heard so far: a read kept only if none came meanwhile

    def changed(self) -> None:
        """A session of a followed workspace changed, or changes may have been lost."""
        self._changes += 1
        self._pages.clear()

    async def kept(self, key: PageKey, holds_lease: Callable[[str], bool]) -> bytes | None:
        """The kept answer of `key`, once every change of its workspaces announced before
        the call has arrived, while every owner it counts holds its lease."""
        if key not in self._pages or not await self._fanout.sync_all(list(key[0])):
            PAGE_MISSES.inc()
            return None
        page = self._pages.get(key)  # a change heard during the sync dropped it
        if page is None or not all(holds_lease(owner) for owner in page.owners):
            PAGE_MISSES.inc()
            return None
        PAGE_HITS.inc()
        return page.body

    async def begin(self, workspaces: tuple[str, ...]) -> int:
        """Call before reading a page from Redis: follows its workspaces' changes; the
        answer may be kept (`keep`) only if no change arrives after this point."""
        for ws in workspaces:
            if not self._fanout.watching(ws):
                try:
                    await self._fanout.watch(ws)
                except Exception:  # Redis away: the read that follows says so; nothing is kept
                    log.debug("cannot follow the changes of %s", ws, exc_info=True)
        return self._changes

    def keep(self, key: PageKey, started: int, body: bytes, owners: frozenset[str]) -> None:
        if started != self._changes or not all(self._fanout.watching(ws) for ws in key[0]):
            return  # changed while we read, or not followed: serve this once, do not keep it
        self._pages[key] = KeptPage(body, owners)
        if len(self._pages) > MAX_PAGES:
            self._pages.popitem(last=False)
