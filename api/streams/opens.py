"""The reads of a session's state that opening its event streams makes, shared and bounded.

A burst of stream opens (a reconnect storm after a restart; a load that opens two thousand
at once) ran one read each, all at once: on granian, which hands the loop every waiting
request in one turn, the process's Redis pool grew to its 512 connections and kept them
(RSS per open stream +3 KB over uvicorn's, `python -m bench.stream_memory`). Here at most
`CONCURRENT` such reads run at once, and streams of the same session that wait meanwhile
share one. A read is shared only by streams that asked before it began: each stream asks
once its subscription is confirmed, so its read still follows its subscription and no event
can fall between them (`routes/events.py`, `open_stream`).

At most `OPENS_IN_FLIGHT` opens run at once; the others wait their turn before they do
anything. Two thousand opens in flight at once (granian hands the loop every waiting
request in one turn) each held their coroutines, subscription, scope and headers while they
waited on Redis; freed once the streams were open, the process's RSS did not come down: on
granian a session stream opened in such a burst cost 2.3-4.1 KB more than one opened after
the other, on uvicorn nothing more; with this bound, 18.3-18.7 KB against 19.3-22.5 KB
(`python -m bench.stream_memory`, docs/performance.md).
"""

from __future__ import annotations

import asyncio

from acp_state.store import SessionView, Store

CONCURRENT = 16
# Above CONCURRENT: an open also waits for its subscription's confirmation, and opens of one
# session share a read.
OPENS_IN_FLIGHT = 32


class StreamOpens:
    """One API process's reads for opening streams."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], asyncio.Future[SessionView | None]] = {}  # not begun yet: joinable
        self._slots: asyncio.Semaphore | None = None
        self._opening: asyncio.Semaphore | None = None

    def admitted(self) -> asyncio.Semaphore:
        """Held by a stream open from its first step until it is ready to send (`async with`)."""
        if self._opening is None:  # made on the loop that serves (a Semaphore binds to one)
            self._opening = asyncio.Semaphore(OPENS_IN_FLIGHT)
        return self._opening

    async def session(self, store: Store, ws: str, sid: str) -> SessionView | None:
        """The session's state, read after this call began."""
        key = (ws, sid)
        read = self._waiting.get(key)
        if read is None:
            read = self._waiting[key] = asyncio.get_running_loop().create_future()
            asyncio.ensure_future(self._read(store, key, read))
        return await asyncio.shield(read)  # one stream that gives up leaves the read to the others

    async def _read(self, store: Store, key: tuple[str, str], read: asyncio.Future[SessionView | None]) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(CONCURRENT)
        try:
            async with self._slots:
                del self._waiting[key]  # begun: a stream that asks from now on needs a read of its own
                view = await store.session(*key)
        except asyncio.CancelledError:  # the process is ending
            read.cancel()
            raise
        except Exception as error:  # every stream waiting for it meets it
            read.set_exception(error)
            read.exception()  # retrieved here: the streams that waited may all have left
            return
        finally:
            if self._waiting.get(key) is read:  # ended before it began
                del self._waiting[key]
        read.set_result(view)
