"""A session stream's body (`GET /session/:id/events`): one small object per open stream,
stepped by its response (`response.EventStreamResponse`), in place of an async generator."""

from __future__ import annotations

import sys
from typing import Any, Awaitable, Generator

from acp_state.store import Delivery, Fanout, ReaderStore, SessionView, Subscription

from .frames import ENDING_TYPES, KEEPALIVE, KEEPALIVE_FRAME, RESTORED, RETRY_MS, control, event_id_and_type, frame, resync
from ..reads.summaries import live_summary


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

    def __init__(self, store: ReaderStore, fanout: Fanout, ws: str, sid: str, view: SessionView | None, live: bool,
                 last_id: int | None, epoch_hint: str | None, subscription: Subscription) -> None:
        self.store, self.fanout, self.ws, self.sid = store, fanout, ws, sid
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
        cursor, event_type = event_id_and_type(raw)
        frames.append(frame(event_type, raw, cursor))
        ended = ended or event_type in ENDING_TYPES
    return frames, cursor, ended
