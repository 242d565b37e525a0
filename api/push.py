"""What the push streams of one API process share: the live workspace feed
(`live_feed`) and the attention inbox's stream (`attention`).

Each is a hub: it follows Redis once for the whole process (the workspaces' change
channels), keeps the state its streams show in memory, and pushes one encoded frame to every
listener. A listener is a bounded buffer: one that falls behind is never waited for; its
buffer is dropped and it is sent a fresh snapshot from the hub's memory instead. A hub left
without listeners keeps following for a while, so a client that reconnects finds it warm
(and, for the feed, resumes from memory), then stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from acp_state.tasks import survive

from .event_stream import RETRY_MS, EventStreamResponse

log = logging.getLogger("api.push")

LISTENER_BUFFER = 256
LINGER_S = 60.0
# How often a hub looks for owners whose lease lapsed (their sessions leave at once, before
# any sweeper removed them): well inside the shortest lease.
OWNER_CHECK_S = 0.25
KEEPALIVE = b": keepalive\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}


@dataclass(eq=False)
class Listener:
    """One stream's bounded buffer of frames, and what it should do next: send them, end
    (`closed`), or send a fresh snapshot instead (`behind`: it fell behind)."""

    accepts: Callable[[str], bool] = lambda ws: True  # which workspaces its token may see
    frames: deque[bytes] = field(default_factory=deque)
    behind: bool = False
    closed: bool = False
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, frame: bytes) -> None:
        if self.behind or self.closed:
            return  # the snapshot it is owed includes this
        if len(self.frames) >= LISTENER_BUFFER:
            self.behind = True
            self.frames.clear()
        else:
            self.frames.append(frame)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def wait(self) -> None:
        """Until there is something to do."""
        await self._ready.wait()

    def drain(self) -> bytes:
        """Every frame queued, in order, as one chunk: a burst costs one write, not one each."""
        chunk = b"".join(self.frames)
        self.frames.clear()
        self._ready.clear()
        return chunk


class Hub:
    """Listeners, the linger after the last one left, and the shutdown of them all."""

    def __init__(self) -> None:
        self.listeners: set[Listener] = set()
        self._idle: asyncio.TimerHandle | None = None
        self._ending = False

    def add(self, listener: Listener) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.listeners.add(listener)
        if self._ending:
            listener.close()

    def remove(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        if not self.listeners and not self._ending:
            self._idle = asyncio.get_running_loop().call_later(LINGER_S, self.stop)

    def broadcast(self, frame_for: Callable[[Listener], bytes | None]) -> None:
        """Push each listener its frame (None: nothing for it)."""
        for listener in list(self.listeners):
            frame = frame_for(listener)
            if frame is not None:
                listener.push(frame)

    async def _keepalive(self) -> None:
        self.keepalive()

    def keepalive(self) -> None:
        """A comment line to every stream, so proxies and clients see the connection live."""
        for listener in list(self.listeners):
            listener.push(KEEPALIVE)

    def end(self) -> None:
        """Shutdown begins: every stream ends now (its client reconnects elsewhere)."""
        self._ending = True
        for listener in list(self.listeners):
            listener.close()

    def stop(self) -> None:
        """Stop following Redis (no listener is left). Subclasses cancel their tasks."""


async def run_every(name: str, interval_s: float, round_: Callable[[], Awaitable[object]]) -> None:
    """A hub's background loop: `round_` every `interval_s`, surviving any error."""
    while True:
        await asyncio.sleep(interval_s)
        await survive(name, round_)


async def frames(listener: Listener, first: bytes, snapshot: Callable[[], bytes], leave: Callable[[], None]) -> AsyncIterator[bytes]:
    """A push stream's body: `retry:`, its first frame, then what the hub pushes (its
    keepalives too), with a fresh snapshot whenever the listener fell behind."""
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        if first:
            yield first
        while True:
            await listener.wait()  # no timer per frame: the hub pushes the keepalives
            batch = listener.drain()
            if batch:
                yield batch
            if listener.closed:
                return
            if listener.behind:
                listener.behind = False
                yield snapshot()
    finally:
        leave()


def stream_response(body: AsyncIterator[bytes], send_timeout_s: float, headers: dict[str, str] | None = None) -> EventStreamResponse:
    return EventStreamResponse(body, send_timeout_s, {**STREAM_HEADERS, **(headers or {})})
