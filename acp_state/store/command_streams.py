"""Reading the command streams (a worker's control stream, its inboxes, a moved session's
parked commands): each entry decoded into its command, and, on a cluster, one blocking
reader per slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.cluster import key_slot

from .. import commands, logs
from ..commands import Command, MalformedCommand
from ..tasks import cancel_until_done
from .connection import Client

log = logging.getLogger("acp_state.store")

COMMAND_BATCH = 256
READING = "reading the command streams of a cluster slot"

# (stream, entry id, the entry's command or why it is none)
Entry = tuple[str, str, Command | MalformedCommand]


def entries(reply: Any) -> list[Entry]:
    """An XREAD reply (or XRANGE's, wrapped as one stream's) as entries, in stream order."""
    return [(stream, entry_id, decoded(fields)) for stream, found in reply or [] for entry_id, fields in found]


def decoded(fields: dict[str, str]) -> Command | MalformedCommand:
    """An entry's command, or why it is none (the reader skips it and reads on)."""
    if "c" not in fields:
        return MalformedCommand("stream entry has no command field 'c'")
    try:
        return commands.decode(fields["c"])
    except MalformedCommand as error:
        return error


class StreamReaders:
    """Command streams read on a cluster: one blocking XREAD loop per slot, all feeding one
    queue. A worker's streams span as many slots as it has workspaces (plus its own control
    stream), so this costs one connection per hosted workspace while it waits."""

    def __init__(self, redis: Client) -> None:
        self.redis = redis
        self.queue: asyncio.Queue[Entry] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, dict[str, str]] = {}  # slot -> {stream: cursor}

    async def read(self, cursors: dict[str, str], block_ms: int) -> list[Entry]:
        wanted: dict[int, dict[str, str]] = {}
        for stream, cursor in cursors.items():
            wanted.setdefault(key_slot(stream.encode()), {})[stream] = cursor
        for slot in [s for s in self._tasks if s not in wanted or wanted[s].keys() != self._streams[s].keys()]:
            self._tasks.pop(slot).cancel()
        for slot, streams in wanted.items():
            if slot not in self._tasks:
                # A reader keeps its own cursors from here on: the caller's are never ahead.
                mine = {s: self._streams.get(slot, {}).get(s, c) for s, c in streams.items()}
                self._streams[slot] = mine
                self._tasks[slot] = asyncio.ensure_future(self._loop(mine, block_ms))
        for slot in [s for s in self._streams if s not in wanted]:
            del self._streams[slot]
        try:
            first = await asyncio.wait_for(self.queue.get(), block_ms / 1000)
        except asyncio.TimeoutError:
            return []
        read = [first]
        while not self.queue.empty():
            read.append(self.queue.get_nowait())
        return read

    async def _loop(self, cursors: dict[str, str], block_ms: int) -> None:
        while True:
            try:
                reply = await self.redis.xread(cursors, block=block_ms, count=COMMAND_BATCH)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis away or a slot moving: try again shortly
                logs.failed(log, READING, error, logging.WARNING)  # once, then counted
                await asyncio.sleep(0.5)
                continue
            logs.succeeded(READING)
            for entry in entries(reply):
                cursors[entry[0]] = entry[1]
                self.queue.put_nowait(entry)

    async def stop(self) -> None:
        await cancel_until_done(self._tasks.values())
        self._tasks.clear()
