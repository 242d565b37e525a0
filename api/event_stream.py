"""`GET /session/:id/events`: the session's events as Server-Sent Events.

Framed as the reference frames them (`retry:`, then `id:`/`event:`/`data:`). A client that
sends `Last-Event-ID` gets what it missed from the replay log, then `replay_complete`;
history the log no longer holds is announced (the reference's `state_resync_required`, then
acp-state's `history_truncated`), never skipped silently. Live events arrive through the process's shared pub/sub connection; a gap in ids
is filled from the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping, Protocol

import orjson
from starlette.datastructures import Headers, QueryParams
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from acp_state import ids
from acp_state.clock import now_ms
from acp_state.store import STORE_ERRORS, Delivery, SessionView, Subscription
from acp_state.tasks import survive

from .auth import Authenticator, Principal, principal_of
from .direct_write import AT_ONCE, Chunk, learn, transport_of
from .locator import not_found
from .metrics import RequestCounts
from .responses import ApiError, parse_decimal
from .state import AppState, app_state
from .summaries import live_summary

log = logging.getLogger("api.events")

RETRY_MS = 3000
KEEPALIVE_S = 15.0
KEEPALIVE = object()  # put in a stream's buffer: send a keepalive
KEEPALIVE_FRAME = b": keepalive\n\n"
MAX_SAFE_INTEGER = 2**53 - 1
ENDING_TYPES = ("session_closed", "session_died")
RESTORED = "session_restored"  # the first event of an epoch the worker rewrote


def parse_last_event_id(value: str | None) -> int | None:
    """Decimal digits only and at most 2^53-1; anything else is ignored (a fresh stream)."""
    return parse_decimal(value, MAX_SAFE_INTEGER)


def frame(event_type: str, data: str, event_id: int | str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event_type}\ndata: {data}\n\n".encode()


def control(event_type: str, data: dict, event_id: int | None = None) -> bytes:
    """A frame of the stream itself. Without an id it does not move the client's resume
    point; `event_id=0` resets it to the start of a new epoch."""
    envelope = {"v": 1, "type": event_type, "data": data, "_meta": {"serverTimestamp": now_ms()}}
    return frame(event_type, orjson.dumps(envelope).decode(), event_id)


def resync(reason: str, last_delivered: int, earliest: int, detail: str | None = None) -> bytes:
    """The reference's `state_resync_required` (what its SDK acts on), sent just before
    acp-state's own `history_truncated` says the same in its words: events after
    `last_delivered` are not all available; the stream goes on from `earliest`."""
    data: dict = {"reason": reason, **({"detail": detail} if detail else {})}
    data.update(lastDeliveredId=last_delivered, earliestAvailableId=earliest)
    return control("state_resync_required", data)


def _event_id_and_type(raw: str) -> tuple[int, str]:
    envelope = orjson.loads(raw)
    return int(envelope["id"]), envelope["type"]


async def stream_events(request: Request) -> EventStreamResponse:
    return await open_stream(
        app_state(request), request.path_params["id"], principal_of(request), request.headers, request.query_params
    )


async def open_stream(
    state: AppState, sid: str, principal: Principal, headers: Mapping[str, str], query: Mapping[str, str]
) -> EventStreamResponse:
    """Session `sid`'s event stream for `principal`, subscribed, its state read: ready to
    send. ApiError 404 if the principal may not see the session, or it is neither live nor
    asked for from an event id (a replay of a session that ended). A burst of opens runs a
    few at a time (`StreamOpens.admitted`)."""
    async with state.stream_opens.admitted():
        return await _open_stream(state, sid, principal, headers, query)


async def _open_stream(
    state: AppState, sid: str, principal: Principal, headers: Mapping[str, str], query: Mapping[str, str]
) -> EventStreamResponse:
    last_id = parse_last_event_id(headers.get("last-event-id"))
    # The reference's SDK sends the epoch as a header beside Last-Event-ID; ours as a query.
    epoch_hint = query.get("eventEpoch") or headers.get("x-qwen-event-epoch")
    queued = parse_decimal(query.get("maxQueued"), MAX_SAFE_INTEGER)
    buffer = min(2048, max(16, queued)) if queued is not None else 256

    ws = await state.locator.workspace_of(sid, principal) if ids.is_token(sid) else None
    if ws is None:
        raise not_found(sid)
    # One string for the streams of a session, not a copy each (held for the stream's life).
    ws, sid = sys.intern(ws), sys.intern(sid)
    subscription = await state.fanout.subscribe_session(ws, sid, buffer)
    try:
        # Read state only after the subscription is confirmed: nothing can fall in between.
        view = await state.stream_opens.session(state.store, ws, sid)
        live = view is not None and await state.registry.is_live(view.owner)
        if not live and last_id is None:
            raise not_found(sid)
    except BaseException:
        await state.fanout.unsubscribe(subscription)
        raise
    body = SessionBody(state, ws, sid, view, live, last_id, epoch_hint, subscription)
    # The reference's headers: its SDK reads the epoch before the first frame, and the
    # stream id names this one connection (a resumed stream gets a new one).
    sent = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no", "X-Qwen-SSE-Stream-Id": str(uuid.uuid4())}
    if view is not None:
        sent["X-Qwen-Event-Epoch"] = view.epoch
    return EventStreamResponse(body, state.settings.sse_send_timeout_s, sent, subscription)


def _keepalive(subscription: Subscription) -> None:
    """Wake the stream for a keepalive, unless it has something to send anyway."""
    if subscription.queue.empty():
        subscription.queue.put_nowait(KEEPALIVE)


async def answer(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope, receive: Receive,
                 send: Send) -> bool:
    """Serve `GET /session/:id/events` below Starlette's stack (`opened`, then the stream);
    False: not served, nothing sent, the app must serve it."""
    response = await opened(state, auth, counts, scope)
    if response is None:
        return False
    await response(scope, receive, send)
    return True


async def opened(state: AppState | None, auth: Authenticator, counts: RequestCounts, scope: Scope) -> EventStreamResponse | None:
    """`GET /session/:id/events` opened below Starlette's stack, ready to be called as an
    ASGI app; None: not this route, or refused (nothing sent: the app must serve it). An
    open stream holds every frame of the stack it was called through for its whole life:
    Starlette's error middleware, routing, our four middlewares and their send wrappers held
    more than the stream itself (13.3 KB of Python heap a stream through the stack, 5.5 KB
    below it: `python -m bench.stream_memory`); the caller awaits the stream itself, so not
    even this frame is held. The stream gets the same token check and the same count as the
    route; anything the route would refuse (no token, no such session, a store error) is
    left to the app, which answers it its way."""
    if state is None or scope["type"] != "http" or scope["method"] != "GET":
        return None
    path: str = scope["path"]
    if not (path.startswith("/session/") and path.endswith("/events")):
        return None
    sid, principal = path[9:-7], auth.principal(scope)
    if not sid or "/" in sid or principal is None:
        return None
    try:
        # Headers of the scope's list, not `Headers(scope=)`: that copies the list into the
        # scope, which the server keeps for the stream's whole life.
        headers = Headers(raw=scope["headers"])
        response = await open_stream(state, sid, principal, headers, QueryParams(scope["query_string"]))
    except (ApiError, *STORE_ERRORS):  # the app meets it again and answers it its way
        return None
    except Exception:  # a bug of this shortcut: said, and the stream served by the app all the same
        log.exception("opening the event stream of %s below the stack failed; the app serves it", sid)
        return None
    counts.add(stream_events.__name__, 200)  # under the route's name, as its answer starts (RequestMetrics)
    return response


DIRECT_SEND = "acp.direct_send"  # the server's own send, kept in the scope by the app (`ApiApp`)


class DirectWrites(Protocol):
    """What a push stream's body comes from (a hub's listener): `direct` is the stream's own
    write (`EventStreamResponse.write_now`, or `_write_transport` on uvicorn) once its sends
    go straight to the server, and `write` is that while the stream's task waits for its next
    chunk with nothing queued, so the hub writes a frame to the connection without waking the
    task; None while the write of one waits on the client."""

    direct: Callable[[Chunk], bool] | None
    write: Callable[[Chunk], bool] | None


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
        if not writing.cancelled() and writing.exception() is not None:
            self.end(f"a write failed ({writing.exception()!r})")

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


class _Ready:
    """An awaitable whose result is there at once (a frame, or None: nothing to send yet)."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | None) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, bytes | None]:
        return self.value
        yield  # a generator: `await` takes it


_NOTHING = _Ready(None)


async def _ended() -> bytes:
    raise StopAsyncIteration  # the body is over: `async for` ends as a generator's return ends it


class SessionBody:
    """A session stream's body: one small object per stream, stepped by its response's
    `async for`, in place of an async generator. An open stream is held for hours, ten
    thousand at once: while it waits, all it holds is this object (its cursor, the epoch,
    the frames still to send) and its buffer's future (`__anext__` hands the future itself to
    the response, which asks again once it is done). Only the steps that read the store (a
    resume's replay, a gap filled from the log, a new epoch's check) run as a coroutine, for
    as long as they read.

    Each step is what the stream sent before, frame for frame: `retry:`, then the snapshot
    (or the replay, `replay_complete`), then each live event in order; a gap in ids is filled
    from the log, a new epoch announced (`state_resync_required`, `history_truncated`)."""

    __slots__ = ("store", "fanout", "ws", "sid", "epoch", "cursor", "subscription", "pending", "opening", "over")

    def __init__(self, state: AppState, ws: str, sid: str, view: SessionView | None, live: bool, last_id: int | None,
                 epoch_hint: str | None, subscription: Subscription) -> None:
        self.store, self.fanout, self.ws, self.sid = state.store, state.fanout, ws, sid
        self.subscription = subscription
        # Strings each stream would hold a copy of, shared by the streams of one session.
        self.epoch = sys.intern(view.epoch) if view is not None else ""
        self.cursor = view.last_event_id if view is not None else 0
        # Frames to send, in order; None, not an empty list, while there are none (56 B a stream).
        self.pending: list[bytes] | None = [f"retry: {RETRY_MS}\n\n".encode()]
        self.over = False  # nothing is sent after `pending`
        # A resume replays from the log: the first step that reads the store.
        self.opening: Awaitable[bytes | None] | None = None
        if last_id is None:
            assert view is not None  # a fresh client of a session not live got a 404
            snapshot = {**live_summary(view), "lastEventId": self.cursor, "eventEpoch": self.epoch}
            if view.meta.get("displayName"):
                snapshot["displayName"] = view.meta["displayName"]  # the title the status lacks
            self.pending.append(control("session_snapshot", snapshot))
        else:
            self.opening = self._replay(last_id, epoch_hint, live)

    def __aiter__(self) -> SessionBody:
        return self

    def __anext__(self) -> Awaitable[bytes | None]:
        """The next frame to send (None: none yet, ask again), as an awaitable: at once, or
        the buffer's future while nothing is there, or a read of the store."""
        if self.pending is not None:
            return _Ready(self._take())
        if self.opening is not None:
            opening, self.opening = self.opening, None
            return opening
        if self.over:
            return _ended()
        subscription = self.subscription
        queue = subscription.queue
        if queue.empty():
            # No timer per wait: the send watch wakes an idle stream for its keepalive.
            return queue.wait()  # a future: no coroutine frame held through the wait
        delivery = queue.get_nowait()
        if delivery is KEEPALIVE:
            return _Ready(KEEPALIVE_FRAME)
        if delivery is None and subscription.closed:
            return _ended()  # this process is shutting down: the client resumes elsewhere (Last-Event-ID)
        if delivery is None or delivery.event_type == RESTORED or delivery.event_id > self.cursor + 1:
            return self._catch_up(delivery)
        if delivery.event_id <= self.cursor:
            return _NOTHING  # already sent (replay and live overlap)
        return _Ready(self._live(delivery))

    def _take(self) -> bytes:
        assert self.pending is not None
        chunk = self.pending.pop(0)
        if not self.pending:
            self.pending = None
        return chunk

    def _send_first(self, frames: list[bytes]) -> bytes | None:
        """The first of `frames` (after any still pending), the rest kept to send next."""
        if self.pending is not None:
            self.pending.extend(frames)
        elif frames:
            self.pending = frames
        return self._take() if self.pending is not None else None

    def _live(self, delivery: Delivery) -> bytes:
        self.cursor = delivery.event_id
        if delivery.event_type in ENDING_TYPES:
            self.over = True
        return frame(delivery.event_type, delivery.raw, delivery.event_id)

    async def _replay(self, last_id: int, epoch_hint: str | None, live: bool) -> bytes | None:
        """A resume: what the client missed from the log, then `replay_complete`."""
        seq, epoch = self.cursor, self.epoch
        cursor, out = last_id, []
        mismatch = bool(epoch_hint) and epoch_hint != epoch
        if mismatch or last_id > seq:
            # The history this id refers to is gone (new epoch): say so, replay all we have.
            out.append(resync("epoch_reset", last_id, seq + 1, detail="epoch_mismatch" if mismatch else None))
            reason = "epoch_changed" if mismatch else "unknown_event_id"
            # `id: 0`: a client that reconnects from here resumes at the new epoch's start.
            data = {"reason": reason, "requestedAfter": last_id, "eventEpoch": epoch}
            out.append(control("history_truncated", data, 0))
            cursor = 0
        frames, cursor, ended = await _from_log(self.store, self.ws, self.sid, cursor, None, epoch)
        out.extend(frames)
        replayed = sum(1 for chunk in frames if chunk.startswith(b"id: "))
        out.append(control(
            "replay_complete",
            {"lastReplayedEventId": cursor, "lastEventId": max(seq, cursor), "replayedCount": replayed},
        ))
        self.cursor = cursor
        self.over = ended or not live
        return self._send_first(out)

    async def _catch_up(self, delivery: Delivery | None) -> bytes | None:
        """A delivery the buffer alone cannot tell: events skipped (None: an overflow, a
        reconnect), a gap in ids, or a new epoch's first event."""
        store, ws, sid = self.store, self.ws, self.sid
        out: list[bytes] = []
        if delivery is None or delivery.event_type == RESTORED:
            # The store may have lost the session's history meanwhile (a restart, a
            # failover), and the worker rewritten it under a new epoch whose ids start
            # again at 1: say so, and go on from the new epoch's start.
            now = await store.session(ws, sid)
            current = now.epoch if now is not None else ""
            if current and current != self.epoch:
                out.append(resync("epoch_reset", self.cursor, 1))
                data = {"reason": "epoch_changed", "requestedAfter": self.cursor, "eventEpoch": current}
                out.append(control("history_truncated", data, 0))
                self.epoch, self.cursor = sys.intern(current), 0
        if delivery is None:  # skipped events (burst overflow, reconnect): catch up from the log
            self.subscription.resync = False
            frames, self.cursor, ended = await _from_log(store, ws, sid, self.cursor, None, self.epoch)
            out.extend(frames)
            self.over = ended
        elif delivery.event_id > self.cursor:
            if delivery.event_id > self.cursor + 1:  # pub/sub lost some: fill the gap from the log
                frames, self.cursor, _ = await _from_log(store, ws, sid, self.cursor, delivery.event_id - 1, self.epoch)
                out.extend(frames)
            out.append(self._live(delivery))
        return self._send_first(out)

    async def aclose(self) -> None:
        """The stream ended: its subscription ends with it."""
        if self.opening is not None:  # never stepped: closed, not left unawaited
            self.opening.close()  # type: ignore[attr-defined]
            self.opening = None
        self.pending = None
        self.over = True
        await self.fanout.unsubscribe(self.subscription)


async def _from_log(store, ws: str, sid: str, after: int, upto: int | None, epoch: str) -> tuple[list[bytes], int, bool]:
    """Frames for ids in (after, upto] from the replay log, the id of the last one, and
    whether the session ended among them. A hole the log cannot fill is announced."""
    envelopes, first_id = await store.replay(ws, sid, after, upto)
    frames: list[bytes] = []
    if first_id is not None and first_id > after + 1:
        frames.append(resync("ring_evicted", after, first_id))
        data = {"reason": "trimmed", "requestedAfter": after, "firstAvailableEventId": first_id, "eventEpoch": epoch}
        frames.append(control("history_truncated", data))
    cursor, ended = after, False
    for raw in envelopes:
        cursor, event_type = _event_id_and_type(raw)
        frames.append(frame(event_type, raw, cursor))
        ended = ended or event_type in ENDING_TYPES
    return frames, cursor, ended

