"""Live event delivery: a process's pub/sub connections, shared by every listener.

Channels are sharded (SSUBSCRIBE, Redis >= 7.0). On a single Redis one connection carries
them all; on a cluster there is one connection per node, and each channel is subscribed on
the node that owns its slot. When a slot moves, Redis ends its subscriptions there
(an unsolicited `sunsubscribe`); they are made again on the new owner.

Pub/sub is at-most-once, so it is only the fast path: every event also sits in the
session's replay log, and a listener that sees a gap in event ids (or is told that its
subscription was re-established) fills it from the log.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import keys
from .connection import HEALTH_CHECK_S, Client, is_cluster, node_client
from .types import Change
from ..tasks import BACKGROUND_ERRORS, survive

log = logging.getLogger("acp_state.fanout")

DEFAULT_BUFFER = 256
CONFIRM_TIMEOUT_S = 5.0
RECONNECT_DELAY_S = 0.2
# A process follows the changes of at most this many workspaces (one subscription each);
# reads in further workspaces go to Redis every time.
MAX_WATCHED = 10_000
# On a cluster, a node can stall while its replica takes its slots over: the connection to
# the stalled node stays open and silent while the changes go out on the new owner. A
# change link counts as current only while its node answered a ping within FRESH_S, which
# stays below any cluster's failover time (cluster-node-timeout, 2 s at its shortest in our
# chaos runs, 15 s by default); a link that went silent longer may have missed changes.
PING_S = 0.25
FRESH_S = 1.0
FRESH_TOKEN = "acp-state-fresh"
# A read served from a cache first waits for a ping sent on its change link after the read
# began (`sync`); a link that does not answer within this long is not trusted for the read.
SYNC_TIMEOUT_S = 1.0
# Sync pings a link may have out at once. A read waits for the first ping written after it
# began, not for the one already out to come back first; past this many (Redis slow or
# stalled), reads share the ping written as the oldest comes back.
MAX_PINGS_OUT = 8


def changes(ws: str, message: str) -> list[Change]:
    """The changes one message of a workspace's change channel announces (changes.lua):
    `<sid>[,<sid>...] <revision> <generation>`, one revision per session named, the last at
    `revision`."""
    sids, revision, generation = (message.split(" ") + ["0", ""])[:3]
    named = sids.split(",")
    first = int(revision) - len(named) + 1
    return [Change(ws, sid, first + n, generation) for n, sid in enumerate(named)]


@dataclass(frozen=True)
class Delivery:
    """One event as it arrived: its id, its type and the envelope JSON as published."""

    event_id: int
    event_type: str
    raw: str


class Buffer:
    """A bounded FIFO read by one listener: asyncio.Queue's interface as an event stream uses
    it, without its four deques and its task accounting (one open stream holds one, and an
    API process may hold 10,000 streams). A list while it holds items (at most `maxsize`),
    None while it is empty: an idle stream holds no empty list (56 B)."""

    __slots__ = ("_items", "maxsize", "_waiter")

    def __init__(self, maxsize: int = DEFAULT_BUFFER) -> None:
        self._items: list[Any] | None = None
        self.maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items) if self._items is not None else 0

    def empty(self) -> bool:
        return self._items is None

    def put_nowait(self, item: Any) -> None:
        if self._items is None:
            self._items = [item]
        elif len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def get_nowait(self) -> Any:
        if self._items is None:
            raise asyncio.QueueEmpty
        item = self._items.pop(0)
        if not self._items:
            self._items = None
        return item

    def wait(self) -> asyncio.Future[None]:
        """A future done once an item is put: what an open stream awaits while its buffer is
        empty (a future, not a coroutine frame as `get` holds)."""
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
            if self._items is not None:
                self._waiter.set_result(None)
        return self._waiter

    async def get(self) -> Any:
        while self._items is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()


@dataclass(eq=False, slots=True)  # one per open stream: no instance dict
class Subscription:
    """One listener's bounded buffer. A burst that overflows it is never waited for: the
    buffer is emptied and the listener told to catch up from the replay log instead."""

    channel: str
    queue: Buffer = field(default_factory=Buffer)
    resync: bool = False  # events were skipped (overflow, reconnect): check the log for gaps
    closed: bool = False  # the process is shutting down: the listener should end now

    def close(self) -> None:
        """Tell the listener to end (it wakes on the None)."""
        self.closed = True
        self.deliver(None)

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


class _PubSub(PubSub):
    """redis-py's PubSub, reading a ping's reply on a sharded-only connection right.

    Redis answers PING there as a plain reply (not `["pong", msg]`), which redis-py takes
    for a pong only when replies are bytes: with decoded replies it read the string's
    letters as a message's type, channel and data."""

    async def handle_message(self, response: Any, ignore_subscribe_messages: bool = False) -> Any:
        if isinstance(response, str):
            response = ["pong", "" if response == "PONG" else response]
        return await super().handle_message(response, ignore_subscribe_messages)


@dataclass
class _Round:
    """The ping out for syncs on a link, and the reads it will answer."""

    number: int
    waiting: list[asyncio.Future[bool]]
    timer: asyncio.TimerHandle


class _Link:
    """One pub/sub connection (the server's, or one cluster node's) and the task reading it.

    It also runs the syncs of the reads that count on it (`sync`): the reads that arrive in
    one turn of the event loop share one ping, written at the end of that turn, and each
    waits for its own ping only (pings are pipelined, up to MAX_PINGS_OUT). All of it runs
    in callbacks, with no task and no timeout context per round.
    """

    def __init__(self, name: str, pubsub: Any) -> None:
        self.name = name
        self.pubsub = pubsub
        self.channels: set[str] = set()
        self.leaving: Counter[str] = Counter()  # our SUNSUBSCRIBEs not yet confirmed
        self.connected = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # Its loop, kept: asyncio.get_running_loop() makes a getpid() system call each time,
        # as much as the rest of a sync's bookkeeping.
        self.loop = asyncio.get_running_loop()
        self.heard = self.loop.time()  # the node's last answer to a ping
        self.lapsed = False  # it was found silent for longer than FRESH_S
        self.closed = False  # failed or closed: no sync counts on it any more
        self.pings_sent = 0  # our pings are numbered; their answers come back in order
        self.rounds: deque[_Round] = deque()  # the pings out for syncs, oldest first
        self.next_round: list[asyncio.Future[bool]] = []  # syncs waiting for their ping
        self.round_due = False  # a call to write the next round's ping is scheduled
        # Read directly (`Fanout._next_message`): redis-py's own connections only, not the
        # embedded default's (fakeredis reads differently).
        self.direct = not pubsub.connection_pool.connection_class.__module__.startswith("fakeredis")

    def ping(self) -> int | None:
        """Write a numbered ping; its number, or None when it could not be written.

        Written as it is, past redis-py's PubSub.execute_command and the connection's
        awaited send (its retry wrapper, health check and drain cost more than the ping): a
        failed write is a dead connection, which the pump notices and repairs."""
        connection = self.pubsub.connection
        if self.closed or not self.connected.is_set() or connection is None or not connection.is_connected:
            return None
        self.pings_sent += 1
        try:
            connection._writer.writelines(connection.pack_command("PING", f"{FRESH_TOKEN} {self.pings_sent}"))
        except Exception:
            log.debug("ping on %s failed", self.name, exc_info=True)
            return None
        return self.pings_sent

    def sync(self) -> asyncio.Future[bool]:
        """Resolves True once a ping written after this call came back (False: it did not
        within SYNC_TIMEOUT_S, or the link failed)."""
        waiter: asyncio.Future[bool] = self.loop.create_future()
        if self.closed:
            waiter.set_result(False)
            return waiter
        self.next_round.append(waiter)
        if not self.round_due:
            self.round_due = True
            self.loop.call_soon(self._start_round)  # at the end of this turn: its reads share it
        return waiter

    def _start_round(self) -> None:
        self.round_due = False
        if not self.next_round or len(self.rounds) >= MAX_PINGS_OUT:
            return  # nothing waits, or too many out: the next answer starts it
        waiting, self.next_round = self.next_round, []
        number = self.ping()
        if number is None:
            _resolve(waiting, False)
            return
        timer = self.loop.call_later(SYNC_TIMEOUT_S, self.answered, number, False)
        self.rounds.append(_Round(number, waiting, timer))

    def answered(self, number: int, ok: bool = True) -> None:
        """Every ping up to `number` came back (or, with ok False, never will: silent, a
        stall). A read never counts on a ping that was out before it came."""
        while self.rounds and self.rounds[0].number <= number:
            out = self.rounds.popleft()
            out.timer.cancel()
            _resolve(out.waiting, ok)
        if self.next_round and not self.round_due:
            self._start_round()  # reads held back while too many pings were out

    def fail(self) -> None:
        """The connection failed or closes: every sync waiting on it is answered False."""
        self.closed = True
        self.answered(self.pings_sent, ok=False)
        waiting, self.next_round = self.next_round, []
        _resolve(waiting, False)

    def fresh(self) -> bool:
        if self.lapsed:
            return False
        if self.loop.time() - self.heard > FRESH_S:
            self.lapsed = True
        return not self.lapsed


async def _all_synced(waiting: list[asyncio.Future[bool]]) -> bool:
    return bool(waiting) and all(await asyncio.gather(*waiting))


def _resolve(waiters: list[asyncio.Future[bool]], ok: bool) -> None:
    for waiter in waiters:
        if not waiter.done():  # a read that gave up (cancelled) is skipped
            waiter.set_result(ok)


class Fanout:
    """Also the change feed of the process's caches. `watch(ws)` follows a workspace's change
    channel, where every status change of its sessions is announced before the change's
    events: `on_change(Change)` therefore runs before any listener of this process gets such
    an event. `on_reset()` runs when messages may have been lost."""

    def __init__(
        self,
        redis: Client,
        on_change: Callable[[Change], None] | None = None,
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        self._redis = redis
        self._cluster = is_cluster(redis)
        self.on_change = on_change
        self.on_reset = on_reset
        self._links: dict[str, _Link] = {}
        self._subscriptions: dict[str, set[Subscription]] = {}
        # Every channel this process means to be subscribed to, set while Redis confirms it.
        self._confirmed: dict[str, asyncio.Event] = {}
        self._watched: dict[str, str] = {}  # workspaces whose changes we follow -> their channel
        self._interrupted: set[str] = set()  # subscriptions lost and not yet confirmed again
        self._lock = asyncio.Lock()
        self._broken: set[str] = set()  # subscriptions to make again
        self._retired: list[_Link] = []  # failed connections to close
        self._repair: asyncio.Task[None] | None = None
        self._link_of: dict[str, _Link] = {}  # channel -> the link it is subscribed on
        self._pinger: asyncio.Task[None] | None = None
        self._stopped = False
        self._ending = False

    def end_listeners(self) -> None:
        """Shutdown begins: every listener, and any that still arrives, is told to end."""
        self._ending = True
        for listeners in self._subscriptions.values():
            for subscription in listeners:
                subscription.close()

    async def stop(self) -> None:
        self._stopped = True
        for task in (self._repair, self._pinger):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for link in [*self._links.values(), *self._retired]:
            await self._close(link)
        self._links.clear()

    # ---- listeners (SSE) ----------------------------------------------------------------

    async def subscribe_session(self, ws: str, sid: str, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """Listen to a session's live events (confirmed on return)."""
        # Interned: the streams of one session share the channel's name (each holds it for hours).
        return await self.subscribe(sys.intern(keys.events(ws, sid)), buffer)

    async def subscribe(self, channel: str, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """Listen to a channel; returns once Redis confirmed the subscription."""
        subscription = Subscription(channel, Buffer(buffer))
        listeners = self._subscriptions.setdefault(channel, set())
        listeners.add(subscription)
        try:
            await self._ensure(channel)
        except BaseException:
            await self.unsubscribe(subscription)
            raise
        if self._ending:
            subscription.close()
        return subscription

    async def unsubscribe(self, subscription: Subscription) -> None:
        listeners = self._subscriptions.get(subscription.channel)
        if not listeners:
            return
        listeners.discard(subscription)
        if not listeners:
            del self._subscriptions[subscription.channel]
            await self._drop(subscription.channel)

    @property
    def listeners(self) -> int:
        return sum(len(s) for s in self._subscriptions.values())

    # ---- the change feed (caches) -------------------------------------------------------

    def watching(self, ws: str) -> bool:
        """True while this process is subscribed to the workspace's change channel (on a
        cluster: and its node answered a ping lately)."""
        return self._change_link(ws) is not None

    def _change_link(self, ws: str) -> _Link | None:
        """The link the workspace's changes arrive on, while they can be counted on."""
        channel = self._watched.get(ws)
        if channel is None:
            return None
        confirmed = self._confirmed.get(channel)
        if confirmed is None or not confirmed.is_set():
            return None
        link = self._link_of.get(channel)
        if link is None or (self._cluster and not link.fresh()):
            return None  # one server: a stalled server takes no change either
        return link

    def sync(self, ws: str) -> asyncio.Future[bool]:
        """Resolves True once every change of the workspace announced before this call has
        reached `on_change`: a ping sent on its change link after the call came back, and
        Redis answers a connection's commands and pushes in order. False when that cannot
        be said in time (not watching, the link silent or gone): the caller reads Redis
        instead.

        This is what lets a cache serve a read that comes after a change acknowledged
        through another process (ZooKeeper's `sync`, Raft's read index). The reads that
        arrive in one turn of the event loop share one ping, written at the end of the
        turn, and wait for that ping alone: one round trip, not the rest of a ping already
        out as well (`_Link`). A read never counts on a ping that was out before it came.
        Pongs come back in order, so any later ping's answer also answers the earlier ones.
        A plain call returning the link's future, not a coroutine: it is on every cached
        read's path. Answered within SYNC_TIMEOUT_S, whatever happens.
        """
        link = self._change_link(ws)
        if link is not None:
            return link.sync()
        unsure: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        unsure.set_result(False)
        return unsure

    def sync_all(self, workspaces: list[str]) -> Awaitable[bool]:
        """`sync` of many workspaces at once (a read that spans them): one wait per link
        they share, so one on a single server, whatever their number."""
        links: dict[int, _Link] = {}
        for ws in workspaces:
            link = self._change_link(ws)
            if link is None:
                return self.sync(ws)  # not followed: answered False at once
            links[id(link)] = link
        if len(links) != 1:
            return _all_synced([link.sync() for link in links.values()])
        return next(iter(links.values())).sync()

    async def watch(self, ws: str) -> bool:
        """Follow a workspace's changes; False when too many workspaces are followed."""
        if ws not in self._watched:
            if len(self._watched) >= MAX_WATCHED:
                return False
            self._watched[ws] = keys.invalidations(ws)
        await self._ensure(self._watched[ws])
        return True

    # ---- connections --------------------------------------------------------------------
    # Every SSUBSCRIBE/SUNSUBSCRIBE happens under one lock: redis-py opens a pub/sub
    # connection inside its first command, and two concurrent first commands would each open
    # one. Lost subscriptions (a dead connection, a slot that moved) are remade by a single
    # repair task, after refreshing the cluster's slot map, until they hold.

    async def _ensure(self, channel: str) -> None:
        if channel not in self._confirmed:
            self._confirmed[channel] = asyncio.Event()
            try:
                async with self._lock:
                    await self._subscribe(channel)
            except BaseException:  # not sent (Redis away): the next caller tries again
                self._confirmed.pop(channel, None)
                raise
        confirmed = self._confirmed[channel]
        if confirmed.is_set():
            return  # subscribed already: no wait_for (a task, a timer and a future for each caller)
        try:
            await asyncio.wait_for(confirmed.wait(), CONFIRM_TIMEOUT_S)
        except asyncio.TimeoutError:  # Redis did not confirm (stalled, failing over): a store fault
            raise RedisTimeoutError(f"the subscription to {channel} was not confirmed in {CONFIRM_TIMEOUT_S:g} s") from None

    async def _drop(self, channel: str) -> None:
        self._confirmed.pop(channel, None)
        self._link_of.pop(channel, None)
        self._interrupted.discard(channel)
        async with self._lock:
            for link in self._links.values():
                if channel in link.channels:
                    link.channels.discard(channel)
                    link.leaving[channel] += 1
                    try:
                        await link.pubsub.sunsubscribe(channel)
                    except Exception:  # a dead connection: its repair skips unwanted channels
                        log.debug("sunsubscribe %s failed", channel, exc_info=True)

    async def _subscribe(self, channel: str) -> None:
        if self._cluster:
            await self._redis.initialize()  # a no-op once the slot map is known
            node = self._redis.get_node_from_key(channel)
            name, connect = node.name, (lambda: node_client(node))
        else:
            name, connect = "redis", (lambda: self._redis)
        link = self._links.get(name)
        if link is None:
            client = connect()
            pubsub = _PubSub(client.connection_pool)
            link = _Link(name, pubsub)
            self._links[name] = link
            link.task = asyncio.ensure_future(self._pump(link))
            if self._pinger is None:
                self._pinger = asyncio.ensure_future(self._ping_loop())
        link.channels.add(channel)
        self._link_of[channel] = link
        await link.pubsub.ssubscribe(channel)
        link.connected.set()

    async def _pump(self, link: _Link) -> None:
        await link.connected.wait()  # redis-py opens the connection on the first SSUBSCRIBE
        while True:
            try:
                # redis-py pings an idle connection (health check), and reconnects and
                # re-subscribes by itself when it can: the repeated confirmations say so.
                message = await self._next_message(link)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # dead, or a subscription refused (MOVED): start over
                log.warning("pub/sub connection %s failed (%r); re-subscribing", link.name, error)
                link.fail()
                if self._links.get(link.name) is link:
                    del self._links[link.name]
                self._retired.append(link)
                self._lost(list(link.channels))
                return
            if message is None:
                continue
            try:
                self._handle(link, message)
            except Exception:  # one bad message (or listener) must not end the connection's pump
                BACKGROUND_ERRORS.labels("fan-out delivery").inc()
                log.exception("delivering a message of %s failed", link.name)

    async def _next_message(self, link: _Link) -> dict[str, Any] | None:
        """The link's next message (None: a health check's answer, or nothing for a while).

        The connection is read directly: redis-py's get_message wraps every read in a
        health check, a retry wrapper and a timeout context, which cost a loaded process
        about as much as the rest of a sync's round, and every event of every stream goes
        through here. What those did is done otherwise: the link is pinged when idle
        (`_ping_loop`), and a read that fails goes to get_message, whose retry reconnects.
        A connection redis-py has not opened yet, and the embedded default's (fakeredis
        reads differently), go through get_message too."""
        pubsub = link.pubsub
        connection = pubsub.connection
        if not link.direct or connection is None or not connection.is_connected:
            return await pubsub.get_message(timeout=5.0)
        try:
            response = await connection.read_response(timeout=math.inf, disconnect_on_error=False, push_request=True)
        except (RedisConnectionError, RedisTimeoutError):
            # redis-py's own recovery: it reconnects and subscribes again (the repeated
            # confirmations say so), or raises, and the pump starts the link over.
            log.info("pub/sub connection %s broke; reconnecting", link.name)
            return await pubsub.get_message(timeout=5.0)
        if response is None:
            # A read that returns nothing has met a connection that is gone (torn under a
            # write, or closed without an error). Reading it again returns nothing again at
            # once, and a loop whose awaits never wait never lets the event loop run: the
            # process stopped answering and grew by gigabytes (`python -m bench.chaos
            # --hosts`, an API partitioned from Redis). The pump starts the link over instead.
            raise RedisConnectionError(f"the pub/sub connection {link.name} read nothing: it is closed")
        if connection.health_check_interval and response in pubsub.health_check_response:
            return None
        return await pubsub.handle_message(response)  # type: ignore[no-any-return]

    def _handle(self, link: _Link, message: dict[str, Any]) -> None:
        kind, channel = message["type"], message["channel"]
        if kind == "pong":
            token, _, number = str(message["data"]).partition(" ")
            if token == FRESH_TOKEN:
                self._heard(link)
                link.answered(int(number or 0))
            return
        if kind == "smessage":
            if channel.endswith(":inv"):
                if self.on_change is not None:
                    for change in changes(keys.workspace_of_channel(channel), message["data"]):
                        self.on_change(change)
                return
            try:
                envelope = orjson.loads(message["data"])
                delivery = Delivery(int(envelope["id"]), envelope["type"], message["data"])
            except (ValueError, KeyError, TypeError):
                return
            for subscription in list(self._subscriptions.get(channel, ())):
                subscription.deliver(delivery)
        elif kind == "ssubscribe":
            confirmed = self._confirmed.get(channel)
            if confirmed is None or channel not in link.channels:
                return
            again = confirmed.is_set() or channel in self._interrupted
            self._interrupted.discard(channel)
            confirmed.set()
            if again:
                self._resumed(channel)
        elif kind == "sunsubscribe" and link.leaving[channel] > 0:
            link.leaving[channel] -= 1  # the confirmation of our own SUNSUBSCRIBE
            if not link.leaving[channel]:
                del link.leaving[channel]
        elif kind == "sunsubscribe" and channel in self._confirmed and channel in link.channels:
            # Not asked for: the channel's slot moved to another node. Follow it there.
            log.info("the slot of %s moved; re-subscribing on its new owner", channel)
            link.channels.discard(channel)
            link.pubsub.shard_channels.pop(channel, None)
            self._lost([channel])

    def _lost(self, channels: list[str]) -> None:
        """Messages on these channels may be lost until they are confirmed again."""
        for channel in channels:
            if channel in self._confirmed:
                self._confirmed[channel].clear()  # whoever waits for it, waits for its return
                self._interrupted.add(channel)
            # Its listeners read the log now, not only once the subscription is back: with
            # Redis reachable they miss nothing meanwhile (and read again at the return);
            # with Redis away (this process cut off from it) the read fails and their
            # streams end, so their clients reconnect, to another API process if need be,
            # instead of waiting on a stream that says nothing.
            for subscription in list(self._subscriptions.get(channel, ())):
                subscription.deliver(None)
        if self.on_reset is not None and any(c.endswith(":inv") for c in channels):
            self.on_reset()
        self._broken.update(channels)
        if self._repair is None or self._repair.done():
            self._repair = asyncio.ensure_future(self._repair_loop())

    def _resumed(self, channel: str) -> None:
        """A subscription is back: whatever was published meanwhile was never seen here."""
        if channel.endswith(":inv"):
            if self.on_reset is not None:
                self.on_reset()  # also voids the reads that began during the gap
        for subscription in list(self._subscriptions.get(channel, ())):
            subscription.deliver(None)

    def _heard(self, link: _Link) -> None:
        link.heard = link.loop.time()
        if link.lapsed:  # changes may have gone out elsewhere while its node was silent
            link.lapsed = False
            log.info("pub/sub connection %s answers again; the caches start over", link.name)
            if self.on_reset is not None:
                self.on_reset()

    async def _ping_loop(self) -> None:
        """Ping every link: on a cluster every PING_S, so a silent node is noticed within
        FRESH_S (`watching`); on one server when it would be idle (HEALTH_CHECK_S), so a
        dead connection is noticed and replaced (the pump's direct reads skip redis-py's
        own health check)."""
        period = PING_S if self._cluster else HEALTH_CHECK_S
        while not self._stopped:
            await asyncio.sleep(period)
            await survive("fan-out ping", self._ping_once)

    async def _ping_once(self) -> None:
        for link in list(self._links.values()):
            if self._cluster:
                link.fresh()  # a silence is noted even while no read asks
            link.ping()  # its answer counts in `_heard`

    async def _repair_loop(self) -> None:
        while self._broken and not self._stopped:
            await asyncio.sleep(RECONNECT_DELAY_S)  # let a failover or a slot move settle
            await survive("fan-out repair", self._repair_once)

    async def _repair_once(self) -> None:
        async with self._lock:
            for link in self._retired:
                await self._close(link)
            self._retired.clear()
            if self._cluster:
                await self._redis.nodes_manager.initialize()  # the current slot map
            for channel in list(self._broken):
                if channel in self._confirmed:
                    await self._subscribe(channel)
                self._broken.discard(channel)

    async def _close(self, link: _Link) -> None:
        link.fail()
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()
            await asyncio.gather(link.task, return_exceptions=True)
        try:
            await link.pubsub.aclose()
        except Exception:
            pass
