"""An event stream as one plain ASGI response, and the process's watch over its sends.

What every Server-Sent Event stream of the API goes out through (the session stream, the
live feed, the attention stream): `EventStreamResponse` steps its body and writes each chunk,
lets a hub write frames straight to the connection (`writes`), hears the client leave, and
`_SendWatch` drops a client that stops reading and wakes an idle stream for its keepalive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Generator, Iterator, Protocol

from starlette.types import Receive, Scope, Send

from acp_state.store import STORE_ERRORS, Subscription
from acp_state.tasks import survive

from .frames import KEEPALIVE, KEEPALIVE_S
from .writes import AT_ONCE, Chunk, learn, transport_of

log = logging.getLogger("api.events")

DIRECT_SEND = "acp.direct_send"  # the server's own send, kept in the scope by the app (`ApiApp`)


class DirectWrites(Protocol):
    """What a push stream's body comes from (a hub's listener): `direct` is the stream's own
    write (`EventStreamResponse.write_now`, or `_write_transport` on uvicorn) once its sends
    go straight to the server, and `write` is that while the stream's task waits for its next
    chunk with nothing queued, so the hub writes a frame to the connection without waking the
    task; None while the write of one waits on the client."""

    direct: Callable[[Chunk], bool] | None
    write: Callable[[Chunk], bool] | None

    def writable_again(self) -> None:
        """A write of the hub's that waited on the client is done: `write` is `direct` again
        if the task still waits with nothing queued."""


class EventStreamResponse:
    """An event stream as a plain ASGI response: one coroutine for its whole life.

    Starlette's `StreamingResponse` runs a task group of two tasks per stream (one waits for
    the client to leave) on a server of ASGI spec 2.3, such as granian: with ten thousand
    open streams, more memory than the rest of the stream. Here the client's leaving is heard
    by a callback on the server's `receive()` (a future on granian: no task at all), and
    ends the stream as a client that stops reading does: `_SEND_WATCH` drops one whose
    socket stays full for `send_timeout`, so a stopped reader costs a bounded buffer (the
    transport's) and never slows others."""

    # Ten thousand are held for hours: no instance dict.
    __slots__ = ("body", "raw_headers", "send_timeout", "sending_since", "ending", "task", "_receiving", "_receive",
                 "wakes", "keepalive_due", "writes", "_send", "_writing")

    def __init__(
        self, body: AsyncIterator[bytes], send_timeout: float, headers: dict[str, str],
        wakes: Subscription | None = None, writes: DirectWrites | None = None,
    ) -> None:
        self.body = body
        # `content-type` as is, last (Starlette adds `; charset=utf-8`, the reference does not).
        self.raw_headers: list[tuple[bytes, bytes]] | None = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        ]
        self.raw_headers.append((b"content-type", b"text/event-stream"))
        self.send_timeout = send_timeout
        self.sending_since: float | None = None  # loop time a send began, while it waits
        self.ending: str | None = None  # why this stream ends itself (it cancels its task)
        self.task: asyncio.Task[Any] | None = None
        self._receiving: asyncio.Future[Any] | _Stepped | None = None
        self._receive: Receive | None = None
        # The subscription the send watch wakes every KEEPALIVE_S for a keepalive (the push
        # hubs send their own): the subscription itself, not a callable made for each stream.
        self.wakes = wakes
        self.keepalive_due = 0.0
        self.writes = writes
        self._send: Send | None = None  # the send later frames take, once the start passed the middlewares
        self._writing: asyncio.Future[None] | None = None  # a write of `write_now` the client is slow to take

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        direct = scope.get(DIRECT_SEND)
        self.keepalive_due = loop.time() + KEEPALIVE_S
        self.task = asyncio.current_task()
        _SEND_WATCH.add(self)
        self._listen(receive)
        # An open stream is kept for hours, ten thousand at once: nothing is held through its
        # waits that only one step needed (the headers once sent, the last frame).
        headers, self.raw_headers = self.raw_headers, None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            del headers
            async for chunk in self.body:
                if chunk is None:  # the body was woken with nothing to send yet (`SessionBody`): ask again
                    continue
                await self._sending(loop)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sent()
                del chunk
                send = self._send = direct or send  # the middlewares have seen what they look at
                if self.writes is not None and self.ending is None:  # the hub may write while the task waits
                    self.writes.direct = self._write_transport if transport_of(send) is not None else self.write_now
            await self._sending(loop)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except STORE_ERRORS as error:  # Redis went away mid-stream: end it; the client reconnects and resumes
            log.warning("SSE stream ended by a store error (%r)", error)
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if self.ending is None:
                raise
            while self.task.uncancel():  # ours, maybe asked more than once: the stream ends here
                pass
            log.debug("SSE stream ended: %s", self.ending)
        finally:
            self.task = None
            if self.writes is not None:
                self.writes.direct = self.writes.write = None
            if self._writing is not None:
                self._writing.cancel()
            _SEND_WATCH.discard(self)
            self._receive = None
            if self._receiving is not None:
                self._receiving.cancel()
            await self.body.aclose()  # type: ignore[attr-defined]

    async def _sending(self, loop: asyncio.AbstractEventLoop) -> None:
        """The task is to send: the hub writes no more (its frames queue for the task), and
        a write of the hub's that waits on the client finishes first (or raises its error)."""
        if self.writes is not None:
            self.writes.write = None
        if self._writing is not None:
            await self._writing  # its `sending_since` holds meanwhile
        self.sending_since = loop.time()
        _SEND_WATCH.sending.add(self)

    def _sent(self) -> None:
        self.sending_since = None
        _SEND_WATCH.sending.discard(self)

    def write_now(self, chunk: Chunk) -> bool:
        """Write `chunk` from the caller's step, not the stream's task: a hub writes one
        change to a thousand streams in one step, without a thousand task wake-ups. The
        server's send completes at once while the client reads (granian, uvicorn; granian's
        answer is then an empty awaitable, not stepped at all); when it must wait for the
        client, the rest of the write goes on in a task of its own, the hub writes no more
        (`writes.write`), and what follows queues for the stream's task, which sends it after.
        False: nothing written (the stream ends, or a write still waits); the caller queues
        `chunk` for the task."""
        if self.ending is not None or self._writing is not None or self._send is None:
            return False
        try:
            sent = self._send(chunk.message)
            if type(sent) in AT_ONCE:  # granian's answer to a write it took: nothing to step
                return True
            step = sent.__await__()
            waits_on = next(step, _DONE)  # an iterator, not always a generator (granian's)
        except Exception as error:  # the connection is gone: the stream ends as its own send would
            self.end(f"a write failed ({error!r})")
            return True
        if waits_on is _DONE:
            learn(sent)
            return True
        if self.writes is not None:
            self.writes.write = None  # until the stream's task has sent what queues meanwhile
        self.sending_since = asyncio.get_running_loop().time()  # the send watch drops a client that never reads
        _SEND_WATCH.sending.add(self)
        self._writing = asyncio.ensure_future(_rest_of(step, waits_on))
        self._writing.add_done_callback(self._written)
        return True

    def _write_transport(self, chunk: Chunk) -> bool:
        """`write_now` on uvicorn (httptools): what its `send` does for a chunk of the body
        while its transport takes writes and the client is there, `transport.write` of the
        chunk in chunked encoding (made once for every stream, `Chunk.chunked`), without
        the coroutine. A paused transport (flow control: the client is slow to read) or a
        client gone goes through `write_now`, which waits or drops the write as uvicorn does."""
        cycle = self._send.__self__  # type: ignore[union-attr]
        if cycle.flow.write_paused or cycle.disconnected or self.ending is not None:
            return self.write_now(chunk)
        try:
            cycle.transport.write(chunk.chunked)
        except Exception as error:  # the connection is gone: the stream ends as its own send would
            self.end(f"a write failed ({error!r})")
        return True

    def _written(self, writing: asyncio.Future[None]) -> None:
        """A write of `write_now` that waited on the client is over: the stream's task may
        send (the hub writes again once it waits), or, if it failed, the stream ends."""
        if self._writing is writing:
            self._writing = None
            self._sent()
        if writing.cancelled():
            return
        if writing.exception() is not None:
            self.end(f"a write failed ({writing.exception()!r})")
        elif self.writes is not None and self.ending is None:
            # Else the hub would queue its next frame for the task, which sends it and only
            # then waits (and lets the hub write) again: a wake-up per wait for nothing, and
            # `write` None with nothing waiting on the client (a test judges one by that).
            self.writes.writable_again()

    def end(self, why: str) -> None:
        """End the stream from outside its task: the client left, or stopped reading."""
        if self.task is not None and self.ending is None:
            self.ending = why
            if self.writes is not None:  # nothing more is written to it
                self.writes.direct = self.writes.write = None
            _SEND_WATCH.ending.add(self)  # cancelled again until it has ended
            self.task.cancel()

    def _listen(self, receive: Receive) -> None:
        """Hear the client leave: each `receive()` gets a callback, and the next is asked
        for only when one came back (a request's body, then its disconnect)."""
        self._receive = receive
        self._ask()

    def _ask(self) -> None:
        assert self._receive is not None
        asked = self._receive()
        if asyncio.isfuture(asked):  # granian's: a future already
            self._receiving = asked
            asked.add_done_callback(self._heard_future)
        else:  # a coroutine (uvicorn's): stepped by hand, not wrapped in a Task (400 B a stream)
            stepped = self._receiving = _Stepped(asked, self._heard)
            stepped.start()  # after it is kept: it may be done at once, and the next asked for

    def _heard_future(self, message: asyncio.Future[Any]) -> None:
        if message.cancelled():
            self._receiving = None
            return
        error = message.exception()
        self._heard(None if error is not None else message.result(), error)

    def _heard(self, message: Any, error: BaseException | None) -> None:
        self._receiving = None
        if self.task is None or self._receive is None:
            return
        if error is not None or message["type"] == "http.disconnect":
            self.end("the client left")
            return
        self._ask()


class _Stepped:
    """An awaitable run to its end on the futures it waits on, as a Task would run it, but
    with no Task (a Task, its weak reference in `asyncio.all_tasks` and its callbacks are
    400 B, and an open stream on uvicorn holds a `receive()` for its whole life). Once
    `start`ed, `done` is called with its result or its error; `cancel` closes it, and `done`
    is not called."""

    __slots__ = ("_step", "_done", "_waits_on")

    def __init__(self, awaitable: Awaitable[Any], done: Callable[[Any, BaseException | None], None]) -> None:
        self._step: Any = awaitable.__await__()
        self._done = done
        self._waits_on: asyncio.Future[Any] | None = None

    def start(self) -> None:
        self._resume(None)

    def _resume(self, _: Any) -> None:
        self._waits_on = None
        try:
            waits_on = self._step.send(None)
        except StopIteration as stop:
            self._done(stop.value, None)
            return
        except BaseException as error:  # noqa: BLE001 - given to `done`, as a Task's result would be
            self._done(None, error)
            return
        if getattr(waits_on, "_asyncio_future_blocking", None) is None:  # a bare yield: go on at the next turn
            asyncio.get_running_loop().call_soon(self._resume, None)
            return
        waits_on._asyncio_future_blocking = False  # taken, as a Task takes it
        self._waits_on = waits_on
        waits_on.add_done_callback(self._resume)

    def cancel(self) -> None:
        if self._waits_on is not None:
            self._waits_on.remove_done_callback(self._resume)
            self._waits_on = None
        close = getattr(self._step, "close", None)
        if close is not None:
            close()


_DONE = object()  # what `next` gives for a send that completed at once


async def _rest_of(step: Iterator[Any], waits_on: Any) -> None:
    """Go on with a send that was stepped once by hand and waits on `waits_on`."""
    await _Resumed(step, waits_on)


class _Resumed:
    """An awaitable that goes on with `step` (a send's `__await__()`, already at its first
    wait): what it waits on, then the rest, as `await` would have."""

    def __init__(self, step: Iterator[Any], waits_on: Any) -> None:
        self.step, self.waits_on = step, waits_on

    def __await__(self) -> Generator[Any, Any, None]:
        waits_on = self.waits_on
        while True:
            try:
                sent = yield waits_on
            except BaseException as error:  # cancelled, say: the send is told, as `await` tells it
                throw = getattr(self.step, "throw", None)
                if throw is None:
                    raise
                try:
                    waits_on = throw(error)
                except StopIteration:
                    return
            else:
                try:
                    waits_on = next(self.step) if sent is None else self.step.send(sent)
                except StopIteration:
                    return


def _keepalive(subscription: Subscription) -> None:
    """Wake the stream for a keepalive, unless it has something to send anyway."""
    if subscription.queue.empty():
        subscription.queue.put_nowait(KEEPALIVE)


class _SendWatch:
    """Ends the streams whose send has waited longer than their timeout, and wakes those
    due a keepalive, from one loop for the process (not a timer per frame or per wait). A
    stream ending itself is cancelled again each round until it has ended: a cancellation
    can be dropped (see `acp_state.tasks`).

    A round visits only the streams with something to check, not every open stream (ten
    thousand idle live feeds cost a round 1-2 ms of the API's one core): those whose send
    waits (`sending`, kept by the streams as a send begins and ends), those ending themselves
    (`ending`), and the streams due a keepalive, first in `_keepalives` (each is due
    KEEPALIVE_S after it opened or was last woken, so the order of due times is the order
    they were queued in)."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._streams: set[EventStreamResponse] = set()
        self.sending: set[EventStreamResponse] = set()
        self.ending: set[EventStreamResponse] = set()
        self._keepalives: deque[EventStreamResponse] = deque()
        self._step = 1.0  # a round's interval: a quarter of the shortest send timeout, at most 1 s

    def add(self, stream: EventStreamResponse) -> None:
        # A watch left on another loop (an app served again in one process, as tests do)
        # never runs on this one; the streams of a loop closed under them never end.
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._reset()
            self._task = asyncio.ensure_future(self._watch())
        self._streams.add(stream)
        self._step = min(self._step, KEEPALIVE_S, stream.send_timeout / 4)
        if stream.wakes is not None:
            self._keepalives.append(stream)  # its `keepalive_due` is set: the latest yet

    def discard(self, stream: EventStreamResponse) -> None:
        self._streams.discard(stream)
        self.sending.discard(stream)
        self.ending.discard(stream)  # (in `_keepalives` until it is due: skipped then)

    async def _watch(self) -> None:
        while self._streams:
            await asyncio.sleep(self._step)
            await survive("sse send watch", self._round)

    async def _round(self) -> None:
        now = asyncio.get_running_loop().time()
        for stream in list(self.ending):
            if stream.task is not None:
                stream.task.cancel()
        for stream in list(self.sending):
            since = stream.sending_since
            if since is not None and now - since > stream.send_timeout and stream.ending is None:
                log.info("dropping an SSE client that stopped reading")
                stream.end("the client stopped reading")
        keepalives = self._keepalives
        while keepalives and keepalives[0].keepalive_due <= now:
            stream = keepalives.popleft()
            if stream.wakes is None or stream not in self._streams:
                continue  # it ended
            stream.keepalive_due = now + KEEPALIVE_S
            keepalives.append(stream)
            if stream.ending is None:
                _keepalive(stream.wakes)


_SEND_WATCH = _SendWatch()
