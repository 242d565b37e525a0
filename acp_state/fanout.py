"""Live event delivery: one Redis pub/sub connection per process, shared by every listener.

Pub/sub is at-most-once, so it is only the fast path: every event also sits in the
session's replay log, and a listener that sees a gap in event ids (or is told the
connection was re-established) fills it from the log.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import orjson
import redis.asyncio as aioredis

from . import keys

log = logging.getLogger("acp_state.fanout")

DEFAULT_BUFFER = 256
CONFIRM_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Delivery:
    """One event as it arrived: its id, its type and the envelope JSON as published."""

    event_id: int
    event_type: str
    raw: str


@dataclass(eq=False)
class Subscription:
    """One listener's bounded buffer. A burst that overflows it is never waited for: the
    buffer is emptied and the listener told to catch up from the replay log instead."""

    channel: str
    queue: asyncio.Queue[Delivery | None] = field(default_factory=lambda: asyncio.Queue(DEFAULT_BUFFER))
    resync: bool = False  # events were skipped (overflow, reconnect): check the log for gaps

    def deliver(self, item: Delivery | None) -> None:
        if item is not None and self.resync:
            return  # the catch-up from the log will include it
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.resync = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


class Fanout:
    """Also the change feed of the process's caches: `on_change(channel, message)` sees every
    event and invalidation of the deployment (one pattern subscription) before any listener
    of this process gets the event, and `on_reset()` when messages may have been lost."""

    def __init__(
        self,
        redis: aioredis.Redis,
        probe_channel: str,
        on_change: Callable[[str, str], None] | None = None,
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        self._pubsub = redis.pubsub()
        self._probe = probe_channel
        self._on_change = on_change
        self._on_reset = on_reset
        self._subscriptions: dict[str, set[Subscription]] = {}
        self._confirmed: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._pubsub.subscribe(self._probe)
        if self._on_change is not None:
            await self._pubsub.psubscribe(keys.EVENT_CHANNELS, keys.INVALIDATION_CHANNELS)
        self._task = asyncio.ensure_future(self._pump())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()

    async def subscribe(self, channel: str, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """Listen to a channel; returns once Redis confirmed the subscription."""
        subscription = Subscription(channel, asyncio.Queue(buffer))
        listeners = self._subscriptions.setdefault(channel, set())
        listeners.add(subscription)
        if len(listeners) == 1:
            self._confirmed[channel] = asyncio.Event()
            await self._pubsub.subscribe(channel)
        await asyncio.wait_for(self._confirmed[channel].wait(), CONFIRM_TIMEOUT_S)
        return subscription

    async def unsubscribe(self, subscription: Subscription) -> None:
        listeners = self._subscriptions.get(subscription.channel)
        if not listeners:
            return
        listeners.discard(subscription)
        if not listeners:
            del self._subscriptions[subscription.channel]
            self._confirmed.pop(subscription.channel, None)
            await self._pubsub.unsubscribe(subscription.channel)

    @property
    def listeners(self) -> int:
        return sum(len(s) for s in self._subscriptions.values())

    async def _pump(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=5.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("pub/sub connection lost; re-subscribing", exc_info=True)
                await asyncio.sleep(0.2)
                await self._resubscribe()
                continue
            if message is None:
                continue
            kind, channel = message["type"], message["channel"]
            if kind in ("message", "pmessage") and self._on_change is not None:
                # Redis sends a channel's subscribers the message before its pattern
                # subscribers: invalidate first, so no listener of this process can see an
                # event and then read a cached state from before it.
                self._on_change(channel, message["data"])
            if kind == "subscribe" and channel in self._confirmed:
                self._confirmed[channel].set()
            elif kind == "message" and channel in self._subscriptions:
                try:
                    envelope = orjson.loads(message["data"])
                    delivery = Delivery(int(envelope["id"]), envelope["type"], message["data"])
                except (ValueError, KeyError, TypeError):
                    continue
                for subscription in list(self._subscriptions.get(channel, ())):
                    subscription.deliver(delivery)

    async def _resubscribe(self) -> None:
        if self._on_reset is not None:
            self._on_reset()  # changes published while we were away were never seen
        try:
            await self._pubsub.subscribe(self._probe, *self._subscriptions)
            if self._on_change is not None:
                await self._pubsub.psubscribe(keys.EVENT_CHANNELS, keys.INVALIDATION_CHANNELS)
        except Exception:
            log.warning("re-subscribe failed", exc_info=True)
            return
        for listeners in self._subscriptions.values():
            for subscription in listeners:
                subscription.deliver(None)
