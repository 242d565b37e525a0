"""What the push streams of one API process share: the live workspace feed
(`live_state_hub`) and the attention inbox's stream (`attention_hub`).

Each is a hub: it follows Redis once for the whole process (the workspaces' change
channels), keeps the state its streams show in memory, and pushes one encoded frame to every
listener, written in the hub's own step to each stream whose task waits with nothing queued
(`EventStreamResponse.write_now`: no task wake-up per stream and change; the frame's message
made once for them all, `writes.Chunk`). A listener is a bounded buffer: one that falls behind is never waited for; its
buffer is dropped and it is sent a fresh snapshot from the hub's memory instead. A hub left
without listeners keeps following for a while, so a client that reconnects finds it warm
(and, for the feed, resumes from memory), then stops.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, Awaitable, Callable, Generator

from acp_state.tasks import survive

from .frames import KEEPALIVE_FRAME, KEEPALIVE_S, RETRY_MS
from .response import EventStreamResponse
from ..responses import unavailable
from .writes import Chunk

log = logging.getLogger("api.push")

LISTENER_BUFFER = 256
LINGER_S = 60.0
# How often a hub looks for owners whose lease lapsed (their sessions leave at once, before
# any sweeper removed them): well inside the shortest lease.
OWNER_CHECK_S = 0.25
RETRY_AFTER_FAILURE_S = 0.5
STREAM_HEADERS = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}


def _anyone(ws: str) -> bool:
    return True


class Listener:
    """One stream's bounded buffer of frames, and what it should do next: send them, end
    (`closed`), or send a fresh snapshot instead (`behind`: it fell behind).

    Ten thousand are held for hours: no instance dict, a list for the frames (a deque is
    600 B empty) and one future while its stream waits (an `asyncio.Event` holds a deque of
    waiters and a dict)."""

    __slots__ = ("accepts", "frames", "behind", "closed", "direct", "write", "_due", "_waiter")

    def __init__(self, accepts: Callable[[str], bool] = _anyone) -> None:
        self.accepts = accepts  # which workspaces its token may see
        self.frames: list[bytes] = []
        self.behind = False
        self.closed = False
        # The stream's own write (`EventStreamResponse.write_now`, or its write to uvicorn's
        # transport), once its sends go straight to the server; None before, and once it ends.
        self.direct: Callable[[Chunk], bool] | None = None
        # `direct` while the stream's task waits with nothing queued (`wait`), else None: a
        # frame then goes out in the hub's step, without waking the task, and never before
        # a frame queued earlier.
        self.write: Callable[[Chunk], bool] | None = None
        self._due = False  # something to do since the last drain
        self._waiter: asyncio.Future[None] | None = None

    def push(self, frame: bytes) -> None:
        write = self.write
        if write is None or not write(Chunk(frame)):
            self.queue(frame)

    def queue(self, frame: bytes) -> None:
        """`frame` for the stream's task to send, after what it was sent before."""
        self.write = None  # until the task has sent what queues, and waits again
        if self.behind or self.closed:
            return  # the snapshot it is owed includes this
        if len(self.frames) >= LISTENER_BUFFER:
            self.behind = True
            self.frames.clear()
        else:
            self.frames.append(frame)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self.write = None
        self._wake()

    def _wake(self) -> None:
        self._due = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def wait(self) -> Awaitable[None]:
        """Until there is something to do (a future while there is not: no coroutine frame)."""
        if self._due:
            return _NOW
        self.write = self.direct  # nothing queued: the hub may write to the stream itself
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def writable_again(self) -> None:
        if self._waiter is not None and not self._due and not self.closed:
            self.write = self.direct

    def drain(self) -> bytes:
        """Every frame queued, in order, as one chunk: a burst costs one write, not one each."""
        self.write = None
        chunk = b"".join(self.frames)
        self.frames.clear()
        self._due = False
        self._waiter = None
        return chunk


class _Now:
    """An awaitable that is done at once."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield


_NOW = _Now()


class Hub:
    """One hub's listeners, the linger after the last one left, the shutdown of them all,
    and its following of Redis: what it hears queues in its inbox (None: messages may have
    been lost), one task takes each batch (`_take`), and every round of its tasks survives
    an error (a failed batch is followed by a whole read, `reset`)."""

    name = "hub"  # its tasks' name in logs and in /metrics

    def __init__(self) -> None:
        self.listeners: set[Listener] = set()
        self._idle: asyncio.TimerHandle | None = None
        self._ending = False
        self._inbox: list[Any] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- following Redis (subclasses: `_follow`, `_take`, `_check_owners`, `_forgotten`) ----

    async def start(self) -> None:
        """Follow the change channels, read the whole state, then take what is heard."""
        try:
            await self._follow()
        except asyncio.TimeoutError as error:
            raise unavailable("cannot follow the changes now; retry", "store_unavailable") from error
        await self._take([None])
        self._tasks = [
            asyncio.ensure_future(self._run()),
            asyncio.ensure_future(run_every(f"{self.name} owners", OWNER_CHECK_S, self._check_owners)),
            asyncio.ensure_future(run_every(f"{self.name} keepalive", KEEPALIVE_S, self._keepalive)),
        ]

    def stop(self) -> None:
        """Stop following Redis (no listener is left)."""
        for task in self._tasks:
            task.cancel()
        self._forgotten()

    def hear(self, item: Any) -> None:
        self._inbox.append(item)
        self._wake.set()

    def reset(self) -> None:
        """Announcements may have been lost: read the whole state again."""
        self.hear(None)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._inbox = self._inbox, []
            if not await survive(self.name, lambda: self._take(batch)):
                await asyncio.sleep(RETRY_AFTER_FAILURE_S)  # Redis away: try a whole read later
                self.reset()

    async def _follow(self) -> None:
        raise NotImplementedError

    async def _take(self, batch: list[Any]) -> None:
        """Take what was heard, in order; a None in it asks for a whole read."""
        raise NotImplementedError

    async def _check_owners(self) -> None:
        raise NotImplementedError

    def _forgotten(self) -> None:
        """The hub stopped: whoever holds it lets it go."""

    def snapshot_for(self, listener: Listener) -> bytes:
        """A fresh snapshot frame as `listener` may see it (sent to one that fell behind)."""
        raise NotImplementedError

    # ---- listeners ----------------------------------------------------------------------

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

    def broadcast_all(self, frame: bytes) -> None:
        """Push `frame` to every listener: one message for them all (`Chunk`), and for each
        stream that waits with nothing queued, one call of its write, in this step."""
        chunk = Chunk(frame)
        for listener in list(self.listeners):
            write = listener.write
            if write is None or not write(chunk):
                listener.queue(frame)

    async def _keepalive(self) -> None:
        """A comment line to every stream, so proxies and clients see the connection live."""
        self.broadcast_all(KEEPALIVE_FRAME)

    def end(self) -> None:
        """Shutdown begins: every stream ends now (its client reconnects elsewhere)."""
        self._ending = True
        for listener in list(self.listeners):
            listener.close()


async def run_every(name: str, interval_s: float, round_: Callable[[], Awaitable[object]]) -> None:
    """A hub's background loop: `round_` every `interval_s`, surviving any error."""
    while True:
        await asyncio.sleep(interval_s)
        await survive(name, round_)


class PushBody:
    """A push stream's body (`frames`), and the listener it sends, which its response lets
    the hub write to directly."""

    __slots__ = ("listener", "_chunks")

    def __init__(self, listener: Listener, chunks: AsyncGenerator[bytes, None]) -> None:
        self.listener, self._chunks = listener, chunks

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        return self._chunks

    async def aclose(self) -> None:
        await self._chunks.aclose()


def frames(listener: Listener, first: bytes, hub: Hub) -> PushBody:
    """A push stream's body: `retry:`, its first frame, then what the hub pushes (its
    keepalives too), with a fresh snapshot whenever the listener fell behind; the listener
    leaves the hub as the stream ends. The hub itself, not callables made for each stream."""
    return PushBody(listener, _frames(listener, first, hub))


async def _frames(listener: Listener, first: bytes, hub: Hub) -> AsyncGenerator[bytes, None]:
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        if first:
            yield first
        # The stream is held for hours: not the first frame with it (a snapshot of every row).
        first = b""
        while True:
            await listener.wait()  # no timer per frame: the hub pushes the keepalives
            batch = listener.drain()
            if batch:
                yield batch
            if listener.closed:
                return
            if listener.behind:
                listener.behind = False
                yield hub.snapshot_for(listener)
    finally:
        hub.remove(listener)


def stream_response(body: PushBody, send_timeout_s: float, headers: dict[str, str] | None = None) -> EventStreamResponse:
    return EventStreamResponse(body, send_timeout_s, {**STREAM_HEADERS, **(headers or {})}, writes=body.listener)
