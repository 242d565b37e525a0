"""The reads of a session's state that opening its event streams makes, shared and bounded.

A burst of stream opens (a reconnect storm after a restart; a load that opens two thousand
at once) ran one read each, all at once: on granian, which hands the loop every waiting
request in one turn, the process's Redis pool grew to its 512 connections and kept them
(RSS per open stream +3 KB over uvicorn's, `python -m bench.stream_memory`). Here at most
`CONCURRENT` such reads run at once, and streams of the same session that wait meanwhile
share one. A read is shared only by streams that asked before it began: each stream asks
once its subscription is confirmed, so its read still follows its subscription and no event
can fall between them (`event_stream.open_stream`).
"""

from __future__ import annotations

import asyncio

from acp_state.store import SessionView, Store

CONCURRENT = 16


class StreamOpens:
    """One API process's reads for opening streams."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], asyncio.Future[SessionView | None]] = {}  # not begun yet: joinable
        self._slots: asyncio.Semaphore | None = None

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
